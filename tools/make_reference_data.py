"""Write minillm's reference data in data/ with Hugging Face transformers.

    .venv/bin/python tools/make_reference_data.py            # everything
    .venv/bin/python tools/make_reference_data.py --only tiny-llama

With OMP_NUM_THREADS=1 it rewrites the stored files byte for byte; more threads sum in another
order and may move a stored logit in its last bits (6e-6 on qwen3_5-tiny).

For each tiny random checkpoint (data/tiny-*/, and Qwen3.5's data/qwen3_5-tiny/):
  config.json, model.safetensors   Hugging Face layout, config in the hub's classic format
  reference.safetensors            input_ids_i (T,), logits_i (T, V) fp32, greedy_i (32,)
  reference.json                   what was made, how, and with which versions

For the embedded SmolLM2-135M-Instruct GGUF (data/smollm2/):
  reference.safetensors            prompt_ids_i (T,), last_logits_i (V,) fp32, greedy_i (32,)
  reference.json                   the chat messages, the rendered prompts, the GGUF's sha256

Then data/manifest.json lists every file under data/ with its size and sha256 (including
data/configs/, real hub config.json files copied by hand; `--manifest-only` rewrites just it).

Everything is computed in fp32 with transformers' eager attention, from a model
re-loaded from the files just written (so the folder on disk is what is checked).
Greedy continuations are a full recompute per token (no KV cache) and ignore eos.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from minillm.weights.hub import sha256_file

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
GREEDY_TOKENS = 32
SEED = 20261129

# Small enough to be a few hundred KB, big enough to have every feature:
# grouped-query attention (4 query heads, 2 KV heads), several layers, V not a power of 2.
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    hidden_act="silu",
    torch_dtype="float32",
    bos_token_id=1,
    eos_token_id=2,
)

TINY_MODELS = {
    # Qwen2/2.5: q/k/v projections have a bias; Qwen2.5-0.5B ties embeddings, 7B does not.
    "tiny-qwen2-tied": dict(
        _COMMON,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=3,
        attention_dropout=0.0,
    ),
    "tiny-qwen2-untied": dict(
        _COMMON,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=3,
        attention_dropout=0.0,
    ),
    # Qwen3: RMSNorm on q and k per head, no qkv bias, head_dim read from the config
    # (32 here, while hidden_size / num_attention_heads = 16).
    "tiny-qwen3": dict(
        _COMMON,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=3,
        attention_dropout=0.0,
    ),
    # Llama family (SmolLM2, Llama 2/3): no biases, tied embeddings like SmolLM2.
    "tiny-llama": dict(
        _COMMON,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pretraining_tp=1,
    ),
}

SEQUENCE_LENGTHS = (1, 9, 80)  # one token, a short prompt, one of >= 64 tokens

# Qwen3.5 (transformers' qwen3_5): three Gated DeltaNet layers, then one gated-attention layer.
# Each knob differs from its neighbour so a swapped size fails: 2 key heads serve 4 value heads
# (as in Qwen3.5-4B/9B), key and value head dims differ, head_dim 32 with a partial RoPE of 25%
# (8 rotated dims), and the chunked prefill (chunks of 64) meets a boundary in the 80- and
# 140-token prompts. The hub's layout: Qwen3_5ForConditionalGeneration, the decoder under
# model.language_model., a tiny vision tower under model.visual., tied embeddings like Qwen3.5-0.8B.
# (The text-only layout, Qwen3_5ForCausalLM with the decoder under model., is the same weights
# renamed: the tests write it from this one rather than keep a second copy in data/.)
_QWEN3_5_TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    attention_bias=False,
    attn_output_gate=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_interleaved=True, mrope_section=[2, 1, 1]),
    bos_token_id=None,
    eos_token_id=2,
)
QWEN3_5_MODELS = {
    "qwen3_5-tiny": dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        tie_word_embeddings=True,
        text_config=dict(_QWEN3_5_TEXT, model_type="qwen3_5_text", tie_word_embeddings=True),
        vision_config=dict(model_type="qwen3_5_vision", depth=1, hidden_size=16, intermediate_size=32,
                           num_heads=2, out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, num_position_embeddings=16),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303,
    ),
}
QWEN3_5_LENGTHS = (1, 9, 80, 140)

# Mixture of experts (notebook 23), with a vocabulary of 192 to keep data/ small. Qwen3-MoE
# (transformers' qwen3_moe): Qwen3's attention, and in each of 2 layers a router choosing 3 of 8
# experts, renormalised (norm_topk_prob, as Qwen3-30B-A3B). Qwen3.5-MoE (qwen3_5_moe): the hybrid
# of qwen3_5-tiny cut to one DeltaNet and one attention layer, each MoE block with a shared expert
# behind a sigmoid gate, in the hub's layout (Qwen3_5MoeForConditionalGeneration, a vision tower).
_MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, vocab_size=192)
MOE_MODELS = {
    "qwen3_moe-tiny": dict(
        _COMMON,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=2,
        head_dim=16,
        intermediate_size=96,  # unused: every layer is sparse
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        **_MOE,
    ),
    "qwen3_5_moe-tiny": dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        model_type="qwen3_5_moe",
        tie_word_embeddings=True,
        text_config=dict(
            {k: v for k, v in _QWEN3_5_TEXT.items() if k != "intermediate_size"},
            model_type="qwen3_5_moe_text", tie_word_embeddings=True, num_hidden_layers=2, head_dim=16,
            layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
            shared_expert_intermediate_size=32, **_MOE),
        vision_config=dict(model_type="qwen3_5_moe_vision", depth=1, hidden_size=16, intermediate_size=32,
                           num_heads=2, out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, num_position_embeddings=16),
        image_token_id=188, video_token_id=189, vision_start_token_id=190, vision_end_token_id=191,
    ),
}
MOE_LENGTHS = (1, 9, 80)

SMOLLM2_CHATS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [
        {"role": "system", "content": "You are a patient teacher."},
        {"role": "user", "content": "Explain what a transformer language model does, step by step."},
    ],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "12 times 7 is 84."},
        {"role": "user", "content": "And what is that divided by 4? Explain how you got it."},
    ],
]


def versions() -> dict:
    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def spread_init(model: torch.nn.Module, generator: torch.Generator, zero_centred: bool = False) -> None:
    """Re-initialise so logits spread over several units.

    transformers' default init (std 0.02) leaves a tiny model's logits nearly uniform,
    so a wrong RoPE offset or a dropped bias can hide inside a 1e-4 tolerance. Here each
    linear weight keeps activations at unit scale (std 1/sqrt(fan_in)), biases and norm
    weights are far from 0 and 1, and embeddings are large enough for logits of a few units.
    zero_centred: the model's RMSNorms scale by (1 + weight) (Qwen3.5), so their weights sit near 0.
    A vision tower (model.visual.) keeps transformers' init: a text model never reads it.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in f".{name}":
                continue
            if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            elif zero_centred and name.endswith("norm.weight") and "linear_attn.norm" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))  # Qwen3.5 scales by (1 + w)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name.endswith("A_log"):  # per-head decay rate: some heads keep state long, some forget fast
                p.copy_(torch.empty(p.shape).uniform_(-4.0, 1.0, generator=generator))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif name.endswith("conv1d.weight"):  # (C, 1, K) depthwise
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif p.ndim in (2, 3):  # a linear weight (out, in), or one per expert (E, out, in)
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=generator) * 1.2 / math.sqrt(fan_in))
            else:
                raise ValueError(f"spread_init: no rule for parameter {name} {tuple(p.shape)}")


