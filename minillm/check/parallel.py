"""Exercise checks of notebook 21 (plumbing): which KV heads a tensor-parallel rank holds, and its exploration.

`Split.kv_heads` is checked on configurations with more KV heads than ranks, as many, and fewer,
against the rule that defines it rather than against a copy of the notebook's code: grouped-query
attention gives query head q the KV head q // (H / Hkv), and a rank holds exactly the KV heads its
own query heads read (a run of Hkv / N heads, or one head shared by N / Hkv ranks). A known mistake
is named by the slices it would give on every configuration, computed here. The exploration counts
one rank's KV-cache bytes per token for Qwen2.5-1.5B at TP 4 from its config.json.
"""

from __future__ import annotations

from types import SimpleNamespace

from minillm.check.explore import CONFIGS
from minillm.check.harness import close_to, fail, run_check, run_explore
from minillm.model.decoder import ModelConfig

# (query heads H, KV heads Hkv, ranks N): more KV heads than ranks, as many, fewer (replicated)
CASES = [(8, 4, 2), (8, 8, 4), (12, 4, 4), (28, 4, 4), (12, 2, 4), (16, 2, 8), (16, 4, 8), (8, 1, 4), (9, 3, 3)]


def _config(H: int, Hkv: int) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=H, num_key_value_heads=Hkv, intermediate_size=48, vocab_size=100,
                           hidden_size=32, head_dim=8)


def _read_by(H: int, Hkv: int, N: int, rank: int) -> tuple[int, int]:
    """(first, stop) of the KV heads that rank's query heads read: query head q reads q // (H / Hkv)."""
    queries = range(rank * H // N, (rank + 1) * H // N)
    read = {q // (H // Hkv) for q in queries}
    return min(read), max(read) + 1


def _run(n: int, rank: int) -> tuple[int, int]:
    return rank * n, (rank + 1) * n


MISTAKES = {  # hint -> what the mistake gives for (H, Hkv, N, rank)
    "neighbouring ranks share a KV head (query heads are split in runs, so with 4 ranks and 2 KV heads ranks "
    "0 and 1 both read head 0): not rank % Hkv":
        lambda H, Hkv, N, r: _run(Hkv // N, r) if Hkv >= N else (r % Hkv, r % Hkv + 1),
    "with fewer KV heads than ranks, Hkv // N is 0: each rank must still hold the one whole KV head its "
    "query heads read (it is replicated on N / Hkv ranks)":
        lambda H, Hkv, N, r: _run(Hkv // N, r),
    "a rank holds only the KV heads its own query heads read, not every KV head":
        lambda H, Hkv, N, r: _run(Hkv // N, r) if Hkv >= N else (0, Hkv),
    "split the KV heads, not the query heads: a run of Hkv / N KV heads per rank":
        lambda H, Hkv, N, r: _run(H // N, r) if Hkv >= N else _read_by(H, Hkv, N, r),
}


def _table(get) -> dict:
    return {(H, Hkv, N, r): get(H, Hkv, N, r) for H, Hkv, N in CASES for r in range(N)}


def split_kv_heads(cls) -> bool:
    """Split(config, rank, world).kv_heads: a slice of the KV heads that the rank's query heads read."""
    def body():
        def got(H, Hkv, N, r):
            heads = cls(_config(H, Hkv), r, N).kv_heads
            if not isinstance(heads, slice) or heads.step not in (None, 1):
                fail(f"H={H}, Hkv={Hkv}, TP {N}, rank {r}: kv_heads is {heads!r}, expected a slice(start, stop)",
                     "return slice(first, stop), like the `heads` property above it")
            return heads.start, heads.stop

        want, answer = _table(_read_by), _table(got)
        if answer == want:
            return
        for hint, mistake in MISTAKES.items():
            if answer == _table(mistake):
                wrong = next(k for k in want if answer[k] != want[k])
                fail(_message(wrong, answer, want), hint)
        fail(_message(next(k for k in want if answer[k] != want[k]), answer, want),
             "a rank holds the KV heads its query heads read: query head q reads KV head q // (H / Hkv); with "
             "Hkv >= N that is a run of Hkv / N heads, with fewer one head shared by N / Hkv ranks")
    return run_check("Split.kv_heads", body)


def _message(case, answer, want) -> str:
    H, Hkv, N, r = case
    return (f"H={H}, Hkv={Hkv}, TP {N}, rank {r}: kv_heads is slice{answer[case]}, expected slice{want[case]} "
            f"(the rank's query heads are {r * H // N} to {(r + 1) * H // N - 1})")


# ------------------------------------------------------------------ the exploration: a rank's KV cache


def kv_bytes_per_token_tp4(config: str = "Qwen2.5-1.5B-Instruct", world: int = 4, bytes_per_value: int = 2,
                           replicate: bool = True, values: bool = True) -> float:
    """Bytes of KV cache one rank holds per token: a key (and a value) per layer for each KV head it holds,
    whole heads (replicated when the KV heads are fewer than the ranks). The keywords plant the known slips."""
    c = ModelConfig.from_json(CONFIGS / f"{config}.json")
    heads = c.num_key_value_heads / world if c.num_key_value_heads >= world or not replicate else 1
    return (2 if values else 1) * c.num_hidden_layers * heads * c.head_dim * bytes_per_value


def explore_kv_bytes_per_token_tp4(value) -> bool:
    """Bytes of bfloat16 KV cache per token on one rank of Qwen2.5-1.5B at TP 4; exact."""
    def body():
        want = kv_bytes_per_token_tp4()
        close_to("kv_bytes_per_token_tp4", value, want, abs_=0.5, mistakes=[
            ("a rank holds whole KV heads (at TP 4 each of the 2 KV heads is held by two ranks), and it caches a "
             "key AND a value for each", kv_bytes_per_token_tp4(replicate=False)),
            ("a rank caches only the KV head its query heads read, one of the two, in bfloat16 (2 bytes a value)",
             kv_bytes_per_token_tp4(world=1)),
            ("bfloat16 is 2 bytes a value, not 4", kv_bytes_per_token_tp4(world=1, bytes_per_value=4)),
            ("the answer is in bytes, not KiB", want / 1024)],
            hint="per token, each layer caches a key and a value vector of head_dim numbers for every KV head the "
                 "rank holds; read the sizes from qwen1b, or from Split(qwen1b, 0, 4).local_config()")
    return run_explore("kv_bytes_per_token_tp4", body)


EXPLORE = {"kv_bytes_per_token_tp4": explore_kv_bytes_per_token_tp4}
