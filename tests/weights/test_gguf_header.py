"""minillm.weights.gguf_file.check_gguf_header: the GGUF header walked before gguf-py reads it (issue 51).

gguf-py's GGUFReader believes every count in a file: an INT32 array's count set to 2**40 made it
loop past the end of the file for minutes, its memory growing. `read_gguf` now walks the header
first and refuses any length or count that the bytes left cannot hold, naming the file, the key or
tensor and the value. Here: the probe of the issue on the embedded SmolLM2 file, one damaged file
per check, an unsupported architecture refused before its vocabulary is decoded, the real file's
cost, and a fuzz test that sets every header field of a small GGUF to hostile values in a child
process under a memory cap (gguf_mutation_worker.py).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import minillm
from minillm.__main__ import gguf_summary
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.gguf_file import WeightsError, check_gguf_header, read_gguf
from minillm.weights.loading import from_gguf, gguf_architecture
from test_weights import write_gguf

# One metadata array of each element type, and an array of arrays, for the walk to step over.
ARRAYS = {
    "test.u8": ([1, 2, 3], V.UINT8), "test.i8": ([-1, 2], V.INT8), "test.u16": ([7, 8, 9], V.UINT16),
    "test.i16": ([-7], V.INT16), "test.u32": ([1, 2], V.UINT32), "test.i32": ([5, 6, 7, 8], V.INT32),
    "test.f32": ([0.5, 1.5], V.FLOAT32), "test.bool": ([True, False, True], V.BOOL),
    "test.u64": ([2**40], V.UINT64), "test.i64": ([-(2**40), 3], V.INT64), "test.f64": ([0.25], V.FLOAT64),
    "test.str": (["a", "", "ccc"], V.STRING), "test.nested": ([[1, 2], [3], [4, 5, 6]], V.ARRAY),
}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """tiny-llama as a Q8_0 GGUF with an explicit general.alignment and an array of every element type."""
    path = tmp_path_factory.mktemp("gguf-header") / "small.gguf"
    return write_gguf("tiny-llama", path, Q.Q8_0, extra_u32={"general.alignment": 32}, arrays=ARRAYS)


def key_at(good: bytes, key: str) -> int:
    """Where a metadata key's value type is: after its u64 length and its bytes."""
    name = key.encode()
    return good.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def patched(good: bytes, offset: int, fmt: str, value) -> bytes:
    data = bytearray(good)
    struct.pack_into("<" + fmt, data, offset, value)
    return bytes(data)


def refused(tmp_path: Path, data: bytes, *, within: float = 1.0) -> str:
    """The WeightsError message for these bytes (it must name the file), raised within `within` seconds."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(WeightsError) as err:
        read_gguf(bad)
    assert time.perf_counter() - start < within
    assert str(bad) in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------- the probe of the issue


def test_token_type_count_2_40_in_the_embedded_gguf_is_refused_in_under_a_second(tmp_path):
    """Issue 51, point 2: `info`, `generate` and `minillm.load` hung for minutes, memory growing."""
    good = embedded_gguf_path().read_bytes()
    count_at = key_at(good, "tokenizer.ggml.token_type") + 4 + 4  # after the value type and the element type
    assert struct.unpack_from("<Q", good, count_at)[0] == 49152
    bad = tmp_path / "token-type-count-2-40.gguf"
    bad.write_bytes(patched(good, count_at, "Q", 2**40))
    for load in (read_gguf, gguf_summary, minillm.load):  # the reader, `minillm info`, load (and `generate`)
        start = time.perf_counter()
        with pytest.raises(WeightsError) as err:
            load(bad)
        assert time.perf_counter() - start < 1.0, load
        message = str(err.value)
        assert str(bad) in message and "'tokenizer.ggml.token_type'" in message and "1099511627776" in message
    assert message == (f"{bad}: not a readable GGUF file: metadata key 'tokenizer.ggml.token_type': an array of "
                       f"1099511627776 INT32 values needs 4398046511104 bytes at byte {count_at + 8}, but only "
                       f"{len(good) - count_at - 8} are left in the file")


def test_the_real_vocabulary_is_walked_in_milliseconds():
    """SmolLM2's header holds 49,152 tokens and 48,900 merges, walked string by string."""
    path = embedded_gguf_path()
    check_gguf_header(path)  # the file's pages in the page cache
    start = time.perf_counter()
    values = check_gguf_header(path)
    assert time.perf_counter() - start < 0.25  # about 10 ms; gguf-py's reader takes about 2 s
    assert values["general.architecture"] == "llama" and values["llama.block_count"] == 30
    assert values["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.tokens" not in values  # arrays: not kept


# ---------------------------------------------------------------- the architecture first


def test_a_gemma3_gguf_is_refused_by_architecture_before_its_262144_tokens_are_decoded(tmp_path):
    """Issue 51, point 5: load said "tokenizer.ggml.model is 'llama'" after decoding the vocabulary."""
    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(262_144)])
    writer.add_token_scores([0.0] * 262_144)
    writer.add_token_types([1] * 262_144)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load in (minillm.load, gguf_architecture, from_gguf):
        start = time.perf_counter()
        with pytest.raises(WeightsError, match=r"architecture 'gemma3' is not supported; supported: llama, qwen2, qwen3"):
            load(path)
        assert time.perf_counter() - start < 1.0, load  # the tokenizer alone took 10 s to decode them
    assert gguf_architecture(embedded_gguf_path()) == "llama"


