# Generated from notebooks/A1_untrusted_files.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Opening a GGUF file: the one place in minillm that does, and the one error for a bad weights file.

Built in notebooks/A1_untrusted_files.ipynb. The weights loader, the quantized loader (notebook 12), the
tokenizer (notebook 07) and the command line all read GGUF files through `read_gguf`, so a
truncated or corrupt file gets the same message everywhere, never an IndexError from the parser.
It walks the header itself first (`check_gguf_header`): gguf-py trusts every count in the file,
and an array count of 2**40 would keep it reading past the end of the file for minutes.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import gguf


class WeightsError(ValueError):
    """A weights file or folder that cannot be loaded; the message names the file, tensor and cause."""


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader over the file (memory-mapped: nothing is read until used), or WeightsError naming it."""
    path = Path(path)
    check_gguf_header(path)  # every count and length against the file's size, before gguf-py trusts them
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as exc:  # the parser on a bad file
        raise WeightsError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


_NUMBER_FORMATS = {  # GGUF value type -> struct format of one value: uint8, int8, ..., bool, uint64, int64, float64
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9  # a u64 length and that many bytes; an element type, a u64 count, the elements
_GGML_SIZES = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}  # type -> (block, bytes per block)
MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor has at most 4 dims
MAX_NESTING = 8  # arrays of arrays of ...: the spec allows them, no model file needs this many
MAX_KEY_BYTES, MAX_NAME_BYTES = 65535, 64  # the spec's limits on a key and a tensor name


class _Bytes:
    """A GGUF file's bytes and a position in them. Every read first checks that its bytes are there."""

    def __init__(self, path: Path, buf, order: str):
        self.path, self.buf, self.order, self.pos = path, buf, order, 0

    def refuse(self, what: str) -> WeightsError:
        return WeightsError(f"{self.path}: not a readable GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        left = len(self.buf) - self.pos
        if n > left:
            raise self.refuse(f"{what} needs {n} bytes at byte {self.pos}, but only {left} are left in the file")

    def take(self, n: int, what: str) -> int:
        """Step over n bytes, checked; where they start."""
        self.need(n, what)
        self.pos += n
        return self.pos - n

    def number(self, fmt: str, what: str):
        return struct.unpack_from(self.order + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.number("Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.refuse(f"{what} is {n} bytes long, more than GGUF's limit of {limit}")
        return self.buf[self.take(n, f"{what} ({n} bytes)") : self.pos]

    def text(self, what: str, limit: int) -> str:
        """A key or a tensor name: UTF-8, as gguf-py decodes it."""
        raw = self.string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} {raw[:80]!r} is not UTF-8") from None


def check_gguf_header(path: str | Path, keep: str | None = None) -> dict[str, Any]:
    """Walk a GGUF file's header the way gguf-py will, each length and count checked against the bytes
    left, so that a hostile number is refused at once instead of read past the end of the file.

    Returns the metadata's single values ({key: number, bool or str}); arrays are checked, not kept, but
    those whose key starts with `keep` ("tokenizer.": a vocabulary, without gguf-py's seconds of parsing):
    a list of numbers or of strings (UTF-8, strictly); an array of arrays is checked, not kept.
    FileNotFoundError if there is no file; WeightsError naming the file, the key or tensor, and the value."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise WeightsError(f"{path}: not a readable GGUF file: {size} bytes, less than the 24-byte header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:  # only the header's pages are read
            return _walk_header(path, buf, keep)


def _walk_header(path: Path, buf, keep: str | None = None) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise WeightsError(f"{path}: not a readable GGUF file: it starts with {buf[:4]!r}, not b'GGUF'")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # gguf-py's test for a big-endian file
    data = _Bytes(path, buf, order)
    data.take(4, "the magic")
    version = data.number("I", "the version")
    if version not in (2, 3):
        raise data.refuse(f"version {version}; gguf-py reads versions 2 and 3")
    n_tensors, n_kv = data.number("Q", "the tensor count"), data.number("Q", "the metadata count")
    data.need(13 * n_kv, f"the metadata count {n_kv} (13 bytes or more per entry)")
    data.need(24 * n_tensors, f"the tensor count {n_tensors} (24 bytes or more per tensor info)")
    values = _read_metadata(data, n_kv, keep)
    _check_tensor_data(data, _read_tensor_infos(data, n_tensors), values.get("general.alignment", 32))
    return values


def _read_metadata(data: _Bytes, count: int, keep: str | None = None) -> dict[str, Any]:
    values, seen = {}, set()
    for i in range(count):
        key = data.text(f"the key of metadata entry {i}", MAX_KEY_BYTES)
        if key in seen:
            raise data.refuse(f"metadata key {key!r} appears twice")
        seen.add(key)
        kind = data.number("I", f"metadata key {key!r}: its value type")
        if kind == _ARRAY and keep is not None and key.startswith(keep):
            value = _read_array(data, f"metadata key {key!r}")
        else:
            value = _value(data, kind, f"metadata key {key!r}")
        if value is not None:
            values[key] = value
        if key == "general.alignment" and (kind != 4 or value < 1 or value & (value - 1)):
            raise data.refuse(f"metadata key {key!r} is {value!r} of type {_name(kind)}; "
                              f"GGUF wants a power of two, as UINT32")
    return values


def _value(data: _Bytes, kind: int, what: str) -> Any:
    """Step over one value of a GGUF type: a number's or a string's value; None for an array (checked)."""
    if kind in _NUMBER_FORMATS:
        return data.number(_NUMBER_FORMATS[kind], what)
    if kind == _STRING:
        return data.string(what).decode("utf-8", "replace")
    if kind == _ARRAY:
        return _skip_array(data, what, depth=1)
    raise data.refuse(f"{what}: value type {kind} is not a GGUF type (0 to 12)")


def _skip_array(data: _Bytes, what: str, depth: int) -> None:
    """An array's elements, checked by size: number arrays in one multiplication, never one by one."""
    kind = data.number("I", f"{what}: its element type")
    count = data.number("Q", f"{what}: its element count")
    if kind in _NUMBER_FORMATS:
        data.take(count * struct.calcsize(_NUMBER_FORMATS[kind]), f"{what}: an array of {count} {_name(kind)} values")
    elif kind == _STRING:
        _skip_strings(data, count, what)
    elif kind == _ARRAY and depth < MAX_NESTING:  # each element: an element type, a count, its elements
        data.need(12 * count, f"{what}: an array of {count} arrays (12 bytes or more each)")
        for i in range(count):
            _skip_array(data, f"{what}[{i}]", depth + 1)
    elif kind == _ARRAY:
        raise data.refuse(f"{what}: arrays nested more than {MAX_NESTING} deep")
    else:
        raise data.refuse(f"{what}: element type {kind} is not a GGUF type (0 to 12)")


def _read_array(data: _Bytes, what: str) -> list | None:
    """A kept array: its numbers or strings as a list, checked as _skip_array checks them (arrays of arrays:
    checked, not kept, None)."""
    start = data.pos
    kind, count = data.number("I", f"{what}: its element type"), data.number("Q", f"{what}: its element count")
    if kind in _NUMBER_FORMATS:  # the bytes checked first: a hostile count never reaches struct
        size = count * struct.calcsize(_NUMBER_FORMATS[kind])
        at = data.take(size, f"{what}: an array of {count} {_name(kind)} values")
        return list(struct.unpack_from(f"{data.order}{count}{_NUMBER_FORMATS[kind]}", data.buf, at))
    if kind == _STRING:
        data.need(8 * count, f"{what}: an array of {count} strings (8 bytes or more each)")
        return [data.string(f"{what}[{i}]").decode("utf-8") for i in range(count)]
    data.pos = start
    return _skip_array(data, what, depth=1)


def _skip_strings(data: _Bytes, count: int, what: str) -> None:
    """Step over `count` strings, each a u64 length and its bytes. A loop, but each step passes 8 real
    bytes or more of the file, so it ends within the file's size (SmolLM2's 49,152 tokens: milliseconds)."""
    data.need(8 * count, f"{what}: an array of {count} strings (8 bytes or more each)")
    length, buf, pos, end = struct.Struct(data.order + "Q").unpack_from, data.buf, data.pos, len(data.buf)
    for i in range(count):
        n = length(buf, pos)[0] if pos + 8 <= end else None
        if n is None or n > end - pos - 8:
            size = "its length cut off" if n is None else f"{n} bytes long"
            raise data.refuse(f"{what}: string {i} of {count}, at byte {pos}, {size}, runs past the end of "
                              f"the file ({end} bytes)")
        pos += 8 + n
    data.pos = pos


def _name(kind: int) -> str:
    """A GGUF value type's name, as gguf-py spells it (UINT32, STRING, ...)."""
    try:
        return gguf.GGUFValueType(kind).name
    except ValueError:
        return f"type {kind}"


def _read_tensor_infos(data: _Bytes, count: int) -> list[tuple[str, list[int], int, int]]:
    """(name, dims, ggml type, offset) of each tensor info, every field checked as it is read."""
    infos, seen = [], set()
    for i in range(count):
        name = data.text(f"the name of tensor info {i}", MAX_NAME_BYTES)
        if name in seen:
            raise data.refuse(f"tensor {name!r} appears twice")
        seen.add(name)
        n_dims = data.number("I", f"tensor {name!r}: its number of dims")
        if n_dims > MAX_DIMS:
            raise data.refuse(f"tensor {name!r} has {n_dims} dims; ggml allows at most {MAX_DIMS}")
        dims = [data.number("Q", f"tensor {name!r}: dim {d}") for d in range(n_dims)]
        kind = data.number("I", f"tensor {name!r}: its type")
        if kind not in _GGML_SIZES:
            raise data.refuse(f"tensor {name!r} has type {kind}, not a ggml type that gguf-py knows")
        infos.append((name, dims, kind, data.number("Q", f"tensor {name!r}: its offset")))
    return infos


def _check_tensor_data(data: _Bytes, infos: list, alignment: int) -> None:
    """Each tensor's bytes (whole blocks, from its dims and type) at an aligned offset inside the data,
    which starts at the first multiple of the alignment after the tensor infos."""
    size = len(data.buf) - (-(-data.pos // alignment) * alignment)  # the data's bytes (< 0: none)
    for name, dims, kind, offset in infos:
        block, block_bytes = _GGML_SIZES[kind]
        qtype = gguf.GGMLQuantizationType(kind).name
        if block > 1 and (not dims or dims[0] % block):
            raise data.refuse(f"tensor {name!r} has dims {dims}, but its rows must be whole {qtype} blocks of {block} values")
        n_bytes = math.prod(dims) // block * block_bytes
        if offset % alignment or offset + n_bytes > size:
            raise data.refuse(f"tensor {name!r} ({qtype}, dims {dims}) needs {n_bytes} bytes at offset {offset}, "
                              f"aligned to {alignment}, inside the data's {max(size, 0)} bytes")
