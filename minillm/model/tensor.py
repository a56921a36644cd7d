# Generated from notebooks/01_tensors.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""A small strided tensor: storage, layout (shape, strides, offset) and dtype.

Built in notebooks/01_tensors.ipynb, which explains every piece; each is checked there and in
tests/model/test_tensor.py against PyTorch, which uses the same memory model.

References:
- E. Yang, "PyTorch internals" (2019): strides, storage and views.
- Candle's `Tensor { storage, layout, dtype }` and `Layout { shape, stride, start_offset }`.
"""

from __future__ import annotations

import array
import itertools
import math
import operator
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

import torch

# dtype name -> (array.array type code, torch dtype)
DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "float32": ("f", torch.float32),
    "float64": ("d", torch.float64),
    "int64": ("q", torch.int64),
}


def _validate_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"Storage: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")

def _dtype_name(dtype: torch.dtype) -> str:
    name = {v[1]: k for k, v in DTYPES.items()}.get(dtype)
    if name is None:
        raise TypeError(f"from_torch: dtype {dtype} not supported, expected one of {sorted(DTYPES)}")
    return name

def _require(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    """Raise error(message) unless ok: the one-line checks of the lesson cells."""
    if not ok:
        raise error(message)

def _validate_index(index: Sequence[int], shape: tuple[int, ...]) -> None:
    if len(index) != len(shape):
        raise ValueError(f"index {tuple(index)} has {len(index)} entries, tensor has {len(shape)} dims")
    for d, (i, size) in enumerate(zip(index, shape)):
        if not 0 <= i < size:
            raise IndexError(f"index {i} out of range for dim {d} of size {size}")

def _validate_fits(storage, layout) -> None:
    if layout.numel() > 0:
        last = layout.offset + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride))
        if layout.offset < 0 or last >= len(storage) or any(st < 0 for st in layout.stride):
            raise ValueError(f"layout {layout} reads outside a storage of {len(storage)} elements")

def _validate_dim(dim: int, ndim: int, name: str = "dim") -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{name} {dim} out of range for a tensor with {ndim} dimensions")
    return dim % ndim if ndim else 0

def _validate_position(index: int, size: int, dim: int) -> int:
    if not -size <= index < size:
        raise IndexError(f"index {index} out of range for dim {dim} of size {size}")
    return index % size

def _validate_permutation(dims: Sequence[int], ndim: int) -> list[int]:
    dims = [_validate_dim(d, ndim) for d in dims]
    if sorted(dims) != list(range(ndim)):
        raise ValueError(f"permute: dims {tuple(dims)} is not a permutation of 0..{ndim - 1}")
    return dims

def _validate_narrow(size: int, dim: int, start: int, length: int) -> None:
    if start < 0 or length < 0 or start + length > size:
        raise ValueError(f"narrow: start {start} + length {length} exceeds size {size} of dim {dim}")

def _view_shape(t, shape: Sequence[int]) -> tuple[int, ...]:
    """view's target shape, with at most one -1 filled in; t must be contiguous."""
    numel, shape = t.numel(), list(shape)
    if shape.count(-1) > 1:
        raise ValueError(f"view: only one dimension can be -1, got {tuple(shape)}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            raise ValueError(f"view: shape {tuple(shape)} is invalid for {numel} elements")
        shape[shape.index(-1)] = numel // known
    if math.prod(shape) != numel:
        raise ValueError(f"view: shape {tuple(shape)} is invalid for {numel} elements")
    if not t.is_contiguous():
        raise ValueError(
            f"view: tensor of shape {t.shape} with strides {t.stride()} is not contiguous; "
            "call contiguous() first, or use reshape(), which copies when it must"
        )
    return tuple(shape)

def _index_key(key, ndim: int) -> tuple:
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > ndim:
        raise IndexError(f"too many indices ({len(key)}) for a tensor of {ndim} dims")
    return key

def _slice_range(k, size: int, dim: int) -> tuple[int, int, int]:
    if not isinstance(k, slice):
        raise TypeError(f"index for dim {dim} must be an int or a slice, got {type(k).__name__}")
    start, stop, step = k.indices(size)
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step} for dim {dim}")
    return start, stop, step