def greedy(model, input_ids: torch.Tensor, n: int) -> tuple[list[int], float]:
    """n greedy tokens by full recompute, ignoring eos. input_ids: (T,).

    Also returns the smallest gap between the best and second-best logit along the
    way: a gap far above the comparison tolerance means the tokens cannot flip on noise.
    """
    ids = input_ids.tolist()
    out, margin = [], math.inf
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]  # (V,)
            top2 = torch.topk(logits, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
    return out, margin


def empty_folder(name: str) -> Path:
    """data/<name>, emptied (or made)."""
    folder = DATA / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def save_checkpoint(model, folder: Path, hub_config: dict) -> None:
    """model.safetensors as transformers writes it, and config.json in the hub's format (no other file)."""
    model.save_pretrained(folder, safe_serialization=True)
    for extra in folder.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    (folder / "config.json").write_text(json.dumps(hub_config, indent=2, sort_keys=True) + "\n")


def save_reference(model, folder: Path, hub_config: dict, seed: int, vocab_size: int, lengths, **notes) -> None:
    """reference.safetensors and reference.json of `model` (reloaded from `folder`): random prompts of
    `lengths`, their logits and greedy continuations; `notes` are extra keys of reference.json."""
    tensors, sequences = reference_sequences(model, vocab_size, lengths, torch.Generator().manual_seed(seed + 1))
    save_file(tensors, folder / "reference.safetensors")
    meta = {
        "model": folder.name,
        "architecture": hub_config["architectures"][0],
        "seed": seed,
        "versions": versions(),
        "attn_implementation": "eager",
        "dtype": "float32",
        **notes,
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_method": "argmax of a full recompute per step, eos ignored",
        "sequences": sequences,
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{folder.name}: logits std per position {[s['logits_std'] for s in sequences]}")


def build_tiny(name: str, hub_config: dict, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = empty_folder(name)
    config = AutoConfig.for_model(**{k: v for k, v in hub_config.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_init(model, torch.Generator().manual_seed(seed))
    # config.json in the hub's classic format (rope_theta at top level, as in
    # Qwen/Qwen2.5-0.5B-Instruct), which is what users download.
    save_checkpoint(model, folder, hub_config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    save_reference(model, folder, hub_config, seed, hub_config["vocab_size"], SEQUENCE_LENGTHS)


def reference_sequences(model, vocab_size: int, lengths, gen: torch.Generator) -> tuple[dict, list]:
    """Random prompts of the given lengths, their logits (T, V) and greedy continuations."""
    tensors, sequences = {}, []
    for i, length in enumerate(lengths):
        # token ids from 3 upward: 0..2 are the pad/bos/eos ids of the config
        input_ids = torch.randint(3, vocab_size, (length,), generator=gen)
        with torch.no_grad():
            logits = model(input_ids[None]).logits[0].float()  # (T, V)
        cont, margin = greedy(model, input_ids, GREEDY_TOKENS)
        tensors[f"input_ids_{i}"] = input_ids.to(torch.int64)
        tensors[f"logits_{i}"] = logits.contiguous()
        tensors[f"greedy_{i}"] = torch.tensor(cont, dtype=torch.int64)
        sequences.append({"length": length, "input_ids": input_ids.tolist(), "greedy": cont,
                          "logits_std": round(float(logits.std(dim=-1).mean()), 4),
                          "greedy_min_top2_margin": round(margin, 6)})
    return tensors, sequences


def build_tiny_qwen3_5(name: str, hub_config: dict, seed: int) -> None:
    """A tiny Qwen3.5 in the hub's layout (Qwen3_5ForConditionalGeneration), checked by reloading it
    as a user would (from the folder)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    folder = empty_folder(name)
    torch.manual_seed(seed)
    config = Qwen3_5Config(**{k: v for k, v in hub_config.items() if k != "architectures"})
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    spread_init(model, torch.Generator().manual_seed(seed), zero_centred=True)
    save_checkpoint(model, folder, hub_config)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    save_reference(model.eval(), folder, hub_config, seed, hub_config["text_config"]["vocab_size"], QWEN3_5_LENGTHS,
                   linear_attention="transformers' torch_chunk_gated_delta_rule (chunks of 64), no cache")


def build_tiny_moe(name: str, hub_config: dict, seed: int) -> None:
    """A tiny Qwen3-MoE or Qwen3.5-MoE, checked by reloading it from the folder. transformers holds the
    experts packed (gate_up_proj (E, 2I, h)) and saves them one tensor each (experts.{e}.gate_proj.weight
    (I, h), up_proj, down_proj (h, I)), the layout Qwen/Qwen3-30B-A3B ships."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3MoeConfig

    folder = empty_folder(name)
    torch.manual_seed(seed)
    settings = {k: v for k, v in hub_config.items() if k != "architectures"}
    hybrid = hub_config["model_type"] == "qwen3_5_moe"
    if hybrid:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**settings)).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**settings), dtype=torch.float32)
    spread_init(model, torch.Generator().manual_seed(seed), zero_centred=hybrid)
    save_checkpoint(model, folder, hub_config)  # transformers writes one tensor per expert and projection
    model_class = Qwen3_5MoeForConditionalGeneration if hybrid else AutoModelForCausalLM
    model = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    text = hub_config.get("text_config", hub_config)
    save_reference(model, folder, hub_config, seed, text["vocab_size"], MOE_LENGTHS,
                   experts_implementation=model.config._experts_implementation)


def build_smollm2() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from minillm.weights.embedded import PIP_NAME, embedded_gguf_path

    gguf = embedded_gguf_path()
    folder = DATA / "smollm2"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tensors, prompts = {}, []
    for i, messages in enumerate(SMOLLM2_CHATS):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        with torch.no_grad():
            last = model(ids[None]).logits[0, -1].float()  # (V,)
        cont, margin = greedy(model, ids, GREEDY_TOKENS)
        tensors[f"prompt_ids_{i}"] = ids
        tensors[f"last_logits_{i}"] = last.contiguous()
        tensors[f"greedy_{i}"] = torch.tensor(cont, dtype=torch.int64)
        prompts.append(
            {
                "messages": messages,
                "rendered": text,
                "prompt_ids": ids.tolist(),
                "greedy": cont,
                "greedy_text": tokenizer.decode(cont),
                "greedy_min_top2_margin": round(margin, 6),
            }
        )
        print(f"smollm2 prompt {i}: {len(ids)} tokens -> {tokenizer.decode(cont)!r}")
    save_file(tensors, folder / "reference.safetensors")
    meta = {
        "model": "SmolLM2-135M-Instruct",
        "source": {"package": PIP_NAME, "file": gguf.name, "sha256": sha256_file(gguf)},
        "versions": versions(),
        "attn_implementation": "eager",
        "dtype": "float32 (GGUF tensors dequantized by transformers)",
        "vocab_size": int(last.shape[0]),
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_method": "argmax of a full recompute per step, eos ignored",
        "prompts": prompts,
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def write_manifest() -> None:
    files = {}
    for path in sorted(DATA.rglob("*")):
        rel = path.relative_to(DATA).as_posix()
        if path.is_file() and rel not in ("manifest.json", "README.md"):
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"versions": versions(), "files": files}
    (DATA / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    total = sum(f["bytes"] for f in files.values())
    print(f"data/: {len(files)} files, {total / 1e6:.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description="Write minillm's reference data with transformers.")
    parser.add_argument("--only", choices=[*TINY_MODELS, *QWEN3_5_MODELS, *MOE_MODELS, "smollm2"], help="rebuild one fixture")
    parser.add_argument("--manifest-only", action="store_true", help="only rewrite data/manifest.json")
    args = parser.parse_args()
    if args.manifest_only:
        write_manifest()
        return
    for i, (name, config) in enumerate(TINY_MODELS.items()):
        if args.only in (None, name):
            build_tiny(name, config, SEED + 100 * i)
    for i, (name, config) in enumerate(QWEN3_5_MODELS.items()):
        if args.only in (None, name):
            build_tiny_qwen3_5(name, config, SEED + 1000 + 100 * i)
    for i, (name, config) in enumerate(MOE_MODELS.items()):
        if args.only in (None, name):
            build_tiny_moe(name, config, SEED + 2000 + 100 * i)
    if args.only in (None, "smollm2"):
        build_smollm2()
    write_manifest()


if __name__ == "__main__":
    main()
