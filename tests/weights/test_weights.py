"""minillm.weights.loading: GGUF and safetensors loading against the stored transformers references.

GGUF: the embedded SmolLM2-135M-Instruct (Q4_1/Q8_0) against transformers' logits of the same
file, and the tiny checkpoints converted here to GGUF (llama.cpp names, dims and q/k permutation,
written with the `gguf` package's GGUFWriter). safetensors: the tiny checkpoints whole and
sharded, then one damaged file or index per check, each expected to raise WeightsError naming
the cause. A planted bug (the q/k permutation left in) must make the comparison fail.
"""

import json
import random
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from support import DATA, TINY
import minillm.weights.loading as weights
from minillm.model.decoder import CausalLM, ModelConfig
from minillm.weights.loading import (
    WeightsError,
    checkpoint_files,
    from_gguf,
    gguf_to_hf_name,
    load_folder,
    load_model,
    read_safetensors_header,
    unpermute_qk,
)
from support import SMOLLM2_REL, assert_logits_close

HF_TO_GGUF_BLOCK = {v: k for k, v in weights._GGUF_BLOCK.items()}
HF_TO_GGUF_GLOBAL = {v: k for k, v in weights._GGUF_GLOBAL.items()}


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids[None])[0]


# ---------------------------------------------------------------- GGUF: SmolLM2


@pytest.fixture(scope="module")
def smol_ref(smollm2):
    return smollm2[0], load_file(DATA / "smollm2" / "reference.safetensors")


def test_smollm2_logits_match_transformers(smol_ref):
    # The last prompt position of each prompt against transformers' logits; the 32 greedy tokens
    # of every decoding path are compared in tests/model/test_greedy.py.
    model, ref = smol_ref
    for i in range(3):
        ids = ref[f"prompt_ids_{i}"]
        assert_logits_close(logits_of(model, ids)[-1], ref[f"last_logits_{i}"], rel=SMOLLM2_REL)


def test_smollm2_prompt_alone_and_step_by_step(smol_ref):
    model, ref = smol_ref
    ids = ref["prompt_ids_1"]  # the shortest prompt (32 tokens)
    assert_logits_close(logits_of(model, ids)[-1], ref["last_logits_1"], rel=SMOLLM2_REL)
    for _ in range(3):  # the slow way: a full recompute per token
        ids = torch.cat([ids, logits_of(model, ids)[-1].argmax()[None]])
    assert ids[-3:].tolist() == ref["greedy_1"][:3].tolist()


def test_smollm2_config_from_metadata(smol_ref):
    model, _ = smol_ref
    c = model.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 49152, 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (9, 3, 64, 1536)
    assert c.tie_word_embeddings and model.lm_head is None and c.rope_theta == 100000.0


# ---------------------------------------------------------------- GGUF: tiny checkpoints converted here


def llama_cpp_permute(w, n_heads):
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_to_gguf_name(name):
    parts = name.split(".")
    if parts[0] == "lm_head":
        return "output." + parts[-1]
    if parts[1] == "layers":
        return f"blk.{parts[2]}.{HF_TO_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"
    return f"{HF_TO_GGUF_GLOBAL['.'.join(parts[:-1])]}.{parts[-1]}"