def _validate_matmul(a, b) -> tuple[int, int, int]:
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs at least 2 dims on each side, got shapes {a.shape} and {b.shape}")
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: inner sizes differ: {a.shape} @ {b.shape} ({k} != {k2})")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: dtypes differ ({a.dtype} vs {b.dtype})")
    return m, k, n


class Storage:
    """A flat, typed buffer of numbers: the only place a tensor's values live."""

    def __init__(self, values: Sequence[float], dtype: str = "float32"):
        _validate_dtype(dtype)
        self.dtype = dtype
        self.data = array.array(DTYPES[dtype][0], values)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> float:
        return self.data[i]

    def __setitem__(self, i: int, value: float) -> None:
        self.data[i] = value

    @property
    def nbytes(self) -> int:
        return len(self.data) * self.data.itemsize

    def __repr__(self) -> str:
        return f"Storage({list(self.data)}, dtype={self.dtype})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides: the last dimension moves by 1, each earlier one by the size of what follows."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Layout:
    """How to read a flat storage as an n-dimensional array: shape, strides, offset."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def contiguous(shape: Sequence[int], offset: int = 0) -> Layout:
        shape = tuple(int(s) for s in shape)
        _require(all(s >= 0 for s in shape), f"Layout: sizes must be >= 0, got shape {shape}")
        return Layout(shape, contiguous_strides(shape), offset)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def position(self, index: Sequence[int]) -> int:
        """Storage position of the element at `index`: offset + sum(i_d * stride_d)."""
        _validate_index(index, self.shape)
        return self.offset + sum(i * stride for i, stride in zip(index, self.stride))

    def positions(self) -> Iterator[int]:
        """Storage positions of all elements, in row-major (logical) order."""
        for index in itertools.product(*(range(s) for s in self.shape)):
            yield self.offset + sum(i * s for i, s in zip(index, self.stride))

    def is_contiguous(self) -> bool:
        """True when a row-major walk reads the storage in order, with no gaps (size-1 dims ignored)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _flatten(nested) -> tuple[list, tuple[int, ...]]:
    """Flatten a nested list into (values, shape), checking that it is rectangular."""
    if not isinstance(nested, (list, tuple)):
        return [nested], ()
    if len(nested) == 0:
        return [], (0,)
    parts = [_flatten(item) for item in nested]
    inner = parts[0][1]
    for k, (_, shape) in enumerate(parts):
        if shape != inner:
            raise ValueError(f"ragged nested list: item 0 has shape {inner}, item {k} has shape {shape}")
    return [v for values, _ in parts for v in values], (len(nested), *inner)


def _nest(flat: list, shape: tuple[int, ...]):  # the inverse of _flatten
    for size in reversed(shape[1:]):
        flat = [flat[k : k + size] for k in range(0, len(flat), size)]
    return flat[0] if len(shape) == 0 else flat


class _TorchStyle:
    """PyTorch's names for a Tensor: each forwards to the layout or to a function of this module."""

    @property
    def ndim(self) -> int:
        return self.layout.ndim
    def stride(self) -> tuple[int, ...]:
        return self.layout.stride
    def numel(self) -> int:
        return self.layout.numel()
    def is_contiguous(self) -> bool:
        return self.layout.is_contiguous()
    def shares_storage(self, other: Tensor) -> bool:
        return self.storage is other.storage

    @staticmethod
    def from_torch(t: torch.Tensor) -> Tensor:
        dtype = _dtype_name(t.dtype)
        return Tensor(Storage(t.detach().cpu().contiguous().flatten().tolist(), dtype), Layout.contiguous(t.shape))

    def to_torch(self) -> torch.Tensor:
        """A torch tensor over the *same memory*, with the same shape, strides and offset."""
        data = self.storage.data
        flat = torch.frombuffer(data, dtype=DTYPES[self.dtype][1]) if len(data) else torch.empty(0)
        return torch.as_strided(flat, self.shape, self.stride(), self.layout.offset)

    # PyTorch's operators and method names, one line each. Each calls the module's function of the
    # same name, which Python looks up when the method runs (so the functions may come further down).
    def __getitem__(self, key): return getitem(self, key)
    def __add__(self, other): return add(self, other)
    __radd__ = __add__
    def __mul__(self, other): return mul(self, other)
    __rmul__ = __mul__
    def __matmul__(self, other): return matmul(self, other)
    T = property(lambda self: transpose(self, -2, -1))
    def transpose(self, dim0, dim1): return transpose(self, dim0, dim1)
    def permute(self, dims): return permute(self, dims)
    def narrow(self, dim, start, length): return narrow(self, dim, start, length)
    def select(self, dim, index): return select(self, dim, index)
    def view(self, shape): return view(self, shape)
    def reshape(self, shape): return reshape(self, shape)
    def expand(self, shape): return expand(self, shape)
    def contiguous(self): return contiguous(self)