def test_a_gguf_without_an_architecture_is_refused_by_name(small, tmp_path):
    bad = tmp_path / "no-arch.gguf"
    bad.write_bytes(small.read_bytes().replace(b"general.architecture", b"general.architectur_"))
    with pytest.raises(WeightsError, match=r"no-arch.gguf: GGUF metadata key 'general.architecture' is missing"):
        gguf_architecture(bad)


# ---------------------------------------------------------------- one damaged file per check


def test_the_small_gguf_with_every_array_type_loads(small):
    values = check_gguf_header(small)
    assert values["general.alignment"] == 32 and "test.nested" not in values
    reader = read_gguf(small)
    assert reader.fields["test.nested"].contents() == [1, 2, 3, 4, 5, 6]  # gguf-py flattens arrays of arrays
    from_gguf(small)


def test_kept_arrays_are_gguf_py_s_values(small):
    """keep="test.": every flat array of the small file as gguf-py's contents() gives it (each element type),
    arrays of arrays checked but not kept; SmolLM2's tokenizer arrays too, the tokenizer's source."""
    kept, reader = check_gguf_header(small, keep="test."), read_gguf(small)
    arrays = [k for k, f in reader.fields.items() if k.startswith("test.") and f.types and f.types[0] == V.ARRAY]
    assert len(arrays) > 5 and "test.nested" not in kept
    for key in arrays:
        if key != "test.nested":
            assert kept[key] == reader.fields[key].contents(), key
    path = embedded_gguf_path()
    ours = {k: v for k, v in check_gguf_header(path, keep="tokenizer.").items() if k.startswith("tokenizer.")}
    theirs = {k: f.contents() for k, f in read_gguf(path).fields.items() if k.startswith("tokenizer.")}
    assert ours == theirs and len(ours["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("case", ["UINT16 count 2**62", "element type 99", "inner count 2**40", "string count 2**40",
                                  "string length 2**40"])
