"""Write minillm's reference data in data/ with Hugging Face transformers.

    .venv/bin/python tools/make_reference_data.py            # everything
    .venv/bin/python tools/make_reference_data.py --only tiny-llama

For each tiny random checkpoint (data/tiny-*/):
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


def spread_init(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-initialise so logits spread over several units.

    transformers' default init (std 0.02) leaves a tiny model's logits nearly uniform,
    so a wrong RoPE offset or a dropped bias can hide inside a 1e-4 tolerance. Here each
    linear weight keeps activations at unit scale (std 1/sqrt(fan_in)), biases and norm
    weights are far from 0 and 1, and embeddings are large enough for logits of a few units.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 2:
                fan_in = p.shape[1]
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


def build_tiny(name: str, hub_config: dict, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = DATA / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config = AutoConfig.for_model(**{k: v for k, v in hub_config.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_init(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(folder, safe_serialization=True)
    for extra in folder.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    # config.json in the hub's classic format (rope_theta at top level, as in
    # Qwen/Qwen2.5-0.5B-Instruct), which is what users download.
    (folder / "config.json").write_text(json.dumps(hub_config, indent=2, sort_keys=True) + "\n")

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tensors, sequences = {}, []
    for i, length in enumerate(SEQUENCE_LENGTHS):
        # token ids from 3 upward: 0..2 are the pad/bos/eos ids of the config
        input_ids = torch.randint(3, hub_config["vocab_size"], (length,), generator=gen)
        with torch.no_grad():
            logits = model(input_ids[None]).logits[0].float()  # (T, V)
        cont, margin = greedy(model, input_ids, GREEDY_TOKENS)
        tensors[f"input_ids_{i}"] = input_ids.to(torch.int64)
        tensors[f"logits_{i}"] = logits.contiguous()
        tensors[f"greedy_{i}"] = torch.tensor(cont, dtype=torch.int64)
        sequences.append(
            {
                "length": length,
                "input_ids": input_ids.tolist(),
                "greedy": cont,
                "logits_std": round(float(logits.std(dim=-1).mean()), 4),
                "greedy_min_top2_margin": round(margin, 6),
            }
        )
    save_file(tensors, folder / "reference.safetensors")
    meta = {
        "model": name,
        "architecture": hub_config["architectures"][0],
        "seed": seed,
        "versions": versions(),
        "attn_implementation": "eager",
        "dtype": "float32",
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_method": "argmax of a full recompute per step, eos ignored",
        "sequences": sequences,
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: logits std per position {[s['logits_std'] for s in sequences]}")


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
    parser.add_argument("--only", choices=[*TINY_MODELS, "smollm2"], help="rebuild one fixture")
    parser.add_argument("--manifest-only", action="store_true", help="only rewrite data/manifest.json")
    args = parser.parse_args()
    if args.manifest_only:
        write_manifest()
        return
    for i, (name, config) in enumerate(TINY_MODELS.items()):
        if args.only in (None, name):
            build_tiny(name, config, SEED + 100 * i)
    if args.only in (None, "smollm2"):
        build_smollm2()
    write_manifest()


if __name__ == "__main__":
    main()
