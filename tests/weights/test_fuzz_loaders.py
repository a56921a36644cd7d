"""Mutated weight files: every outcome is our own WeightsError naming the file, or a model whose
logits equal the unmutated one's. Never a foreign exception, never NaN, never silently different.

hypothesis drives the mutations (truncation, byte flips in the header, edits of a tensor's type,
offset, dims or dtype, shifted ranges) of a tiny GGUF file and a tiny safetensors checkpoint.
The `@example`s are the known-bad files found so far, kept as regression cases. The suite runs
FUZZ_EXAMPLES mutations per format (60); `MINILLM_FUZZ_EXAMPLES=1000 pytest tests/weights/test_fuzz_loaders.py`
runs a longer campaign.
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support import DATA
from minillm.weights.gguf_file import WeightsError
from minillm.weights.loading import from_gguf, load_folder
from test_weights import _mutate_tensor_info, write_gguf

FUZZ_EXAMPLES = int(os.environ.get("MINILLM_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
IDS = torch.tensor([[1, 5, 9, 200, 3, 17]])
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 12, 30, 31, 32, 64, 255, 256, 1023, 2**16, 2**31 - 1, 2**32 - 1, 2**40, 2**63]


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    """The file and its structural bytes: the fixed header (magic, version, counts), every metadata
    key's length and type, and the tensor infos. A metadata *value* may be edited into another
    valid value (an eps, a theta): that is a different model, not a damaged file, so values are
    left to the field edits' own checks, not to byte flips."""
    folder = tmp_path_factory.mktemp("fuzz-gguf")
    path = write_gguf("tiny-llama", folder / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    good = path.read_bytes()
    reader = gguf.GGUFReader(path)
    structural = list(range(24))
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        structural += range(field.offset, field.offset + 8)  # the key's length
        structural += range(field.offset + 8 + len(field.name), field.offset + 12 + len(field.name))  # its type
    info_start = max(f.offset + sum(p.nbytes for p in f.parts) for f in reader.fields.values())
    structural += range(info_start, reader.data_offset)
    with torch.no_grad():
        reference = from_gguf(path)(IDS)
    return folder, good, [t.name for t in reader.tensors], sorted(set(structural)), reference


@pytest.fixture(scope="module")
def safetensors_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-st")
    shutil.copy(DATA / "tiny-qwen3" / "config.json", folder / "config.json")
    good = (DATA / "tiny-qwen3" / "model.safetensors").read_bytes()
    with torch.no_grad():
        reference = load_folder(DATA / "tiny-qwen3", device="cpu")(IDS)
    return folder, good, reference


def outcome(load, path, reference) -> str:
    """'refused' (a WeightsError naming the file) or 'same' (logits equal to the unmutated file's)."""
    try:
        model = load()
    except WeightsError as exc:
        assert path.name in str(exc), f"the error does not name the file: {exc}"
        return "refused"
    with torch.no_grad():
        logits = model(IDS)
    assert torch.isfinite(logits).all(), "a mutated file loaded with non-finite logits"
    assert torch.equal(logits, reference), "a mutated file loaded as a different model"
    return "same"


# ---------------------------------------------------------------- GGUF


def gguf_mutations(names: list[str], structural: list[int]):
    field_edit = st.tuples(st.just("field"), st.sampled_from(names),
                           st.sampled_from(["n_dims", "dim0", "type", "offset"]),
                           st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**32 - 1)))
    flip = st.tuples(st.just("flip"), st.sampled_from(structural), st.integers(1, 255))
    cut = st.tuples(st.just("cut"), st.integers(0, structural[-1] + 2000))
    return st.lists(st.one_of(field_edit, flip, cut), min_size=1, max_size=3)


def apply_gguf(good: bytes, mutations) -> bytes:
    data = good
    for m in mutations:
        if m[0] == "field":
            try:
                data = _mutate_tensor_info(data, m[1], m[2], m[3] % (2**32 if m[2] in ("n_dims", "type") else 2**64))
            except ValueError:  # the name itself was flipped by an earlier mutation
                pass
        elif m[0] == "flip":
            b = bytearray(data)
            if m[1] < len(b):
                b[m[1]] ^= m[2]
            data = bytes(b)
        else:
            data = data[: m[1]]
    return data


@given(data=st.data())
@FUZZ
@example(data=None)  # hypothesis needs one; the known-bad files are test_gguf_known_bad_files
def test_mutated_gguf_is_refused_or_unchanged(gguf_case, data):
    if data is None:
        return
    folder, good, names, structural, reference = gguf_case
    mutations = data.draw(gguf_mutations(names, structural))
    bad = folder / "bad.gguf"
    bad.write_bytes(apply_gguf(good, mutations))
    outcome(lambda: from_gguf(bad), bad, reference)


