"""Exercise checks of notebook 11 (plumbing): the bytes a decode step reads, and where a GPU's step crosses its ridge.

`decode_bytes(config, nbytes, context)` is checked on four real configurations (SmolLM2-135M and
Qwen2.5-0.5B, tied heads and grouped-query attention; Qwen3-0.6B, whose heads are wider than the
hidden size; Qwen2.5-7B, untied) at several sizes of a number and context lengths, against the
rule written here rather than a copy of the notebook's cell: the weights of every matrix one token
is multiplied by (q, k, v, o, gate, up, down in every layer, and the head, read whole whether or
not it is tied to the embedding table, of which the lookup reads one row) and a key and a value of
head_dim numbers per KV head, per layer, per token of context. The weights may be off by 0.1%, so
that counting the norms' and biases' few numbers too is not a mistake; the cache is exact. A known
mistake is named by the answers it gives on every case, computed here.

The exploration asks from which batch SmolLM2's bf16 decode step, all its matrices together,
would cross an H200's ridge (the data-sheet roofs notebook 11 assumes).
"""

from __future__ import annotations

import math
from functools import cache

from minillm.check.explore import CONFIGS
from minillm.check.harness import as_number, as_pair, close_to, fail, run_check, run_explore
from minillm.model.decoder import ModelConfig

NAMES = ("SmolLM2-135M-Instruct", "Qwen2.5-0.5B-Instruct", "Qwen3-0.6B", "Qwen2.5-7B-Instruct")
CASES = [(name, nbytes, context) for name in NAMES for nbytes, context in ((2, 1024), (4, 0), (1, 37))]


@cache
def configs() -> dict[str, ModelConfig]:
    return {name: ModelConfig.from_json(CONFIGS / f"{name}.json") for name in NAMES}


def weight_bytes(c: ModelConfig, nbytes: float, *, head: str = "once", kv_heads: str = "num_key_value_heads",
                 q_width: str = "heads", mlp: int = 3, per: str = "bytes") -> float:
    """The weights one decode token reads; the keywords plant the known slips."""
    h, D, L = c.hidden_size, c.head_dim, c.num_hidden_layers
    H, Hkv = c.num_attention_heads, getattr(c, kv_heads)
    HD = H * D if q_width == "heads" else h
    layer = HD * h + 2 * Hkv * D * h + h * HD + mlp * c.intermediate_size * h  # q; k and v; o; the MLP
    table = c.vocab_size * h
    heads = {"once": table, "none": 0, "untied only": 0 if c.tie_word_embeddings else table, "twice": 2 * table,
             "every parameter": table if c.tie_word_embeddings else 2 * table}[head]
    params = L * layer + heads
    return params * {"bytes": nbytes, "bits": 8 * nbytes, "numbers": 1}[per]


def kv_bytes(c: ModelConfig, nbytes: float, context: int, *, values: int = 2, heads: str = "kv",
             layers: bool = True, per_number: bool = True) -> float:
    """The KV cache one decode step reads at `context` tokens; the keywords plant the known slips."""
    width = {"kv": c.num_key_value_heads * c.head_dim, "query": c.num_attention_heads * c.head_dim,
             "hidden": c.hidden_size}[heads]
    return values * (c.num_hidden_layers if layers else 1) * width * context * (nbytes if per_number else 1)


WEIGHT_MISTAKES = {  # hint -> the keywords of weight_bytes that plant it
    "the head: every token is scored against the whole (vocab_size, hidden_size) matrix, so a decode step reads "
    "all of it, tied to the embedding table or not": dict(head="none"),
    "a tied head IS the embedding table, and scoring still reads all of it: count the (vocab_size, hidden_size) "
    "matrix once whether or not it is tied": dict(head="untied only"),
    "the embedding lookup reads one row per token, not the table: count the (vocab_size, hidden_size) matrix once, "
    "for the head": dict(head="twice"),
    "an untied model's embedding table is not read whole either (the lookup reads one row); counting every "
    "parameter counts it: count the matrices a token is multiplied by, and the head": dict(head="every parameter"),
    "nbytes is already the bytes of one number: do not multiply by 8": dict(per="bits"),
    "bytes, not parameters: multiply the count by nbytes": dict(per="numbers"),
    "k and v have num_key_value_heads heads (grouped-query attention): each is (Hkv * head_dim, hidden_size)":
        dict(kv_heads="num_attention_heads"),
    "q and o are num_attention_heads * head_dim wide, which is not hidden_size in every model (Qwen3-0.6B: "
    "16 x 128 = 2048 against 1024)": dict(q_width="hidden"),
    "the MLP has three matrices: gate, up and down": dict(mlp=2),
}

KV_MISTAKES = {
    "the cache holds a key AND a value per KV head, per layer, per token": dict(values=1),
    "only the num_key_value_heads heads are cached (grouped-query attention), not one per query head":
        dict(heads="query"),
    "the cache is Hkv * head_dim numbers wide per layer for the keys (and as many for the values), not "
    "hidden_size": dict(heads="hidden"),
    "every one of the num_hidden_layers layers has its own cache": dict(layers=False),
    "bytes, not numbers: multiply by nbytes": dict(per_number=False),
    "a decode step reads the cached keys and values of every token of context: they grow with `context`":
        dict(values=0),
}


