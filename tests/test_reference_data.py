"""The reference data in data/ says what it claims (see data/README.md).

Every fixture is loaded and checked: the manifest against the files, each tiny checkpoint's
names and shapes against its config, the stored tensors against reference.json, and the
stored logits against transformers run again on the stored weights (and, for SmolLM2, on
the embedded GGUF).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from support import DATA, HYBRID, ROOT, TINY
from minillm.weights.hub import sha256_file
from support import HYBRID_REL, SMOLLM2_REL, TINY_REL, assert_logits_close, logits_tolerance, top2_margin

GREEDY_TOKENS = 32
NOT_IN_MANIFEST = {"manifest.json", "README.md"}

HF_CONFIG_FIELDS = [
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
]


# ---------------------------------------------------------------- helpers


def pinned_transformers() -> str:
    """The transformers version pinned in requirements-dev.txt."""
    text = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8")
    match = re.search(r"^transformers==(\S+)\s*$", text, re.MULTILINE)
    assert match, "requirements-dev.txt has no 'transformers==X' pin"
    return match.group(1)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def head_dim(config: dict) -> int:
    """Qwen3 states head_dim in its config; Qwen2 and Llama derive it."""
    if config["model_type"] == "qwen3":
        return config["head_dim"]
    return config["hidden_size"] // config["num_attention_heads"]


def expected_weights(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a checkpoint with this config must hold, and no others."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * head_dim(config)
    kv_out = config["num_key_value_heads"] * head_dim(config)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config["model_type"] == "qwen2":  # qkv bias
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
        if config["model_type"] == "qwen3":  # per-head RMSNorm on q and k
            shapes |= {
                p + "self_attn.q_norm.weight": (head_dim(config),),
                p + "self_attn.k_norm.weight": (head_dim(config),),
            }
    return shapes


def rel_of(name: str) -> float:
    """The logits tolerance level of a fixture (tests/support.py): the hybrid's float32 is noisier."""
    return HYBRID_REL if name in HYBRID else TINY_REL


