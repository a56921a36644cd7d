"""minillm.model.tensor against PyTorch: values, shapes, strides and storage offsets."""

import random

import pytest
import torch

from minillm.model.tensor import (
    Layout,
    Storage,
    Tensor,
    add,
    broadcast_shapes,
    contiguous,
    contiguous_strides,
    expand,
    getitem,
    matmul,
    mul,
    narrow,
    permute,
    reshape,
    select,
    transpose,
    view,
    weight_bytes,
)


def assert_same(ours: Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == tuple(theirs.shape)
    assert ours.stride() == theirs.stride()
    assert ours.layout.offset == theirs.storage_offset()
    assert ours.is_contiguous() == theirs.is_contiguous()
    torch.testing.assert_close(ours.to_torch(), theirs, atol=0, rtol=0)
    assert ours.tolist() == theirs.tolist()


def arange(*shape):
    n = 1
    for s in shape:
        n *= s
    return view(Tensor.arange(n), shape), torch.arange(n, dtype=torch.float32).view(shape)


@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3), (4, 1, 3), (2, 14, 7, 64)])
def test_contiguous_strides_match_torch(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_from_list_and_to_torch_share_memory():
    x = Tensor.from_list([[0, 1, 2], [3, 4, 5]])
    t = x.to_torch()
    x.storage[4] = 40.0
    assert t[1, 1].item() == 40.0  # the torch tensor reads our buffer, no copy
    assert Tensor.from_torch(torch.tensor([[1.0, 2.0]])).tolist() == [[1.0, 2.0]]


def test_storage_rounds_to_its_dtype():
    assert Storage([0.1], "float32")[0] == torch.tensor(0.1, dtype=torch.float32).item()
    assert Storage([0.1], "float64")[0] == 0.1
    with pytest.raises(ValueError, match="dtype"):
        Storage([1], "float8")


def test_views_share_storage_and_match_torch():
    a, ta = arange(2, 3, 4)
    cases = [
        (transpose(a, 0, 2), ta.transpose(0, 2)),
        (transpose(a, -1, -2), ta.transpose(-1, -2)),
        (permute(a, (2, 0, 1)), ta.permute(2, 0, 1)),
        (narrow(a, 1, 1, 2), ta.narrow(1, 1, 2)),
        (select(a, 2, -1), ta.select(2, -1)),
        (view(a, (4, -1)), ta.view(4, -1)),
        (expand(narrow(a, 1, 2, 1), (2, 3, 4)), ta[:, 2:3].expand(2, 3, 4)),
        (expand(a, (5, 2, 3, 4)), ta.expand(5, 2, 3, 4)),
        (a.T, ta.transpose(-2, -1)),
    ]
    for ours, theirs in cases:
        assert ours.shares_storage(a)
        assert_same(ours, theirs)


@pytest.mark.parametrize(
    "key",
    [0, -1, (1, 2), (slice(None), 1), (0, slice(1, 3)), (slice(None, None, 2),), (1, slice(None, None, 2), slice(1, None))],
)
def test_indexing_matches_torch(key):
    a, ta = arange(2, 3, 4)
    assert_same(getitem(a, key), ta[key])


def test_full_index_returns_a_number():
    a, ta = arange(2, 3, 4)
    assert a[1, 2, 3] == ta[1, 2, 3].item()


def test_contiguous_copies_only_when_needed():
    a, ta = arange(3, 4)
    assert contiguous(a) is a
    at = transpose(a, 0, 1)
    c = contiguous(at)
    assert not c.shares_storage(a)
    assert_same(c, ta.t().contiguous())
    assert_same(reshape(at, (12,)), ta.t().reshape(12))
    r = reshape(a, (2, 6))
    assert r.shares_storage(a)  # contiguous: reshape is a view


def test_random_view_chains_match_torch():
    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        ours, theirs = arange(*shape)
        for _ in range(4):
            op = rng.choice(["transpose", "permute", "narrow", "select", "expand", "reshape"])
            if op == "transpose" and ours.ndim >= 2:
                d0, d1 = rng.sample(range(ours.ndim), 2)
                ours, theirs = transpose(ours, d0, d1), theirs.transpose(d0, d1)
            elif op == "permute":
                dims = rng.sample(range(ours.ndim), ours.ndim)
                ours, theirs = permute(ours, dims), theirs.permute(dims)
            elif op == "narrow":
                d = rng.randrange(ours.ndim)
                start = rng.randrange(ours.shape[d])
                length = rng.randint(1, ours.shape[d] - start)
                ours, theirs = narrow(ours, d, start, length), theirs.narrow(d, start, length)
            elif op == "select" and ours.ndim >= 2:
                d = rng.randrange(ours.ndim)
                i = rng.randrange(ours.shape[d])
                ours, theirs = select(ours, d, i), theirs.select(d, i)
            elif op == "expand":
                d = rng.randrange(ours.ndim)
                if ours.shape[d] == 1:
                    target = list(ours.shape)
                    target[d] = 3
                    ours, theirs = expand(ours, target), theirs.expand(target)
            elif op == "reshape":
                ours, theirs = reshape(ours, (-1,)), theirs.reshape(-1)
                # torch's reshape may return a view where ours copies; compare values only
                assert ours.tolist() == theirs.tolist()
                ours, theirs = contiguous(ours), theirs.contiguous()
            assert ours.tolist() == theirs.tolist()
            assert ours.stride() == theirs.stride() or op == "reshape"


def test_broadcast_shapes_match_torch():
    for a, b in [((3, 1), (1, 4)), ((5, 4), (4,)), ((2, 1, 3), (7, 1)), ((1,), (6,)), ((), (2, 2))]:
        assert broadcast_shapes(a, b) == tuple(torch.broadcast_shapes(a, b))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(1, 4\)"):
        broadcast_shapes((2, 3), (4,))


def test_elementwise_with_broadcasting_and_strides():
    torch.manual_seed(0)
    h, bias = torch.randn(5, 4), torch.randn(4)
    th, tb = Tensor.from_torch(h), Tensor.from_torch(bias)
    torch.testing.assert_close(add(th, tb).to_torch(), h + bias, atol=0, rtol=0)
    torch.testing.assert_close(mul(transpose(th, 0, 1), 3.0).to_torch(), h.T * 3.0, atol=0, rtol=0)
    torch.testing.assert_close((th + 1).to_torch(), h + 1, atol=0, rtol=0)
    with pytest.raises(TypeError, match="dtypes differ"):
        add(th, Tensor.from_list([1, 2, 3, 4], dtype="float64"))


def test_matmul_matches_torch():
    torch.manual_seed(0)
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    y = matmul(Tensor.from_torch(x), transpose(Tensor.from_torch(w), 0, 1))
    torch.testing.assert_close(y.to_torch(), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
    a, b = torch.randn(2, 1, 3, 4), torch.randn(5, 4, 6)
    out = Tensor.from_torch(a) @ Tensor.from_torch(b)
    torch.testing.assert_close(out.to_torch(), a @ b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"inner sizes differ.*\(3, 8\).*\(5, 8\)"):
        matmul(Tensor.from_torch(x), Tensor.from_torch(w))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: view(transpose(t, 0, 1), (6,)), "not contiguous"),
        (lambda t: view(t, (4, -1)), "invalid for 6 elements"),
        (lambda t: narrow(t, 1, 2, 2), "exceeds size 3"),
        (lambda t: permute(t, (0, 0)), "not a permutation"),
        (lambda t: expand(t, (2, 4)), "cannot become 4"),
        (lambda t: transpose(t, 0, 2), "out of range"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    t = Tensor.from_list([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match=message):
        call(t)


def test_layout_reading_outside_storage_is_rejected():
    with pytest.raises(ValueError, match="outside a storage of 6"):
        Tensor(Storage(range(6)), Layout((2, 3), (3, 2), 0))
    with pytest.raises(ValueError, match="ragged"):
        Tensor.from_list([[1, 2], [3]])


def test_weight_bytes():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        assert weight_bytes(1000, dtype) == torch.empty(1000, dtype=dtype).nbytes