KNOWN_BAD_GGUF = {  # found by the adversarial probe: each once loaded and gave NaN logits
    "Q8_0 weight relabelled F16": [("field", "blk.0.attn_q.weight", "type", int(gguf.GGMLQuantizationType.F16))],
    "offset set to 0": [("field", "blk.1.ffn_down.weight", "offset", 0)],
    "F32 norm relabelled F16": [("field", "output_norm.weight", "type", int(gguf.GGMLQuantizationType.F16))],
    "dims doubled": [("field", "blk.0.attn_k.weight", "dim0", 128)],
    "truncated in the data": [("cut", -100)],
    "a key that is not UTF-8": [("flip", 64, 128)],  # found by this fuzzer: UnicodeDecodeError escaped
}


@pytest.mark.parametrize("case", list(KNOWN_BAD_GGUF))
def test_gguf_known_bad_files(gguf_case, case):
    folder, good, names, structural, reference = gguf_case
    bad = folder / "known-bad.gguf"
    bad.write_bytes(apply_gguf(good, KNOWN_BAD_GGUF[case]))
    assert outcome(lambda: from_gguf(bad), bad, reference) == "refused"


# ---------------------------------------------------------------- safetensors


DTYPES = ["F32", "F16", "BF16", "F64", "U32", "I32", "U8", "I64", "BOOL"]


def st_mutations(names: list[str], header_len: int):
    relabel = st.tuples(st.just("dtype"), st.sampled_from(names), st.sampled_from(DTYPES))
    shape = st.tuples(st.just("shape"), st.sampled_from(names), st.integers(0, 1), st.sampled_from(INTERESTING))
    shift = st.tuples(st.just("offsets"), st.sampled_from(names), st.integers(-64, 64))
    flip = st.tuples(st.just("flip"), st.integers(0, 8 + header_len - 1), st.integers(1, 255))
    cut = st.tuples(st.just("cut"), st.integers(0, 8 + header_len + 4000))
    return st.lists(st.one_of(relabel, shape, shift, flip, cut), min_size=1, max_size=3)


def apply_st(good: bytes, mutations) -> bytes:
    n = int.from_bytes(good[:8], "little")
    header, data, raw = json.loads(good[8 : 8 + n]), good[8 + n :], None
    for m in mutations:
        if m[0] in ("dtype", "shape", "offsets") and raw is None:
            entry = dict(header[m[1]])
            if m[0] == "dtype":
                entry["dtype"] = m[2]
            elif m[0] == "shape":
                entry["shape"] = [m[3] if i == m[2] else d for i, d in enumerate(entry["shape"])]
            else:
                entry["data_offsets"] = [max(0, o + m[2]) for o in entry["data_offsets"]]
            header = {**header, m[1]: entry}
        elif m[0] == "flip":
            raw = bytearray(raw if raw is not None else len(json.dumps(header).encode()).to_bytes(8, "little")
                            + json.dumps(header).encode() + data)
            if m[1] < len(raw):
                raw[m[1]] ^= m[2]
            raw = bytes(raw)
        elif m[0] == "cut":
            raw = (raw if raw is not None else len(json.dumps(header).encode()).to_bytes(8, "little")
                   + json.dumps(header).encode() + data)[: m[1]]
    if raw is None:
        encoded = json.dumps(header).encode()
        raw = len(encoded).to_bytes(8, "little") + encoded + data
    return raw


@given(data=st.data())
@FUZZ
@example(data=None)
def test_mutated_safetensors_is_refused_or_unchanged(safetensors_case, data):
    if data is None:
        return
    folder, good, reference = safetensors_case
    n = int.from_bytes(good[:8], "little")
    names = sorted(k for k in json.loads(good[8 : 8 + n]) if k != "__metadata__")
    target = folder / "model.safetensors"
    target.write_bytes(apply_st(good, data.draw(st_mutations(names, n))))
    outcome(lambda: load_folder(folder, device="cpu"), target, reference)


KNOWN_BAD_SAFETENSORS = {  # found by the adversarial probe
    "F32 relabelled U32": [("dtype", "model.norm.weight", "U32")],
    "F32 relabelled I32": [("dtype", "model.layers.0.mlp.up_proj.weight", "I32")],
    "offsets shifted into a neighbour": [("offsets", "model.layers.1.self_attn.k_proj.weight", -4)],
    "truncated": [("cut", 10_000)],
}


@pytest.mark.parametrize("case", list(KNOWN_BAD_SAFETENSORS))
def test_safetensors_known_bad_files(safetensors_case, case):
    folder, good, reference = safetensors_case
    target = folder / "model.safetensors"
    target.write_bytes(apply_st(good, KNOWN_BAD_SAFETENSORS[case]))
    assert outcome(lambda: load_folder(folder, device="cpu"), target, reference) == "refused"
