"""The benchmark's moe section (plumbing): a mixture of experts of Qwen3-30B-A3B's layer shape, minillm
beside transformers.

No MoE weights are stored offline, and speed does not depend on their values, so both sides run random
weights: by default QWEN3_30B_A3B_LAYERS, Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 KV heads
of 128, 128 experts of width 768, 8 per token, renormalised) in LAYERS of its 48 layers, with a
32,000-token tied vocabulary (its own 151,936-row head, untied, would weigh more than two layers'
experts and turn a decode step into a read of the head), at std 0.05 (at transformers' default 0.02
two layers only repeat a token or two, and agreeing on that proves nothing); with --quick, the sizes
of data/qwen3_moe-tiny at std 0.3. transformers builds `Qwen3MoeForCausalLM(Qwen3MoeConfig(...))` under torch.manual_seed(SEED)
with its own init, in --dtype; minillm's `MoeCausalLM` then takes that model's state_dict with
assign=True (the same names: experts stacked), so the two share one copy of the weights. transformers
runs its default experts implementation (in 5.23 on a CPU, `grouped_mm`: its own grouped form).

Both sides get the same seeded random prompt ids, greedy decoding with no end-of-sequence, the same
threads. Rows (section "moe"; variant "readable": MoeCausalLM, its experts grouped):

- first generate (s, n = --tokens): each side's first generate call in a fresh process (peers.
  fresh_first_generate: the pair built there from the same seed, then that one call timed);
  generate (s): the same call in this process, the best of --repeats after a warm-up.
- time to first token (ms) and prefill (tok/s) at each of --prompt-lengths: the best of --repeats
  calls of 1 new token.
- decode (tok/s): (tokens - 1) / (t(tokens) - t(1 token)), as peers.measure; greedy agreement:
  leading tokens equal to transformers'; distinct tokens: how many different ids each side made.
- engine (tok/s, n = the smallest --requests): useful tokens per second of mixed requests through
  notebook 17's Engine, against transformers' generate on them as one left-padded batch.
- experts, one layer (ms, n = tokens routed: 1 and 16): layer 0's experts on random tokens routed by
  its own router: minillm's grouped form ("grouped") and its readable loop ("loop"), against
  transformers' Qwen3MoeExperts running grouped_mm and eager respectively; and notebook 23's int4
  QuantizedExperts ("int4", on appendix A4's kernel where it builds) against grouped_mm; the best of
  --repeats.

Variants "fast", "fast-int8" and "fast-int4" (notebook 23's FastMoeCausalLM, its experts in float32,
int8 or int4): time to first token, prefill and decode as above, and greedy agreement, each beside
transformers' float model of the same run (quantized experts agree only as far as rounding lets them).

With --peers llama.cpp (llama-cpp-python, an optional extra: absent, the reason is under "skipped"), the
same weights are written as llama.cpp's qwen3moe GGUF file in float32 (appendix A7's writer) and quantized from
it by llama.cpp's own llama_model_quantize to Q8_0 and Q4_1 (LLAMA_CPP_TYPES): variants "llama.cpp F32",
"llama.cpp Q8_0", "llama.cpp Q4_1" get time to first token, prefill, decode and greedy agreement beside
transformers as above, and each minillm variant of the same precision a row "decode vs llama.cpp TYPE"
(its decode tok/s against llama.cpp's).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from minillm.bench.engine import mixed_engine_row
from minillm.bench.peers import (IdsOnly, fresh_first_generate, leading_agreement, llamacpp_quantize, llamacpp_runner,
                                 measure, minillm_runner, prompt_ids, require_llama_cpp, single_request_rows,
                                 transformers_runner)
from minillm.model.moe import MoeCausalLM, MoeConfig, experts_grouped, experts_loop
from minillm.speed.moe import FastMoeCausalLM
from minillm.weights.moe_gguf_write import gguf_tensors_of, write_qwen3moe_gguf

SEED = 0
LAYERS = 2
QWEN3_30B_A3B_LAYERS = dict(  # Qwen/Qwen3-30B-A3B's config.json, but for LAYERS layers and the vocabulary
    vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=LAYERS, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, initializer_range=0.05)
TINY = dict(  # data/qwen3_moe-tiny's config, at std 0.3 (as the qwen3_5 section's tiny shape), experts 32 wide (int4's groups)
    vocab_size=192, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
    norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, initializer_range=0.3)
ROUTED = (1, 16)  # tokens through one layer's experts: a decode step alone, and a batch of 16
FAST = {"fast": None, "fast-int8": "int8", "fast-int4": "int4"}  # variant: FastMoeCausalLM's quantize
LLAMA_CPP_TYPES = {"F32": ("readable", "fast"), "Q8_0": ("fast-int8",), "Q4_1": ("fast-int4",)}  # beside minillm's


def build_pair(shape: dict, dtype: torch.dtype, hf_classes) -> tuple[MoeCausalLM, torch.nn.Module]:
    """(minillm's MoeCausalLM, transformers' Qwen3MoeForCausalLM) on one shared copy of seeded random weights.

    hf_classes: (Qwen3MoeConfig, Qwen3MoeForCausalLM), passed in: transformers is imported on use (cli)."""
    config_class, model_class = hf_classes
    torch.manual_seed(SEED)
    hf = model_class(config_class(**shape)).to(dtype).eval()
    with torch.device("meta"):  # no second copy: the parameters are assigned hf's tensors
        ours = MoeCausalLM(MoeConfig.from_dict(dict(shape, model_type="qwen3_moe"), source="moe shape"))
    state = {name: t for name, t in hf.state_dict().items() if name != "lm_head.weight"}  # tied: the embedding
    ours.load_state_dict(state, strict=True, assign=True)
    ours.reset_rope("cpu")  # inv_freq is not in the state_dict: computed again, off the meta device
    return ours.eval(), hf


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def variant_rows(variant: str, mine: dict, theirs: dict, tokens: int, row) -> None:
    """Time to first token and prefill at each prompt length, decode and greedy agreement: `mine` (a
    measure()) beside transformers' measure() of the same run."""
    for L in sorted(mine["ttft_s"]):
        row("moe", variant, "time to first token", "ms", mine["ttft_s"][L] * 1e3, theirs["ttft_s"][L] * 1e3, n=L)
        row("moe", variant, "prefill", "tok/s", L / mine["ttft_s"][L], L / theirs["ttft_s"][L], n=L)
    row("moe", variant, "decode", "tok/s", mine["decode_tok_s"], theirs["decode_tok_s"], n=tokens)
    row("moe", variant, "greedy agreement", "tokens", leading_agreement(mine["decode_ids"], theirs["decode_ids"]),
        len(theirs["decode_ids"]), n=tokens)