class Tensor(_TorchStyle):
    """A view of a Storage through a Layout. Views share storage; only contiguous() copies."""

    def __init__(self, storage: Storage, layout: Layout):
        _validate_fits(storage, layout)
        self.storage = storage
        self.layout = layout

    @staticmethod
    def from_list(nested, dtype: str = "float32") -> Tensor:
        values, shape = _flatten(nested)
        return Tensor(Storage(values, dtype), Layout.contiguous(shape))

    @staticmethod
    def arange(n: int, dtype: str = "float32") -> Tensor:
        return Tensor(Storage(range(n), dtype), Layout.contiguous((n,)))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def values(self) -> list:
        """All elements in row-major (logical) order."""
        return [self.storage[p] for p in self.layout.positions()]

    def tolist(self):
        return _nest(self.values(), self.shape)

    def item(self) -> float:
        _require(self.numel() == 1, f"item() needs exactly one element, tensor has shape {self.shape}")
        return self.storage[next(self.layout.positions())]

    def __repr__(self) -> str:
        return f"Tensor({self.tolist()}, shape={self.shape}, stride={self.stride()}, offset={self.layout.offset})"


def _view(t: Tensor, shape, stride, offset) -> Tensor:
    return Tensor(t.storage, Layout(tuple(shape), tuple(stride), offset))


def transpose(t: Tensor, dim0: int, dim1: int) -> Tensor:
    """Swap two dimensions: swap their sizes and their strides. No copy."""
    d0, d1 = _validate_dim(dim0, t.ndim, "dim0"), _validate_dim(dim1, t.ndim, "dim1")
    shape, stride = list(t.shape), list(t.stride())
    shape[d0], shape[d1] = shape[d1], shape[d0]
    stride[d0], stride[d1] = stride[d1], stride[d0]
    return _view(t, shape, stride, t.layout.offset)


def permute(t: Tensor, dims: Sequence[int]) -> Tensor:
    """Reorder all dimensions, e.g. (B, T, H, D) -> (B, H, T, D) with dims (0, 2, 1, 3)."""
    dims = _validate_permutation(dims, t.ndim)
    return _view(t, [t.shape[d] for d in dims], [t.stride()[d] for d in dims], t.layout.offset)