def write_gguf(fixture, path, qtype=Q.F32, arch=None, skip_keys=(), extra=None, extra_u32=None, arrays=None):
    """Convert data/<fixture> to a GGUF file the way llama.cpp's converter does; 2-D weights as `qtype`.
    arrays: {key: (values, element type)} written as extra metadata arrays (nested lists: arrays of arrays)."""
    cfg = json.loads((DATA / fixture / "config.json").read_text())
    sd = load_file(DATA / fixture / "model.safetensors")
    arch = arch or cfg["model_type"]
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
    }
    if "head_dim" in cfg and cfg["model_type"] == "qwen3":
        keys["attention.key_length"] = cfg["head_dim"]
        keys["attention.value_length"] = cfg["head_dim"]
    for k, v in keys.items():
        if k not in skip_keys:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    for k, v in (extra_u32 or {}).items():
        w.add_uint32(k, v)
    for k, (values, element_type) in (arrays or {}).items():
        w.add_key_value(k, values, gguf.GGUFValueType.ARRAY, sub_type=element_type)
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    for name, t in sd.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        t = t.float()
        if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            t = llama_cpp_permute(t, heads)
        a = t.numpy()
        if a.ndim == 2 and qtype != Q.F32:
            data = gguf.quants.quantize(a, qtype)
            w.add_tensor(hf_to_gguf_name(name), data, raw_dtype=qtype)
        else:
            w.add_tensor(hf_to_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("fixture", TINY)
def test_tiny_gguf_matches_transformers(fixture, tmp_path):
    model = from_gguf(write_gguf(fixture, tmp_path / "m.gguf"))
    ref = load_file(DATA / fixture / "reference.safetensors")
    for i in range(3):
        assert_logits_close(logits_of(model, ref[f"input_ids_{i}"]), ref[f"logits_{i}"])


def test_planted_bug_permutation_left_in_is_caught(tmp_path, monkeypatch):
    path = write_gguf("tiny-llama", tmp_path / "m.gguf")
    ref = load_file(DATA / "tiny-llama" / "reference.safetensors")
    monkeypatch.setattr(weights, "unpermute_qk", lambda w, n_heads: w)
    broken = from_gguf(path)
    with pytest.raises(AssertionError):
        assert_logits_close(logits_of(broken, ref["input_ids_2"]), ref["logits_2"])


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 16, 7)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    assert llama_cpp_permute(torch.arange(8)[:, None], 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])  # all types: test_gguf_types.py
def test_quantized_types_dequantize_to_the_quantized_values(qtype, tmp_path):
    model = from_gguf(write_gguf("tiny-qwen3", tmp_path / "m.gguf", qtype))
    config, sd = model.config, model.state_dict()
    original = load_file(DATA / "tiny-qwen3" / "model.safetensors")
    assert config.head_dim == 32 and config.qk_norm and set(sd) == set(original)
    for name, t in original.items():
        assert sd[name].dtype == torch.float32 and sd[name].shape == t.shape, name
        if t.ndim == 2:
            expected = gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), qtype), qtype)
            assert np.array_equal(sd[name].numpy(), expected), name
        else:
            assert torch.equal(sd[name], t), name


def test_gguf_names():
    assert gguf_to_hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None and gguf_to_hf_name("blk.x.attn_q.weight") is None


def test_gguf_unknown_architecture(tmp_path):
    with pytest.raises(WeightsError, match="architecture 'gpt2' is not supported"):
        from_gguf(write_gguf("tiny-llama", tmp_path / "m.gguf", arch="gpt2"))


def test_gguf_missing_metadata_key(tmp_path):
    with pytest.raises(WeightsError, match="'llama.block_count' is missing"):
        from_gguf(write_gguf("tiny-llama", tmp_path / "m.gguf", skip_keys=("block_count",)))


def test_gguf_block_count_must_match_the_tensors(tmp_path):
    path = write_gguf("tiny-llama", tmp_path / "m.gguf", skip_keys=("block_count",), extra_u32={"llama.block_count": 10**9})
    with pytest.raises(WeightsError, match=r"config says 1000000000 layers, the weights hold 3 \(indices 0..2\)"):
        from_gguf(path)


def test_gguf_metadata_of_the_wrong_type(tmp_path):
    path = write_gguf("tiny-llama", tmp_path / "m.gguf", skip_keys=("embedding_length",), extra={"llama.embedding_length": "64"})
    with pytest.raises(WeightsError, match="hidden_size must be a positive integer, got '64'"):
        from_gguf(path)


def test_gguf_rope_scaling_refused(tmp_path):
    """llama.cpp's other type, longrope (Phi-3): minillm has no such RoPE. YaRN and linear are read
    (tests/weights/test_yarn_gguf.py)."""
    words = "'llama.rope.scaling.type' 'longrope' is not supported; supported: none, linear, yarn"
    with pytest.raises(WeightsError, match=words):
        from_gguf(write_gguf("tiny-llama", tmp_path / "m.gguf", extra={"llama.rope.scaling.type": "longrope"}))


