"""Cached decoding equals the full recompute (and transformers' greedy tokens: tests/model/test_greedy.py)."""

import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY
from minillm.cache.dense import ConcatKVCache, KVCache, kv_cache_bytes, make_cache
from minillm.model.decoder import ModelConfig, from_folder
from support import SMOLLM2_REL, assert_logits_close


def decode(model, ids, n, cache, offset_bug=0):
    """Prefill then n-1 single-token steps; returns (tokens, logits per step (n, V))."""
    with torch.no_grad():
        logits = model(ids[None], cache=cache, start_pos=0)[0, -1]
        pos, steps, tokens = len(ids), [logits], [int(logits.argmax())]
        while len(tokens) < n:
            token = torch.tensor([[tokens[-1]]])
            logits = model(token, cache=cache, start_pos=pos + offset_bug)[0, -1]
            steps.append(logits)
            tokens.append(int(logits.argmax()))
            pos += 1
    return tokens, torch.stack(steps)


def recompute(model, ids, n):
    with torch.no_grad():
        steps, tokens = [], []
        for _ in range(n):
            logits = model(torch.cat([ids, torch.tensor(tokens, dtype=torch.long)])[None])[0, -1]
            steps.append(logits)
            tokens.append(int(logits.argmax()))
    return tokens, torch.stack(steps)


@pytest.mark.parametrize("name", TINY)
def test_cached_equals_recompute(name):
    model = from_folder(DATA / name)
    ref = load_file(DATA / name / "reference.safetensors")
    for i in range(3):
        ids = ref[f"input_ids_{i}"]
        want, want_logits = recompute(model, ids, 32)
        got, got_logits = decode(model, ids, 32, make_cache(model.config, 1, len(ids) + 32))
        assert got == want  # and == transformers' greedy tokens: tests/model/test_greedy.py
        assert_logits_close(got_logits, want_logits)


def test_concat_cache_equals_preallocated():
    model = from_folder(DATA / "tiny-qwen3")
    ids = load_file(DATA / "tiny-qwen3" / "reference.safetensors")["input_ids_2"]
    a, a_logits = decode(model, ids, 16, make_cache(model.config, 1, len(ids) + 16))
    b, b_logits = decode(model, ids, 16, [ConcatKVCache() for _ in model.model.layers])
    assert a == b
    assert_logits_close(a_logits, b_logits)


def test_planted_position_bug_is_caught():
    """Decoding at start_pos - 1 overwrites the last cached token: the tokens must diverge."""
    model = from_folder(DATA / "tiny-llama")
    ref = load_file(DATA / "tiny-llama" / "reference.safetensors")
    ids = ref["input_ids_2"]
    _, bad_logits = decode(model, ids, 8, make_cache(model.config, 1, len(ids) + 8), offset_bug=-1)
    _, good_logits = recompute(model, ids, 8)
    with pytest.raises(AssertionError):
        assert_logits_close(bad_logits, good_logits)


def test_padded_batch_through_the_cache_equals_one_at_a_time():
    model = from_folder(DATA / "tiny-qwen2-untied")
    ref = load_file(DATA / "tiny-qwen2-untied" / "reference.safetensors")
    prompts = [ref["input_ids_1"], ref["input_ids_2"][:20], ref["input_ids_0"]]
    T, n = max(len(p) for p in prompts), 6
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T + n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = p
        mask[b, T - len(p) :] = 1  # the n tokens to come are real too
    cache = make_cache(model.config, len(prompts), T + n)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask[:, :T], cache=cache)[:, -1]  # (B, V)
        batch_tokens = [[int(t)] for t in logits.argmax(-1)]
        for step in range(1, n):
            new = torch.tensor([[row[-1]] for row in batch_tokens])
            pos = T + step - 1
            logits = model(new, attention_mask=mask[:, : pos + 1], cache=cache, start_pos=pos)[:, -1]
            for row, t in zip(batch_tokens, logits.argmax(-1)):
                row.append(int(t))
    for b, p in enumerate(prompts):
        alone, _ = decode(model, p, n, make_cache(model.config, 1, len(p) + n))
        assert batch_tokens[b] == alone, b


def test_smollm2_cached_prefill_logits_equal_transformers(smollm2):
    model = smollm2[0]
    ref = load_file(DATA / "smollm2" / "reference.safetensors")
    ids = ref["prompt_ids_1"]
    tokens, logits = decode(model, ids, 1, make_cache(model.config, 1, len(ids) + 1))
    assert_logits_close(logits[0], ref["last_logits_1"], rel=SMOLLM2_REL)


def test_update_errors_name_the_numbers():
    cache = KVCache(2, 8, 2, 4)
    with pytest.raises(ValueError, match="writing 3 token.* at position 6 needs 9 slots, the cache holds 8"):
        cache.update(6, torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"must be \(B, Hkv, T, D\) = \(2, 2, T, 4\)"):
        cache.update(0, torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match="cannot write at position 3"):
        ConcatKVCache().update(3, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
    config = ModelConfig.from_json(DATA / "tiny-llama")
    with pytest.raises(ValueError, match="max_seq_len 300 exceeds .* 256"):
        make_cache(config, 1, 300)


def test_update_returns_views_of_everything_so_far():
    cache = KVCache(1, 8, 1, 2)
    k1 = torch.ones(1, 1, 3, 2)
    k_all, _ = cache.update(0, k1, k1)
    k_all2, _ = cache.update(3, 2 * torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert k_all2.shape == (1, 1, 4, 2) and k_all2.data_ptr() == cache.k.data_ptr()
    assert k_all2[0, 0, :, 0].tolist() == [1, 1, 1, 2]


def test_cache_bytes_from_config():
    c = ModelConfig.from_json(DATA / "configs" / "Qwen2.5-7B-Instruct.json")
    caches = make_cache(ModelConfig.from_json(DATA / "tiny-qwen3"), 2, 10)
    assert sum(x.k.nbytes + x.v.nbytes for x in caches) == kv_cache_bytes(
        ModelConfig.from_json(DATA / "tiny-qwen3"), 10, 2, torch.float32
    )
    assert kv_cache_bytes(c, 1) == 2 * 28 * 4 * 128 * 2