def narrow(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """Elements start..start+length-1 along `dim`: move the offset, shrink the size."""
    d = _validate_dim(dim, t.ndim)
    _validate_narrow(t.shape[d], d, start, length)
    shape = list(t.shape)
    shape[d] = length
    return _view(t, shape, t.stride(), t.layout.offset + start * t.stride()[d])


def select(t: Tensor, dim: int, index: int) -> Tensor:
    """Index one position along `dim`, removing that dimension."""
    d = _validate_dim(dim, t.ndim)
    index = _validate_position(index, t.shape[d], d)
    shape = t.shape[:d] + t.shape[d + 1 :]
    stride = t.stride()[:d] + t.stride()[d + 1 :]
    return _view(t, shape, stride, t.layout.offset + index * t.stride()[d])


def view(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Reinterpret contiguous data with a new shape (same element order). No copy."""
    shape = _view_shape(t, shape)
    return _view(t, shape, contiguous_strides(shape), t.layout.offset)


def expand(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Broadcast size-1 dimensions to `shape` by giving them stride 0. No copy."""
    shape = tuple(shape)
    _require(len(shape) >= t.ndim, f"expand: target {shape} has fewer dims than tensor shape {t.shape}")
    lead = len(shape) - t.ndim
    old_shape, old_stride = (1,) * lead + t.shape, (0,) * lead + t.stride()
    stride = []
    for d, (new, old, st) in enumerate(zip(shape, old_shape, old_stride)):
        if new == -1:
            new = old
        if old == new:
            stride.append(st)
        elif old == 1:
            stride.append(0)
        else:
            raise ValueError(f"expand: size {old} of dim {d} in {t.shape} cannot become {new} in {shape}")
    shape = tuple(old if new == -1 else new for new, old in zip(shape, old_shape))
    return _view(t, shape, stride, t.layout.offset)


def contiguous(t: Tensor) -> Tensor:
    """The one copy: a new storage holding the elements in row-major order (itself if already so)."""
    if t.is_contiguous():  # like torch: already in order, nothing to copy
        return t
    return Tensor(Storage(t.values(), t.dtype), Layout.contiguous(t.shape))


def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    """view() when the data is contiguous, otherwise contiguous() then view()."""
    return view(t if t.is_contiguous() else contiguous(t), shape)


def getitem(t: Tensor, key) -> Tensor | float:
    """t[key] for ints and slices (step > 0), as views; a full integer index returns a number."""
    key = _index_key(key, t.ndim)
    shape, stride, offset = [], [], t.layout.offset
    for d, (size, st) in enumerate(zip(t.shape, t.stride())):
        k = key[d] if d < len(key) else slice(None)
        if isinstance(k, int):  # select: the dimension disappears
            offset += _validate_position(k, size, d) * st
        else:  # a slice: start moves the offset, step multiplies the stride
            start, stop, step = _slice_range(k, size, d)
            shape.append(len(range(start, stop, step)))
            stride.append(st * step)
            offset += start * st
    if not shape:
        return t.storage[offset]
    return _view(t, shape, stride, offset)


def broadcast_shapes(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """NumPy/PyTorch broadcasting: align on the right; sizes must match or be 1."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for d, (x, y) in enumerate(zip(a, b)):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {a} and {b} cannot broadcast: size {x} vs {y} at dim {d}")
        out.append(max(x, y) if 0 not in (x, y) else 0)
    return tuple(out)


def elementwise(op: Callable[[float, float], float], a: Tensor, b: Tensor | float) -> Tensor:
    """Apply op to each pair of elements after broadcasting a and b to a common shape."""
    if not isinstance(b, Tensor):
        b = Tensor(Storage([b], a.dtype), Layout((), (), 0))
    _require(a.dtype == b.dtype, f"elementwise: dtypes differ ({a.dtype} vs {b.dtype}); convert one first", TypeError)
    shape = broadcast_shapes(a.shape, b.shape)
    ea, eb = expand(a, shape), expand(b, shape)
    values = [op(x, y) for x, y in zip(ea.values(), eb.values())]
    return Tensor(Storage(values, a.dtype), Layout.contiguous(shape))


def add(a: Tensor, b: Tensor | float) -> Tensor:
    return elementwise(operator.add, a, b)


def mul(a: Tensor, b: Tensor | float) -> Tensor:
    return elementwise(operator.mul, a, b)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """(..., M, K) @ (..., K, N) -> (..., M, N); batch dims broadcast. Reads any strides."""
    m, k, n = _validate_matmul(a, b)
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    ea, eb = expand(a, batch + (m, k)), expand(b, batch + (k, n))
    out = []
    for idx in itertools.product(*(range(s) for s in batch)):
        for i in range(m):
            for j in range(n):
                acc = 0.0
                for kk in range(k):
                    acc += ea.storage[ea.layout.position((*idx, i, kk))] * eb.storage[eb.layout.position((*idx, kk, j))]
                out.append(acc)
    return Tensor(Storage(out, a.dtype), Layout.contiguous(batch + (m, n)))


def weight_bytes(n_params: int, dtype: torch.dtype) -> int:
    """Bytes to hold n_params weights of a floating or integer torch dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"weight_bytes: dtype must be a torch.dtype, got {type(dtype).__name__}")
    return n_params * dtype.itemsize