def numbered(tensors: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    """tensors[prefix_0], tensors[prefix_1], ... in order."""
    count = sum(1 for name in tensors if re.fullmatch(rf"{prefix}_\d+", name))
    return [tensors[f"{prefix}_{i}"] for i in range(count)]


def load_hf_model(path: Path, **kwargs):
    """A transformers model in fp32 with eager attention; every weight must come from the file.

    A folder whose config names a multimodal architecture (Qwen3_5ForConditionalGeneration: the
    text model beside a vision tower) loads that class, so that every tensor of the file is used."""
    import transformers
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        architecture = (read_json(config_file).get("architectures") or [""])[0]
        if architecture.endswith("ForConditionalGeneration"):
            model_class = getattr(transformers, architecture)
    torch.manual_seed(0)  # any weight left to random init would at least be reproducible
    model, info = model_class.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **kwargs
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# ---------------------------------------------------------------- manifest


def test_manifest_lists_exactly_the_files_with_sizes_and_hashes():
    manifest = read_json(DATA / "manifest.json")
    on_disk = {
        p.relative_to(DATA).as_posix()
        for p in DATA.rglob("*")
        if p.is_file() and p.relative_to(DATA).as_posix() not in NOT_IN_MANIFEST
    }
    assert on_disk == set(manifest["files"])
    for rel, entry in manifest["files"].items():
        path = DATA / rel
        assert path.stat().st_size == entry["bytes"], rel
        assert sha256_file(path) == entry["sha256"], rel
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    assert total < 10_000_000, f"data/ is {total / 1e6:.1f} MB"


def test_manifest_transformers_version_is_the_pinned_one():
    assert read_json(DATA / "manifest.json")["versions"]["transformers"] == pinned_transformers()


# ---------------------------------------------------------------- tiny checkpoints


def test_tiny_folders_are_exactly_the_four_variants_and_the_hybrid():
    """tiny-* are the decoder's (its notebooks loop over them); the hybrid's folder is named apart."""
    assert {p.name for p in DATA.glob("tiny-*") if p.is_dir()} == set(TINY)
    assert all((DATA / name / "reference.safetensors").is_file() for name in HYBRID)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_config_is_the_hubs_layout(name):
    """Qwen3.5's config.json as the hub has it: the text model's fields under text_config (3
    DeltaNet layers then 1 attention layer), a vision tower's under vision_config."""
    config = read_json(DATA / name / "config.json")
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["num_hidden_layers"] == len(text["layer_types"])
    assert config["vision_config"]["model_type"] == "qwen3_5_vision"
    assert config["tie_word_embeddings"] and text["tie_word_embeddings"]
    names = tensor_shapes(DATA / name / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.0.linear_attn.A_log" in names
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names


@pytest.mark.parametrize("name", TINY)
def test_tiny_config_has_hf_fields(name):
    config = read_json(DATA / name / "config.json")
    missing = [field for field in HF_CONFIG_FIELDS if field not in config]
    assert not missing, f"{name}/config.json lacks {missing}"
    assert config["model_type"] in name  # tiny-qwen2-*, tiny-qwen3, tiny-llama
    assert config["tie_word_embeddings"] == (name != "tiny-qwen2-untied")


@pytest.mark.parametrize("name", TINY)
def test_tiny_weights_match_config(name):
    """Names and shapes are exactly those the config implies: GQA widths, qkv bias for
    Qwen2 only, q/k norms for Qwen3 only, lm_head.weight only when untied."""
    config = read_json(DATA / name / "config.json")
    actual = tensor_shapes(DATA / name / "model.safetensors")
    expected = expected_weights(config)
    assert set(actual) == set(expected), (
        f"extra {sorted(set(actual) - set(expected))}, missing {sorted(set(expected) - set(actual))}"
    )
    for tensor, shape in expected.items():
        assert actual[tensor] == shape, f"{name}: {tensor} is {actual[tensor]}, expected {shape}"
    if config["model_type"] == "qwen3":
        assert head_dim(config) != config["hidden_size"] // config["num_attention_heads"]
    has_bias = any(t.endswith("_proj.bias") for t in actual)
    assert has_bias == (config["model_type"] == "qwen2")


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_tiny_reference_tensors(name):
    """Shapes, dtypes and coverage: a 1-token and a >= 64-token sequence, ids inside the vocab."""
    config = read_json(DATA / name / "config.json")
    vocab = config.get("text_config", config)["vocab_size"]  # Qwen3.5 nests the text model's fields
    ref = load_file(DATA / name / "reference.safetensors")
    inputs, logits, greedy = numbered(ref, "input_ids"), numbered(ref, "logits"), numbered(ref, "greedy")
    assert len(inputs) >= 3 and len(inputs) == len(logits) == len(greedy) == len(ref) // 3
    lengths = [len(ids) for ids in inputs]
    assert 1 in lengths and max(lengths) >= 64, lengths
    for ids, lg, cont in zip(inputs, logits, greedy):
        assert ids.dtype == torch.int64 and ids.ndim == 1
        assert lg.dtype == torch.float32 and lg.shape == (len(ids), vocab)
        assert cont.dtype == torch.int64 and cont.shape == (GREEDY_TOKENS,)
        for tokens in (ids, cont):
            assert 0 <= int(tokens.min()) and int(tokens.max()) < vocab


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_tiny_reference_json_agrees_with_tensors(name):
    meta = read_json(DATA / name / "reference.json")
    ref = load_file(DATA / name / "reference.safetensors")
    assert meta["versions"]["transformers"] == pinned_transformers()
    if name in HYBRID:  # the 140-token prompt crosses two of the DeltaNet's 64-token chunks
        assert meta["architecture"] == read_json(DATA / name / "config.json")["architectures"][0]
        assert max(seq["length"] for seq in meta["sequences"]) > 128
    assert meta["dtype"] == "float32" and meta["attn_implementation"] == "eager"
    assert len(meta["sequences"]) == len(numbered(ref, "input_ids"))
    for i, seq in enumerate(meta["sequences"]):
        assert seq["length"] == len(ref[f"input_ids_{i}"])
        assert seq["input_ids"] == ref[f"input_ids_{i}"].tolist()
        assert seq["greedy"] == ref[f"greedy_{i}"].tolist()
        std = float(ref[f"logits_{i}"].std(dim=-1).mean())
        assert seq["logits_std"] == pytest.approx(std, abs=1e-3)


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_tiny_logits_spread_and_greedy_starts_at_argmax(name):
    """Spread logits (std over the vocab well above 1) are what lets a 1e-4 comparison
    catch a subtle bug; the first greedy token is the argmax after the prompt."""
    ref = load_file(DATA / name / "reference.safetensors")
    for i, logits in enumerate(numbered(ref, "logits")):
        assert float(logits.std(dim=-1).mean()) > 1.0, f"{name} logits_{i} nearly uniform"
        assert int(ref[f"greedy_{i}"][0]) == int(logits[-1].argmax())


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_transformers_reproduces_tiny_logits(name):
    ref = load_file(DATA / name / "reference.safetensors")
    model = load_hf_model(DATA / name)
    with torch.no_grad():
        for i, ids in enumerate(numbered(ref, "input_ids")):
            logits = model(ids[None]).logits[0]  # (T, V)
            assert_logits_close(logits, ref[f"logits_{i}"], rel_of(name), msg=f"{name} logits_{i}")


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_tiny_greedy_margins_survive_the_tolerance(name):
    """Every stored greedy step is decided by more than twice the logits tolerance, so a machine
    whose logits pass the tolerance also picks the stored tokens (tests/support.py).
    Measured smallest margins: 0.017 (tiny-qwen2-untied) against 2 x 1.3e-4."""
    ref = load_file(DATA / name / "reference.safetensors")
    model = load_hf_model(DATA / name)
    for i, prompt in enumerate(numbered(ref, "input_ids")):
        tol = logits_tolerance(ref[f"logits_{i}"], rel_of(name))
        assert_greedy_decided_beyond(2 * tol, model, prompt, ref[f"greedy_{i}"], f"{name} greedy_{i}")


def assert_greedy_decided_beyond(gap: float, model, prompt: torch.Tensor, greedy: torch.Tensor, what: str) -> None:
    """transformers, fed prompt + greedy (teacher forcing), picks every greedy token with a top-2 margin > gap."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, greedy[:-1]])[None]).logits[0, len(prompt) - 1 :]  # (32, V)
    assert logits.argmax(-1).tolist() == greedy.tolist(), what
    margin = top2_margin(logits)
    assert float(margin.min()) > gap, f"{what} step {int(margin.argmin())}: top-2 margin {float(margin.min()):.1e} <= {gap:.1e}"


@pytest.mark.parametrize("name", TINY + HYBRID)
def test_transformers_reproduces_tiny_greedy_on_long_sequence(name):
    """Teacher forcing: one forward over prompt + greedy[:-1] gives, at each of the last 32
    positions, the logits the full-recompute greedy step saw, so its argmax is that token."""
    ref = load_file(DATA / name / "reference.safetensors")
    inputs = numbered(ref, "input_ids")
    i = max(range(len(inputs)), key=lambda k: len(inputs[k]))
    prompt, greedy = inputs[i], ref[f"greedy_{i}"]
    model = load_hf_model(DATA / name)
    with torch.no_grad():
        logits = model(torch.cat([prompt, greedy[:-1]])[None]).logits[0]  # (T + 31, V)
    predicted = logits[len(prompt) - 1 :].argmax(dim=-1)  # (32,)
    assert predicted.tolist() == greedy.tolist()


# ---------------------------------------------------------------- SmolLM2 (embedded GGUF)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from minillm.weights.embedded import embedded_gguf_path

    return embedded_gguf_path()


@pytest.fixture(scope="module")
def smollm2_meta() -> dict:
    return read_json(DATA / "smollm2" / "reference.json")


@pytest.fixture(scope="module")
def smollm2_ref() -> dict[str, torch.Tensor]:
    return load_file(DATA / "smollm2" / "reference.safetensors")


@pytest.fixture(scope="module")
def smollm2_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def smollm2_model(gguf_path):
    return load_hf_model(gguf_path.parent, gguf_file=gguf_path.name)


def gguf_vocab_size(path: Path) -> int:
    import gguf

    return int(gguf.GGUFReader(path).fields["llama.vocab_size"].contents())


def test_smollm2_source_is_the_embedded_gguf(gguf_path, smollm2_meta):
    assert smollm2_meta["source"]["file"] == gguf_path.name
    assert smollm2_meta["source"]["sha256"] == sha256_file(gguf_path)
    assert smollm2_meta["versions"]["transformers"] == pinned_transformers()


def test_smollm2_reference_tensors(gguf_path, smollm2_meta, smollm2_ref):
    vocab = gguf_vocab_size(gguf_path)
    prompts = smollm2_meta["prompts"]
    assert len(prompts) >= 3
    assert len(numbered(smollm2_ref, "prompt_ids")) == len(prompts) == len(smollm2_ref) // 3
    for i, prompt in enumerate(prompts):
        ids, last, greedy = (smollm2_ref[f"{k}_{i}"] for k in ("prompt_ids", "last_logits", "greedy"))
        assert ids.dtype == torch.int64 and ids.tolist() == prompt["prompt_ids"]
        assert last.dtype == torch.float32 and last.shape == (vocab,)
        assert greedy.dtype == torch.int64 and greedy.tolist() == prompt["greedy"]
        assert len(greedy) == GREEDY_TOKENS
        assert int(greedy[0]) == int(last.argmax())
        assert int(ids.max()) < vocab and int(greedy.max()) < vocab


def test_smollm2_chat_template_and_tokens(smollm2_meta, smollm2_tokenizer):
    """transformers renders each chat to the stored text, which tokenizes to the stored ids."""
    for i, prompt in enumerate(smollm2_meta["prompts"]):
        text = smollm2_tokenizer.apply_chat_template(
            prompt["messages"], tokenize=False, add_generation_prompt=True
        )
        assert text == prompt["rendered"], f"prompt {i}"
        ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == prompt["prompt_ids"], f"prompt {i}"


def test_transformers_reproduces_smollm2_last_logits(smollm2_ref, smollm2_model):
    ids = smollm2_ref["prompt_ids_0"]
    with torch.no_grad():
        last = smollm2_model(ids[None]).logits[0, -1]  # (V,)
    assert_logits_close(last, smollm2_ref["last_logits_0"], rel=SMOLLM2_REL)


def test_smollm2_greedy_margins_survive_the_tolerance(smollm2_ref, smollm2_model):
    """As for the tiny fixtures: every stored SmolLM2 greedy step is decided by more than twice
    the SMOLLM2_REL tolerance (measured smallest margin: 0.012 against 2 x 9e-4)."""
    for i, prompt in enumerate(numbered(smollm2_ref, "prompt_ids")):
        tol = logits_tolerance(smollm2_ref[f"last_logits_{i}"], SMOLLM2_REL)
        assert_greedy_decided_beyond(2 * tol, smollm2_model, prompt, smollm2_ref[f"greedy_{i}"], f"greedy_{i}")