def _answer(fn, case) -> tuple[float, float]:
    name, nbytes, context = case
    got = as_pair(f"decode_bytes({name}, nbytes={nbytes}, context={context})", fn(configs()[name], nbytes, context))
    return tuple(as_number(f"decode_bytes({name}, nbytes={nbytes}, context={context})", x) for x in got)


def _table(part, **keywords) -> dict:
    return {case: part(configs()[case[0]], case[1], case[2], **keywords) for case in CASES}


def _matches(got: dict, want: dict, rel: float) -> bool:
    return all(math.isclose(got[k], want[k], rel_tol=rel, abs_tol=0.5) for k in want)


def _first_wrong(got: dict, want: dict, rel: float, what: str) -> str:
    case = next(k for k in want if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=0.5))
    name, nbytes, context = case
    return (f"decode_bytes({name}, nbytes={nbytes}, context={context}): {what} {got[case]:,.0f} bytes, "
            f"expected {want[case]:,.0f}")


def decode_bytes(fn) -> bool:
    """decode_bytes(config, nbytes, context) -> (weight bytes, KV-cache bytes) one decode step reads at batch 1."""
    def body():
        answers = {case: _answer(fn, case) for case in CASES}
        for index, what, reference, mistakes, rel, hint in [
            (0, "weights", lambda c, b, t, **kw: weight_bytes(c, b, **kw), WEIGHT_MISTAKES, 1e-3,
             "per layer q (H*D, h), k and v (Hkv*D, h) each, o (h, H*D), gate and up (I, h), down (h, I); "
             "then the head (V, h) once; all times nbytes"),
            (1, "KV cache", kv_bytes, KV_MISTAKES, 0.0,
             "2 (a key and a value) x layers x Hkv x head_dim x context x nbytes"),
        ]:
            got, want = {k: v[index] for k, v in answers.items()}, _table(reference)
            if _matches(got, want, rel):
                continue
            message = _first_wrong(got, want, rel, what)
            for mistake_hint, keywords in mistakes.items():
                if _matches(got, _table(reference, **keywords), rel):
                    fail(message, mistake_hint)
            fail(message, hint)
    return run_check("decode_bytes", body)


# ------------------------------------------------------------------ the exploration: an H200's crossover batch

H200_BANDWIDTH, H200_BF16_FLOPS = 4.8e12, 989e12  # the data sheet's figures that notebook 11's GPUS assumes
A100_BANDWIDTH, A100_BF16_FLOPS = 2.0e12, 312e12


def crossover_batch(config: str = "SmolLM2-135M-Instruct", nbytes: int = 2, peak: float = H200_BF16_FLOPS,
                    bandwidth: float = H200_BANDWIDTH, activations: bool = True, shapes: str = "step") -> int | None:
    """The smallest batch B whose decode step (every matrix: 2 B N K flops over b (N K + B (N + K)) bytes)
    has an intensity above the ridge peak / bandwidth; None if none up to 100,000. The keywords plant
    the known slips (fp32, another GPU, no activation bytes, gate_proj alone)."""
    c = ModelConfig.from_json(CONFIGS / f"{config}.json")
    if shapes == "step":
        h, i, D, H, Hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        layer = [(H * D, h), (Hkv * D, h), (Hkv * D, h), (h, H * D), (i, h), (i, h), (h, i)]
        matrices = layer * c.num_hidden_layers + [(c.vocab_size, h)]
    else:
        matrices = [(c.intermediate_size, c.hidden_size)]
    nk, n_plus_k = sum(n * k for n, k in matrices), sum(n + k for n, k in matrices)
    ridge = peak / bandwidth
    for B in range(1, 100_001):
        if 2 * B * nk / (nbytes * (nk + (B * n_plus_k if activations else 0))) > ridge:
            return B
    return None


def explore_h200_crossover_batch(value) -> bool:
    """The smallest batch from which SmolLM2's bf16 decode step crosses an H200's ridge; within 1 sequence."""
    def body():
        want = crossover_batch()
        close_to("h200_crossover_batch", value, want, abs_=1.0, mistakes=[
            ("count the activations' bytes too: at batch B each matrix also reads B inputs and writes B outputs, "
             "the B (N + K) of the denominator, and at a large batch they are no longer small",
             crossover_batch(activations=False)),
            ("that is gate_proj alone: the question asks about the whole step, all the matrices of the 30 layers "
             "and the head, summed as in the cell above", crossover_batch(shapes="gate")),
            ("that is the A100's ridge: take the H200's roofs from GPUS", crossover_batch(
                peak=A100_BF16_FLOPS, bandwidth=A100_BANDWIDTH))],
            hint="the step's intensity as in the cell above, with bf16 (2 bytes a number), against the ridge "
                 "GPUS['H200']['bf16_flops'] / GPUS['H200']['bandwidth']; the first batch above it")
    return run_explore("h200_crossover_batch", body)


EXPLORE = {"h200_crossover_batch": explore_h200_crossover_batch}