@pytest.mark.parametrize("cut", [10, 200, 5000, -100])
def test_gguf_truncated_or_corrupt(cut, tmp_path):
    good = write_gguf("tiny-llama", tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:cut])
    with pytest.raises(WeightsError, match="bad.gguf"):
        from_gguf(bad)


def test_gguf_bad_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + write_gguf("tiny-llama", tmp_path / "m.gguf").read_bytes()[4:])
    with pytest.raises(WeightsError, match="not a readable GGUF file"):
        from_gguf(bad)


def test_gguf_random_corruption_raises_only_weights_error(tmp_path):
    # Seeded fuzzing of the header, metadata and tensor infos: a damaged file either still loads
    # or raises WeightsError; never IndexError, MemoryError, struct errors or a crash.
    good = write_gguf("tiny-llama", tmp_path / "m.gguf").read_bytes()
    header_end = gguf.GGUFReader(tmp_path / "m.gguf").data_offset  # where the tensor data starts
    rng, bad = random.Random(0), tmp_path / "bad.gguf"
    for _ in range(150):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(data))
        try:
            from_gguf(bad)
        except WeightsError:
            pass


def test_load_model_dispatches_on_gguf(tmp_path):
    model = load_model(write_gguf("tiny-qwen2-untied", tmp_path / "m.gguf"), device="cpu")
    assert isinstance(model, CausalLM) and next(model.parameters()).dtype == torch.float32


# ---------------------------------------------------------------- safetensors: good folders


@pytest.mark.parametrize("fixture", TINY)
def test_folder_matches_transformers(fixture):
    model = load_folder(DATA / fixture, device="cpu")
    ref = load_file(DATA / fixture / "reference.safetensors")
    assert next(model.parameters()).dtype == torch.float32 and model.inv_freq.dtype == torch.float32
    for i in range(3):
        assert_logits_close(logits_of(model, ref[f"input_ids_{i}"]), ref[f"logits_{i}"])