def fast_rows(ours: MoeCausalLM, prompts: dict, theirs: dict, decoded: dict, args, row) -> dict:
    """FAST's variants, one request at a time, beside transformers' measure() of the same run; returns the
    models, and puts each variant's decode tok/s in `decoded`."""
    built = {}
    for variant, quantize in FAST.items():
        built[variant] = model = FastMoeCausalLM(ours, quantize=quantize).eval()
        mine = measure(minillm_runner(model, IdsOnly()), prompts, args.tokens, args.repeats)
        variant_rows(variant, mine, theirs, args.tokens, row)
        decoded[variant] = mine["decode_tok_s"]
    return built


def llamacpp_rows(ours: MoeCausalLM, prompts: dict, theirs: dict, decoded: dict, args, row, skipped: dict) -> None:
    """--peers llama.cpp: the same weights as GGUF files, in llama.cpp's float32 and its own Q8_0 and Q4_1,
    one at a time (each file's model freed before the next is made)."""
    try:
        require_llama_cpp()  # before a file of several GB is written for it
    except ImportError as e:
        skipped["moe: llama.cpp"] = f"skipped: {e}"
        return
    threads, context = torch.get_num_threads(), max(prompts) + args.tokens + 8
    with tempfile.TemporaryDirectory(prefix="minillm-moe-gguf-") as folder:
        tied = ours.config.tie_word_embeddings  # llama.cpp ties by absence
        state = {n: t for n, t in ours.state_dict().items() if not (tied and n == "lm_head.weight")}
        f32 = write_qwen3moe_gguf(ours.config, gguf_tensors_of(state, ours.config.num_experts), Path(folder) / "F32.gguf")
        del state
        for qtype, beside in LLAMA_CPP_TYPES.items():
            path = f32 if qtype == "F32" else llamacpp_quantize(f32, Path(folder) / f"{qtype}.gguf", qtype, threads)
            run = llamacpp_runner(path, threads, context)
            peer = measure(run, prompts, args.tokens, args.repeats)
            del run  # llama.cpp's model and context, before the next file's
            variant_rows(f"llama.cpp {qtype}", peer, theirs, args.tokens, row)
            for variant in beside:
                row("moe", variant, f"decode vs llama.cpp {qtype}", "tok/s", decoded[variant], peer["decode_tok_s"],
                    n=args.tokens)