def test_a_kept_array_s_hostile_count_is_refused_by_name(small, tmp_path, case):
    """The kept arrays are read by the same checked steps: a count or a length past the file's end is refused."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(CASES[case][0](small.read_bytes()))
    with pytest.raises(WeightsError, match=str(bad)):
        check_gguf_header(bad, keep="test.")


def _tensor_at(good: bytes, name: str) -> int:
    """Where a tensor info's n_dims is: after its name's u64 length and bytes."""
    raw = name.encode()
    return good.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


CASES = {  # case -> (edit of the small file's bytes, what the message must say)
    "short file": (lambda g: g[:20], "20 bytes, less than the 24-byte header"),
    "bad magic": (lambda g: b"GGUX" + g[4:], "starts with b'GGUX', not b'GGUF'"),
    "version 1": (lambda g: patched(g, 4, "I", 1), "version 1; gguf-py reads versions 2 and 3"),
    "tensor count 2**63": (lambda g: patched(g, 8, "Q", 2**63), "the tensor count 9223372036854775808"),
    "metadata count 2**40": (lambda g: patched(g, 16, "Q", 2**40), "the metadata count 1099511627776"),
    "key length 2**64-1": (lambda g: patched(g, key_at(g, "test.u8") - 8 - 7, "Q", 2**64 - 1),
                           "the key of metadata entry .* is 18446744073709551615 bytes long, more than GGUF's limit"),
    "value type 13": (lambda g: patched(g, key_at(g, "test.u8"), "I", 13),
                      "metadata key 'test.u8': value type 13 is not a GGUF type"),
    "element type 99": (lambda g: patched(g, key_at(g, "test.u8") + 4, "I", 99),
                        "metadata key 'test.u8': element type 99 is not a GGUF type"),
    "UINT16 count 2**62": (lambda g: patched(g, key_at(g, "test.u16") + 8, "Q", 2**62),
                           "'test.u16': an array of 4611686018427387904 UINT16 values needs 9223372036854775808 bytes"),
    "string count 2**40": (lambda g: patched(g, key_at(g, "test.str") + 8, "Q", 2**40),
                           "'test.str': an array of 1099511627776 strings"),
    "string length 2**40": (lambda g: patched(g, key_at(g, "test.str") + 16, "Q", 2**40),
                            "'test.str': string 0 of 3, at byte .*, 1099511627776 bytes long, runs past the end"),
    "nested count 2**40": (lambda g: patched(g, key_at(g, "test.nested") + 8, "Q", 2**40),
                           "'test.nested': an array of 1099511627776 arrays"),
    "inner count 2**40": (lambda g: patched(g, key_at(g, "test.nested") + 20, "Q", 2**40),
                          r"'test.nested'\[0\]: an array of 1099511627776 INT32 values"),
    "duplicate key": (lambda g: g.replace(b"test.i16", b"test.u16"), "metadata key 'test.u16' appears twice"),
    "key not UTF-8": (lambda g: g.replace(b"test.i16", b"test.\xff16"), r"is not UTF-8"),
    "alignment 48": (lambda g: patched(g, key_at(g, "general.alignment") + 4, "I", 48),
                     "'general.alignment' is 48 of type UINT32; GGUF wants a power of two"),
    "alignment as INT32": (lambda g: patched(g, key_at(g, "general.alignment"), "I", int(V.INT32)),
                           "'general.alignment' is 32 of type INT32"),
    "tensor name 2**40": (lambda g: patched(g, _tensor_at(g, "output_norm.weight") - 26, "Q", 2**40),
                          "the name of tensor info .* is 1099511627776 bytes long, more than GGUF's limit of 64"),
    "n_dims 5": (lambda g: patched(g, _tensor_at(g, "output_norm.weight"), "I", 5),
                 "tensor 'output_norm.weight' has 5 dims; ggml allows at most 4"),
    "dim 2**63": (lambda g: patched(g, _tensor_at(g, "output_norm.weight") + 4, "Q", 2**63),
                  r"tensor 'output_norm.weight' \(F32, dims \[9223372036854775808\]\) needs 36893488147419103232"),
    "dims that wrap in uint64": (lambda g: patched(patched(g, _tensor_at(g, "blk.0.attn_q.weight") + 4, "Q", 2**32),
                                                   _tensor_at(g, "blk.0.attn_q.weight") + 12, "Q", 2**32),
                                 r"tensor 'blk.0.attn_q.weight' \(Q8_0, dims \[4294967296, 4294967296\]\)"),
    "ggml type 4": (lambda g: patched(g, _tensor_at(g, "output_norm.weight") + 12, "I", 4),
                    "tensor 'output_norm.weight' has type 4, not a ggml type that gguf-py knows"),
    "rows not whole blocks": (lambda g: patched(g, _tensor_at(g, "blk.0.attn_q.weight") + 4, "Q", 48),
                              r"'blk.0.attn_q.weight' has dims \[48, 64\], but its rows must be whole Q8_0 blocks of 32"),
    "offset 2**64-1": (lambda g: patched(g, _tensor_at(g, "output_norm.weight") + 16, "Q", 2**64 - 1),
                       "at offset 18446744073709551615, aligned to 32, inside the data's"),
    "offset misaligned": (lambda g: patched(g, _tensor_at(g, "output_norm.weight") + 16, "Q", 3),
                          "'output_norm.weight' .* at offset 3, aligned to 32"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_header_field_is_refused_by_name(small, tmp_path, case):
    edit, message = CASES[case]
    assert re.search(message, refused(tmp_path, edit(small.read_bytes()))), case


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        check_gguf_header(tmp_path / "nope.gguf")


def test_a_big_endian_header_is_walked_in_its_byte_order(tmp_path):
    """gguf-py reads files written big-endian (the version's low half is 0); the walk does too."""
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_array("test.i32", [1, 2, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert check_gguf_header(path)["general.architecture"] == "llama"
    good = path.read_bytes()
    count_at = good.index(b"test.i32") + 8 + 4 + 4
    message = refused(tmp_path, good[:count_at] + struct.pack(">Q", 2**40) + good[count_at + 8 :])
    assert "'test.i32': an array of 1099511627776 INT32 values" in message


# ---------------------------------------------------------------- the fuzz test


def header_fields(path: Path) -> list[tuple[str, int, str, int]]:
    """(label, byte offset, struct format, value) of every structural field of a good GGUF, found with
    gguf-py's reader: the header's counts, each key's length and value type, each string's length,
    each array's element type and count (and a few of its strings' lengths, and its first inner
    array's), each tensor info's name length, n_dims, dims, type and offset, and the alignment."""
    good = path.read_bytes()
    reader = gguf.GGUFReader(path)
    fields = [("version", 4, "I"), ("tensor count", 8, "Q"), ("metadata count", 16, "Q")]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        at = field.offset + 8 + len(key.encode())  # the value type
        fields += [(f"{key}: key length", field.offset, "Q"), (f"{key}: value type", at, "I")]
        if field.types[0] == V.STRING:
            fields.append((f"{key}: string length", at + 4, "Q"))
        elif field.types[0] == V.ARRAY:
            fields += [(f"{key}: element type", at + 4, "I"), (f"{key}: count", at + 8, "Q")]
            if field.types[1] == V.ARRAY:
                fields += [(f"{key}[0]: element type", at + 16, "I"), (f"{key}[0]: count", at + 20, "Q")]
            if field.types[1] == V.STRING:
                starts = [field.offset + sum(int(p.nbytes) for p in field.parts[: i - 1]) for i in field.data]
                for n in sorted({0, len(starts) // 2, len(starts) - 1}):
                    fields.append((f"{key}: length of string {n}", starts[n], "Q"))
        if key == "general.alignment":
            fields.append(("general.alignment: value", at + 4, "I"))
    for t in reader.tensors:
        at = t.field.offset + 8 + len(t.name.encode())  # n_dims
        n_dims = len(t.shape)
        fields += [(f"{t.name}: name length", t.field.offset, "Q"), (f"{t.name}: n_dims", at, "I")]
        fields += [(f"{t.name}: dim {d}", at + 4 + 8 * d, "Q") for d in range(n_dims)]
        fields += [(f"{t.name}: type", at + 4 + 8 * n_dims, "I"), (f"{t.name}: offset", at + 8 + 8 * n_dims, "Q")]
    return [(label, offset, fmt, struct.unpack_from("<" + fmt, good, offset)[0]) for label, offset, fmt in fields]


HOSTILE = {"Q": [0, 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1], "I": [0, 1, 5, 13, 99, 2**31, 2**32 - 1]}


def mutations(fields) -> list[tuple[str, int, str, int]]:
    """Each field set to 0, 1, its value ± 1 and the hostile sizes (type fields: out-of-range codes too)."""
    out = []
    for label, offset, fmt, value in fields:
        extra = [16, 64, 3] if label.startswith("general.alignment: value") else []
        tried = {v for v in [*HOSTILE[fmt], value - 1, value + 1, *extra] if 0 <= v < 2 ** (8 * struct.calcsize(fmt))}
        out += [(label, offset, fmt, v) for v in sorted(tried - {value})]
    return out


def test_every_header_field_set_to_hostile_values_is_refused_by_name_or_loads_unchanged(small, tmp_path):
    fields = header_fields(small)
    job = {"good": str(small), "dir": str(tmp_path), "headroom_mib": 384, "mutations": mutations(fields)}
    worker = Path(__file__).with_name("gguf_mutation_worker.py")
    result = subprocess.run([sys.executable, str(worker)], input=json.dumps(job), capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    print(f"\nGGUF header fuzz: {len(fields)} fields, {report}")  # quoted in the closing note
    assert report["foreign"] == []
    assert report["tried"] == len(job["mutations"]) == report["refused"] + report["loaded"]
    assert report["max_seconds"] < 1.0, report["slowest"]
    assert report["refused"] > 0.9 * report["tried"]
