"""The benchmark's qwen3_5 section (plumbing): a Qwen3.5-shaped hybrid model, minillm beside transformers.

No Qwen3.5 weights are stored offline, and speed does not depend on their values, so both sides run
random weights of a real shape: by default Qwen3.5-0.8B's text model (QWEN3_5_0_8B), with --quick
the sizes of the tiny checkpoint data/qwen3_5-tiny (TINY). transformers builds
`Qwen3_5ForCausalLM(Qwen3_5TextConfig(...))` under torch.manual_seed(SEED) with its own init (std
`initializer_range`), in --dtype; minillm's `HybridCausalLM` then takes that model's state_dict
with assign=True (the same names; the tied head is the embedding), so the two share one copy of
the weights in memory: identical values, and the memory of one model, not two.

Both sides get the same seeded random prompt ids, greedy decoding with no end-of-sequence, the
same threads. minillm runs `generate(..., cache_factory=make_hybrid_cache)` with IdsOnly for a
tokenizer (no text: random weights say nothing); transformers its public `generate` with its own
cache (DynamicCache) and, on CPU, its reference PyTorch code for the DeltaNet layers (it warns so:
flash-linear-attention and causal-conv1d, its fast kernels, are GPU kernels). TINY's std is 0.3:
at transformers' default 0.02 a model 64 wide only repeats its prompt's last token, and agreeing on
that proves nothing (0.02 suits the 0.8B shape). Rows (section "qwen3_5"; variant "readable":
minillm's HybridCausalLM, the only minillm model that takes a hybrid yet):

- first generate (s, n = --tokens): each side's first generate call in a fresh process, on the
  decode prompt (the shortest of --prompt-lengths): a spawned Python process builds the same pair
  from the same seed, then times that one call, so nothing in it was warmed by the other side or
  by an earlier call (process start, imports and the random init are not in the time: a user's
  first request meets a loaded model); generate (s): the same call in this process, the best of
  --repeats after a warm-up.
- time to first token (ms) and prefill (tok/s) at each of --prompt-lengths (default 1024 4096):
  the best of --repeats calls of 1 new token; prefill tok/s = prompt tokens / that time.
- decode (tok/s): (tokens - 1) / (t(tokens) - t(1 token)) on the decode prompt, as peers.measure;
  greedy agreement: leading tokens equal to transformers'; distinct tokens: how many different ids
  each side generated (a random model that repeats one token agrees trivially: this says if not).
- cache after prefill (MiB, n = the decode prompt): the bytes of every tensor in each side's cache
  after a prefill of n tokens (minillm: make_hybrid_cache for n tokens; transformers: the
  DynamicCache its forward returns, whose conv states keep K columns where minillm keeps K - 1).
- engine (tok/s, n = the smallest --requests): useful tokens per second of mixed requests through
  HybridEngine (appendix A6), against transformers' generate on them as one left-padded batch, as
  the engine section measures notebook 17's engine (minillm/bench/engine.py).
- shared system prompt (s, n = CHATS): CHATS chats, one after another, each a SYSTEM_TOKENS-token
  system prompt (the same for all) and USER_TOKENS tokens of its own, REPLY_TOKENS new tokens each:
  HybridEngine with prefix caching ("prefix cache") and without ("no prefix cache"),
  against transformers' generate on each chat (it has no prefix cache); prompt blocks reused (%):
  the block manager's hits / queries in the run with prefix caching (a hit needs a saved state).
- cache memory (MiB, n = 4096 and 32768, formulas at the run's dtype): minillm's hybrid cache
  (cache.hybrid.hybrid_cache_bytes) and a KV cache for the same shape with attention in every layer
  (cache.dense.kv_cache_bytes), "vs all-attention KV cache" (x) their quotient; state memory: the
  DeltaNet layers' fixed state (linear_state_bytes), the same at any context.
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from minillm.bench.engine import mixed_engine_row, pool_blocks
from minillm.bench.peers import (IdsOnly, fresh_first_generate, minillm_runner, prompt_ids, single_request_rows,
                                 transformers_runner)
from minillm.cache.dense import kv_cache_bytes
from minillm.cache.hybrid import hybrid_cache_bytes, linear_state_bytes, make_hybrid_cache
from minillm.model.decoder import ModelConfig
from minillm.model.qwen3_5 import HybridCausalLM, HybridConfig
from minillm.runtime.hybrid_engine import HybridEngine

SEED = 0
ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
QWEN3_5_0_8B = dict(  # Qwen/Qwen3.5-0.8B's text_config
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=ROPE)
TINY = dict(  # data/qwen3_5-tiny's text_config, at std 0.3 (the module docstring)
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=ROPE, initializer_range=0.3)
MEMORY_CONTEXTS = (4096, 32768)
CHATS, SYSTEM_TOKENS, USER_TOKENS, REPLY_TOKENS = 8, 512, 32, 16  # the shared-system-prompt rows


def build_pair(shape: dict, dtype: torch.dtype, hf_classes) -> tuple[HybridCausalLM, torch.nn.Module]:
    """(minillm's HybridCausalLM, transformers' Qwen3_5ForCausalLM) on one shared copy of seeded random weights.

    hf_classes: (Qwen3_5TextConfig, Qwen3_5ForCausalLM), passed in: transformers is imported on use (cli)."""
    config_class, model_class = hf_classes
    torch.manual_seed(SEED)
    hf = model_class(config_class(**shape)).to(dtype).eval()
    with torch.device("meta"):  # no second copy: the parameters are assigned hf's tensors
        ours = HybridCausalLM(HybridConfig.from_dict(dict(shape, model_type="qwen3_5_text")))
    state = {name: t for name, t in hf.state_dict().items() if name != "lm_head.weight"}  # tied: the embedding
    ours.load_state_dict(state, strict=True, assign=True)
    ours.reset_rope("cpu")  # inv_freq is not in the state_dict: computed again, off the meta device
    return ours.eval(), hf


def hybrid_runner(model: HybridCausalLM):
    """The shared minillm runner, decoding with the hybrid cache and no text."""
    return minillm_runner(model, IdsOnly(), cache_factory=make_hybrid_cache)


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor reachable from obj (lists, tuples, dicts, objects' attributes), each storage once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        key = ("storage", obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


@torch.no_grad()
def caches_after_prefill(ours: HybridCausalLM, hf, prompt: list[int]) -> tuple[int, int]:
    """Bytes of (minillm's, transformers') cache holding the prompt, each filled by its own model's prefill."""
    ids = torch.tensor([prompt])
    dtype = next(ours.parameters()).dtype
    cache = make_hybrid_cache(ours.config, 1, len(prompt), dtype=dtype)
    ours(ids, cache=cache, logits_to_keep=1)
    theirs = hf(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
    return tensor_bytes(cache), tensor_bytes(theirs)


def all_attention(config: HybridConfig) -> ModelConfig:
    """The same sizes with attention in every layer: what the hybrid's cache is compared with."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**(fields | {"model_type": "qwen3"}))


def shared_prompt_chats(vocab: int, quick: bool) -> list[list[int]]:
    """CHATS prompts: one system prompt, then each chat's own tokens (fewer of both with --quick)."""
    rng = random.Random(SEED)
    system = [rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS // (8 if quick else 1))]
    return [system + [rng.randrange(3, vocab) for _ in range(USER_TOKENS)] for _ in range(CHATS)]


def engine_chats(model: HybridCausalLM, chats: list[list[int]], prefix_caching: bool) -> tuple[float, float]:
    """(seconds, fraction of prompt blocks reused) for HybridEngine answering the chats one after another."""
    engine = HybridEngine(model, IdsOnly(), num_blocks=pool_blocks(len(c) + REPLY_TOKENS for c in chats) + 8,
                          enable_prefix_caching=prefix_caching)
    t0 = time.perf_counter()
    for chat in chats:
        engine.generate([chat], max_new_tokens=REPLY_TOKENS, eos_token_ids=())
    return time.perf_counter() - t0, engine.manager.hits / max(engine.manager.queries, 1)


def engine_rows(ours: HybridCausalLM, hf, args, row) -> None:
    """The engine rows (the module docstring): mixed requests, then chats sharing a system prompt."""
    mixed_engine_row("qwen3_5", ours, hf, args, row, IdsOnly(), engine_class=HybridEngine)
    chats, hf_run = shared_prompt_chats(ours.config.vocab_size, args.quick), transformers_runner(hf, eos_token_id=None)
    hf_seconds = sum(hf_run(chat, REPLY_TOKENS)[0] for chat in chats)
    cached, reused = engine_chats(ours, chats, prefix_caching=True)
    plain, _ = engine_chats(ours, chats, prefix_caching=False)
    row("qwen3_5", "prefix cache", "shared system prompt", "s", cached, hf_seconds, n=CHATS)
    row("qwen3_5", "no prefix cache", "shared system prompt", "s", plain, hf_seconds, n=CHATS)
    row("qwen3_5", "prefix cache", "prompt blocks reused", "%", 100 * reused, n=CHATS)


def memory_rows(config: HybridConfig, dtype: torch.dtype, row) -> None:
    """The cache memory rows: formulas, at MEMORY_CONTEXTS tokens, batch 1."""
    mib, dense = 2**-20, all_attention(config)
    for n in MEMORY_CONTEXTS:
        hybrid, kv = hybrid_cache_bytes(config, n, 1, dtype), kv_cache_bytes(dense, n, 1, dtype)
        row("qwen3_5", "hybrid cache", "cache memory", "MiB", hybrid * mib, n=n)
        row("qwen3_5", "all-attention KV", "cache memory", "MiB", kv * mib, n=n)
        row("qwen3_5", "hybrid cache", "vs all-attention KV cache", "x", kv / hybrid, n=n)
    row("qwen3_5", "DeltaNet states", "state memory", "MiB", linear_state_bytes(config, 1, dtype) * mib)


def qwen3_5_rows(args, row, hf_classes) -> str:
    """Rows of the qwen3_5 section (the module docstring); returns the model's name, in words."""
    if args.model:
        raise SystemExit("error: qwen3_5 builds its own model (random weights of a Qwen3.5 shape): "
                         "--model does not apply")
    shape, name = (TINY, "tiny Qwen3.5 shape") if args.quick else (QWEN3_5_0_8B, "Qwen3.5-0.8B shape")
    lengths, tokens, context = sorted(args.prompt_lengths), args.tokens, shape["max_position_embeddings"]
    if lengths[-1] >= context or lengths[0] + tokens > context:
        raise SystemExit(f"error: --prompt-lengths {' '.join(map(str, lengths))} with --tokens {tokens} exceed the "
                         f"model's context of {context} tokens")
    dtype = getattr(torch, args.dtype)
    ours, hf = build_pair(shape, dtype, hf_classes)
    config = ours.config
    prompts = {L: prompt_ids(L, config.vocab_size) for L in lengths}
    sides = {"transformers": transformers_runner(hf, eos_token_id=None), "minillm": hybrid_runner(ours)}
    first = {side: fresh_first_generate(side, build_pair, (shape, dtype, hf_classes), prompts[lengths[0]], tokens,
                                        {"cache_factory": make_hybrid_cache}) for side in sides}
    single_request_rows("qwen3_5", sides, first, prompts, tokens, args.repeats, row)
    engine_rows(ours, hf, args, row)
    ours_bytes, hf_bytes = caches_after_prefill(ours, hf, prompts[lengths[0]])
    row("qwen3_5", "readable", "cache after prefill", "MiB", ours_bytes * 2**-20, hf_bytes * 2**-20, n=lengths[0])
    memory_rows(config, dtype, row)
    return f"{name}, random weights (seed {SEED}, std {hf.config.initializer_range})"