@torch.no_grad()
def expert_rows(ours: MoeCausalLM, hf, int4_experts, args, row) -> None:
    """Layer 0's experts alone: minillm's grouped form and loop against transformers' grouped_mm and eager,
    and int4_experts (that layer's QuantizedExperts) against grouped_mm."""
    block, theirs = ours.model.layers[0].mlp, hf.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(SEED)
    for n in ROUTED:
        x = torch.randn(n, ours.config.hidden_size, generator=generator).to(block.gate.weight.dtype)
        weights, experts = block.gate(x)
        for variant, ours_form, hf_implementation in (("grouped", experts_grouped, "grouped_mm"),
                                                      ("loop", experts_loop, "eager")):
            mine = best_ms(lambda: ours_form(x, block.experts.gate_up_proj, block.experts.down_proj, weights, experts),
                           args.repeats)
            saved, hf.config._experts_implementation = hf.config._experts_implementation, hf_implementation
            try:
                hf_ms = best_ms(lambda: theirs(x, experts, weights), args.repeats)
            finally:
                hf.config._experts_implementation = saved
            row("moe", variant, "experts, one layer", "ms", mine, hf_ms, n=n)
            if variant == "grouped":  # the int4 experts against the same grouped_mm time
                row("moe", "int4", "experts, one layer", "ms", best_ms(lambda: int4_experts(x, weights, experts),
                                                                       args.repeats), hf_ms, n=n)


def moe_rows(args, row, hf_classes, skipped: dict) -> str:
    """Rows of the moe section (the module docstring); returns the model's name, in words."""
    if args.model:
        raise SystemExit("error: moe builds its own model (random weights of a Qwen3-MoE shape): --model does not apply")
    shape, name = (TINY, "tiny Qwen3-MoE shape") if args.quick else \
        (QWEN3_30B_A3B_LAYERS, f"Qwen3-30B-A3B's layers ({LAYERS} of 48), vocabulary 32,000")
    lengths, tokens, context = sorted(args.prompt_lengths), args.tokens, shape["max_position_embeddings"]
    if lengths[-1] >= context or lengths[0] + tokens > context:
        raise SystemExit(f"error: --prompt-lengths {' '.join(map(str, lengths))} with --tokens {tokens} exceed the "
                         f"model's context of {context} tokens")
    dtype = getattr(torch, args.dtype)
    ours, hf = build_pair(shape, dtype, hf_classes)
    prompts = {L: prompt_ids(L, ours.config.vocab_size) for L in lengths}
    sides = {"transformers": transformers_runner(hf, eos_token_id=None), "minillm": minillm_runner(ours, IdsOnly())}
    first = {side: fresh_first_generate(side, build_pair, (shape, dtype, hf_classes), prompts[lengths[0]], tokens)
             for side in sides}
    theirs, readable = single_request_rows("moe", sides, first, prompts, tokens, args.repeats, row)
    mixed_engine_row("moe", ours, hf, args, row, IdsOnly())
    decoded = {"readable": readable["decode_tok_s"]}  # variant: decode tok/s, for the llama.cpp rows
    fast = fast_rows(ours, prompts, theirs, decoded, args, row)
    expert_rows(ours, hf, fast["fast-int4"].layers[0].mlp.experts, args, row)
    if "llama.cpp" in args.peers:
        llamacpp_rows(ours, prompts, theirs, decoded, args, row, skipped)
    return f"{name}, random weights (seed {SEED}, std {hf.config.initializer_range})"