def make_shards(fixture, dst, split=2):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / fixture / "config.json", dst / "config.json")
    sd = load_file(DATA / fixture / "model.safetensors")
    names, weight_map = sorted(sd), {}
    for s in range(split):
        file = f"model-{s + 1:05d}-of-{split:05d}.safetensors"
        save_file({k: sd[k] for k in names[s::split]}, dst / file)
        weight_map.update({k: file for k in names[s::split]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst, weight_map


@pytest.mark.parametrize("fixture", ["tiny-qwen2-untied", "tiny-qwen3"])
def test_sharded_folder_loads_identically(fixture, tmp_path):
    folder, weight_map = make_shards(fixture, tmp_path / "m")
    assert {k: v.name for k, v in checkpoint_files(folder).items()} == weight_map
    whole, sharded = load_folder(DATA / fixture, device="cpu"), load_folder(folder, device="cpu")
    for (k, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), k


def test_dtype_cast_while_loading():
    model = load_folder(DATA / "tiny-qwen3", dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and model.inv_freq.dtype == torch.float32
    ids = load_file(DATA / "tiny-qwen3" / "reference.safetensors")["input_ids_1"]
    exact = load_folder(DATA / "tiny-qwen3", device="cpu")
    low, top5 = logits_of(model, ids).float(), logits_of(exact, ids).topk(5, dim=-1).indices
    assert all(low[t].argmax() in top5[t] for t in range(len(ids)))


def test_wrong_shape_refused_before_loading(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(DATA / "tiny-llama" / "config.json", folder / "config.json")
    sd = load_file(DATA / "tiny-llama" / "model.safetensors")
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(64, 64\), expected \(32, 64\)"):
        load_folder(folder, device="cpu")


# ---------------------------------------------------------------- safetensors: damaged files


GOOD = (DATA / "tiny-qwen3" / "model.safetensors").read_bytes()
N = int.from_bytes(GOOD[:8], "little")
HEADER = json.loads(GOOD[8 : 8 + N])
ORDER = sorted((k for k in HEADER if k != "__metadata__"), key=lambda k: HEADER[k]["data_offsets"])


def with_header(h, data=GOOD[8 + N :], raw=None):
    raw = raw if raw is not None else json.dumps(h).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def edit(name, **fields):
    return with_header({**HEADER, name: {**HEADER[name], **fields}})


def shifted(name, by):
    return edit(name, data_offsets=[o + by for o in HEADER[name]["data_offsets"]])


DAMAGED = {
    "too short": (GOOD[:5], "5 bytes, too short"),
    "truncated": (GOOD[:-100], r"past the data section .* file truncated"),
    "header length past the end": ((10**9).to_bytes(8, "little") + GOOD[8:], "header length 1000000000 runs past the end"),
    "header not JSON": (GOOD[:8] + b"{" * N + GOOD[8 + N :], "header is not valid JSON"),
    "header not an object": (with_header(None, raw=b"[1, 2]"), "header must be a JSON object"),
    "duplicate key": (with_header(None, raw=b'{"a": {}, "a": {}}'), "key 'a' appears twice"),
    "unknown dtype": (edit(ORDER[0], dtype="F12"), "unknown dtype 'F12'"),
    "shape x dtype mismatch": (edit(ORDER[0], shape=[3]), r"shape \[3\] x F32 is 12 bytes but its data_offsets"),
    "negative dim": (edit(ORDER[0], shape=[-320, -64]), "malformed entry"),
    "overlapping offsets": (shifted(ORDER[1], -4), f"{ORDER[1]} at bytes .* overlaps {ORDER[0]}"),
    "gap between tensors": (shifted(ORDER[1], 4), f"{ORDER[1]} at bytes .* leaves a gap after {ORDER[0]}"),
    "trailing bytes": (GOOD + b"\0" * 8, "8 bytes after the last tensor"),
    "metadata nested 100,000 deep": (with_header(None, raw=json.dumps(HEADER)[:-1].encode() + b', "__metadata__": '
                                                 + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}"),
                                     "nested too deeply"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_safetensors(case, tmp_path):
    data, message = DAMAGED[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    with pytest.raises(WeightsError, match=message) as err:
        read_safetensors_header(bad)
    assert str(bad) in str(err.value)  # the error names the file


def test_safetensors_random_corruption_raises_only_weights_error(tmp_path):
    shutil.copy(DATA / "tiny-qwen3" / "config.json", tmp_path / "config.json")
    rng, target = random.Random(1), tmp_path / "model.safetensors"
    for _ in range(200):
        data = bytearray(GOOD)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(8 + N)] = rng.choice([rng.randrange(256), ord(rng.choice('0123456789",]}:'))])
        target.write_bytes(bytes(data))
        try:
            load_folder(tmp_path, device="cpu")
        except WeightsError:
            pass


def test_a_float_tensor_relabelled_as_integers_is_refused(tmp_path):
    """From the adversarial probe: F32 bytes relabelled U32 have the same size and loaded as garbage."""
    shutil.copy(DATA / "tiny-qwen3" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(edit(ORDER[0], dtype="U32"))
    with pytest.raises(WeightsError, match=f"tensor {ORDER[0]} has dtype U32; weights are floating point"):
        load_folder(tmp_path, device="cpu")


@pytest.mark.parametrize("change, message", [
    (lambda cfg: [cfg], r"config.json: must hold a JSON object \{...\}, got a list"),
    (lambda cfg: {**cfg, "head_dim": 1e-30}, "head_dim must be a positive integer, got 1e-30"),
    (lambda cfg: {**cfg, "head_dim": "llama"}, "head_dim must be a positive integer, got 'llama'"),
    (lambda cfg: {**cfg, "num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    (lambda cfg: {**cfg, "rms_norm_eps": "x"}, "rms_norm_eps must be a positive number"),
    (lambda cfg: {**cfg, "max_position_embeddings": 2**31 - 1}, "max_position_embeddings 2147483647 is over"),
], ids=["a list", "head_dim 1e-30", "head_dim llama", "no heads", "eps a string", "context 2**31-1"])
def test_a_bad_config_is_refused_naming_the_file_and_field(change, message, tmp_path):
    """From the adversarial probe: these failed inside torch.empty, or as AttributeError."""
    cfg = json.loads((DATA / "tiny-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(change(cfg)))
    shutil.copy(DATA / "tiny-llama" / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message) as err:
        load_folder(tmp_path, device="cpu")
    assert "config.json" in str(err.value)


def test_gguf_context_length_beyond_any_position_table_is_refused(tmp_path):
    path = write_gguf("tiny-llama", tmp_path / "m.gguf", skip_keys=("context_length",),
                      extra_u32={"llama.context_length": 2**31 - 1})
    with pytest.raises(WeightsError, match="max_position_embeddings 2147483647 is over"):
        from_gguf(path)


def test_damaged_file_in_folder_is_refused(tmp_path):
    shutil.copy(DATA / "tiny-llama" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(GOOD[:-100])
    with pytest.raises(WeightsError, match="file truncated"):
        load_folder(tmp_path, device="cpu")


def test_good_header_passes():
    header = read_safetensors_header(DATA / "tiny-qwen3" / "model.safetensors")
    assert set(header) == set(ORDER) and header[ORDER[0]]["dtype"] == "F32"


# ---------------------------------------------------------------- sharded index and pickles


@pytest.fixture
def sharded(tmp_path):
    return make_shards("tiny-llama", tmp_path / "m")


def write_index(folder, weight_map=None, raw=None):
    text = raw if raw is not None else json.dumps({"weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)


def test_index_entry_outside_folder(sharded):
    folder, weight_map = sharded
    name, file = next(iter(weight_map.items()))
    shutil.copy(folder / file, folder.parent / file)  # it exists out there: still refused
    write_index(folder, {**weight_map, name: "../" + file})
    with pytest.raises(WeightsError, match=rf"tensor {name} points to '\.\./{file}', outside the model folder"):
        load_folder(folder, device="cpu")


def test_index_absolute_path(sharded):
    folder, weight_map = sharded
    name, file = next(iter(weight_map.items()))
    write_index(folder, {**weight_map, name: str((folder / file).resolve())})
    with pytest.raises(WeightsError, match="outside the model folder"):
        checkpoint_files(folder)


def test_index_missing_shard(sharded):
    folder, _ = sharded
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"shard model-00002-of-00002.safetensors \(holding tensor .*\) not found"):
        load_folder(folder, device="cpu")


def test_tensor_in_two_shards(sharded):
    folder, weight_map = sharded
    name, file = next(iter(weight_map.items()))
    other = folder / "model-00002-of-00002.safetensors"
    save_file({**load_file(other), name: load_file(folder / file)[name]}, other)
    with pytest.raises(WeightsError, match=f"tensor {name} is in two shards"):
        load_folder(folder, device="cpu")


def test_index_lists_a_tensor_twice(sharded):
    folder, weight_map = sharded
    name = next(iter(weight_map))
    body = json.dumps({"weight_map": weight_map})[:-2] + f', "{name}": "model-00002-of-00002.safetensors"}}}}'
    write_index(folder, raw=body)
    with pytest.raises(WeightsError, match=f"key '{name}' appears twice"):
        checkpoint_files(folder)


def test_index_names_the_wrong_shard(sharded):
    folder, weight_map = sharded
    name, file = next(iter(weight_map.items()))
    wrong = "model-00002-of-00002.safetensors" if file.startswith("model-00001") else "model-00001-of-00002.safetensors"
    write_index(folder, {**weight_map, name: wrong})
    with pytest.raises(WeightsError, match=f"tensor {name} is listed in {wrong} but that shard does not hold it"):
        checkpoint_files(folder)


def test_index_not_json(sharded):
    folder, _ = sharded
    write_index(folder, raw="{not json")
    with pytest.raises(WeightsError, match="not valid JSON"):
        checkpoint_files(folder)


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_checkpoints_refused(filename, tmp_path):
    shutil.copy(DATA / "tiny-llama" / "config.json", tmp_path / "config.json")
    torch.save({"w": torch.zeros(2)}, tmp_path / filename)
    with pytest.raises(WeightsError, match=f"{filename}: pickle checkpoints can run arbitrary code.*safetensors"):
        load_folder(tmp_path, device="cpu")
    with pytest.raises(WeightsError, match="pickle checkpoints"):
        load_model(tmp_path / filename, device="cpu")


def test_empty_folder_and_missing_folder(tmp_path):
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        load_folder(tmp_path, device="cpu")
    with pytest.raises(WeightsError, match="not a model folder"):
        load_folder(tmp_path / "nowhere", device="cpu")


def test_folder_layer_count_must_match_the_tensors(tmp_path):
    cfg = json.loads((DATA / "tiny-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    shutil.copy(DATA / "tiny-llama" / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="config says 5 layers, the weights hold 3"):
        load_folder(tmp_path, device="cpu")


def test_config_is_the_model_config():
    assert load_folder(DATA / "tiny-qwen3", device="cpu").config == ModelConfig.from_json(DATA / "tiny-qwen3")


@pytest.mark.parametrize("name", ["tiny-qwen2-untied", "tiny-qwen3"])
def test_stream_safetensors_equals_the_safetensors_library(name):
    """Our memory-mapped reader against safetensors' own: same names, dtypes, shapes and bytes."""
    from minillm.weights.loading import read_safetensors_header, stream_safetensors

    path = DATA / name / "model.safetensors"
    theirs = load_file(path)
    ours = {k: v.clone() for k, v in stream_safetensors(path, read_safetensors_header(path))}
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key


def _mutate_tensor_info(good: bytes, tensor: str, field: str, value: int) -> bytes:
    """Change one field of a tensor's info in a GGUF header: n_dims, dim0, type or offset."""
    name = tensor.encode()
    at = good.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", good, at)[0]
    where = {"n_dims": (at, "<I"), "dim0": (at + 4, "<Q"), "type": (at + 4 + 8 * n_dims, "<I"),
             "offset": (at + 8 + 8 * n_dims, "<Q")}[field]
    out = bytearray(good)
    struct.pack_into(where[1], out, where[0], value)
    return bytes(out)


def test_a_quantized_tensor_relabelled_f16_overlaps_its_neighbour(tmp_path):
    """From the adversarial probe: a Q4_1 tensor relabelled F16 used to load and give NaN logits."""
    good = write_gguf("tiny-llama", tmp_path / "m.gguf", Q.Q4_1).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_mutate_tensor_info(good, "blk.0.attn_q.weight", "type", int(Q.F16)))
    with pytest.raises(WeightsError, match="blk.0.attn_q.weight|overlap"):
        from_gguf(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: g[:4] + struct.pack("<I", 99) + g[8:], "version 99"),
        (lambda g: g[:8] + struct.pack("<Q", 2**60) + g[16:], "not a readable GGUF file"),  # tensor count
        (lambda g: g[:16] + struct.pack("<Q", 2**60) + g[24:], "not a readable GGUF file"),  # metadata count
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "dim0", 0), "output_norm.weight"),
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "dim0", 2**40), "bad.gguf: not a readable GGUF"),
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "offset", 2**40), "bad.gguf: not a readable GGUF"),
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "offset", 3), "output_norm.weight"),  # misaligned
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "type", 9999), "not a readable GGUF file"),
        (lambda g: _mutate_tensor_info(g, "output_norm.weight", "offset", 0), "output_norm.weight .*overlap"),
        (lambda g: _mutate_tensor_info(g, "blk.0.attn_q.weight", "type", int(Q.F16)), "a gap"),  # F32 read as F16
    ],
    ids=["bad-version", "absurd-tensor-count", "absurd-metadata-count", "zero-dim", "oversized-dim",
         "offset-past-end", "misaligned-offset", "unknown-type", "offset-0-overlaps", "f32-relabelled-f16"],
)
def test_gguf_header_fields_are_bounds_checked(change, message, tmp_path):
    good = write_gguf("tiny-llama", tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(change(good))
    with pytest.raises(WeightsError, match=message):
        from_gguf(bad)
