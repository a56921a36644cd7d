"""Exercise checks of notebooks 06, 07 and 10: GGUF's q/k rows, BPE and streaming text, the generation loop.

Each takes a student's function or class and returns True (PASS) or False (FAIL, with feedback);
see minillm/check/__init__.py for how they are called. The references are written here in a few lines
(BPE, the q/k permutation, the stop-string rule), or are the package's own loop run without the
cache (the generation loop), on a tiny random model and a one-byte-per-token tokenizer.
"""

from __future__ import annotations

import codecs
from functools import lru_cache

import torch

from minillm.check.harness import compare, fail, run_check
from minillm.runtime.generate import TextStream
from minillm.model.decoder import CausalLM, ModelConfig
from minillm.runtime.sampling import SamplingParams, make_generator, sample
from minillm.text.tokenizer import load_tiktoken_ranks, qwen_tiktoken_path


# ------------------------------------------------------------------ 06 weights: GGUF's q/k rows


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's permute: per head, rows (i, i + D/2) become neighbours (2i, 2i + 1)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(fn) -> bool:
    """unpermute_qk(w, n_heads): the inverse of llama.cpp's q/k row permutation, head by head."""
    def body():
        g = torch.Generator().manual_seed(0)
        cases = [("q_proj weight (3 heads of D = 16, 24 columns)", torch.randn(48, 24, generator=g), 3),
                 ("k_proj weight (2 kv heads of D = 8, 24 columns)", torch.randn(16, 24, generator=g), 2),
                 ("q_proj bias (3 heads of D = 16), 1-D", torch.randn(48, generator=g), 3),
                 ("q_proj weight in bfloat16 (4 heads of D = 8)", torch.randn(32, 8, generator=g).to(torch.bfloat16), 4)]
        for what, hf, n in cases:
            stored = _llama_cpp_permute(hf, n)  # what the GGUF file holds
            D = hf.shape[0] // n
            grid = stored.reshape(n, D // 2, 2, *hf.shape[1:]).transpose(1, 2)
            compare(f"unpermute_qk(GGUF {what}, {n})", fn(stored, n), hf, atol=0, mistakes=[
                ("that is llama.cpp's permutation itself, not its inverse: view each head's rows as (D/2, 2) "
                 "(pair j = positions 2j, 2j+1) and transpose to (2, D/2)", _llama_cpp_permute(stored, n)),
                ("per head: the pairs are within each head's D rows, so reshape to (n_heads, D/2, 2, ...) first",
                 _unpermute(stored, 1)),
                ("a reshape alone moves no row: transpose the (D/2, 2) grid of each head to (2, D/2)", stored),
                ("reshape the result back to w's shape", grid),
                ("reshape the result back to w's shape", grid.contiguous())])
    return run_check("unpermute_qk", body)


# ------------------------------------------------------------------ 07 tokenizer: BPE on real ranks


def _bpe(piece: bytes, ranks: dict, max_rank=None, *, pick="lowest", tie="left", inclusive=False,
         use_max=True) -> list[bytes]:
    """BPE, as a minimum over (rank, position) pairs; the keyword arguments make the known mistakes."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if use_max and max_rank is not None:
            pairs = [(r, i) for r, i in pairs if (r <= max_rank if inclusive else r < max_rank)]
        if not pairs:
            return parts
        if pick == "leftmost":
            rank, i = min(pairs, key=lambda p: p[1])
        else:
            rank = min(r for r, _ in pairs)
            at = [i for r, i in pairs if r == rank]
            i = at[0] if tie == "left" else at[-1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


_BPE_MISTAKES = [
    ("merge the pair of LOWEST rank anywhere in the piece, not the first mergeable pair from the left",
     dict(pick="leftmost")),
    ("when the lowest-ranked pair occurs twice, merge the leftmost one first (keep the first minimum: rank < best)",
     dict(tie="right")),
    ("with max_rank, merge only pairs ranked BELOW it: stop when the best rank is >= max_rank", dict(inclusive=True)),
    ("with max_rank, merge only pairs ranked below it (merges_from_ranks relies on it)", dict(use_max=False)),
]


@lru_cache(maxsize=1)
def _qwen_ranks() -> dict[bytes, int]:
    return load_tiktoken_ranks(qwen_tiktoken_path())


_TOY_RANKS = {b"bc": 0, b"ab": 1, b"aa": 2, b"abc": 3, b"cd": 4, b"abcd": 5, b"aaa": 6}
_TOY_CASES = [(b"abc", None), (b"aaa", None), (b"abcd", None), (b"abcd", 4), (b"abcd", 5), (b"aaaa", None),
              (b"a", None), (b"xyz", None), (b"", None)]
_QWEN_TEXTS = [" tokenization", "hello", " lowest", " naïve", "你好世界", " 🙂", "    ", "2024", " antidisestablishment",
               "\n\n", " Ελληνικά", "ＡＢＣ"]


def bpe(fn) -> bool:
    """bpe(piece, ranks, max_rank): merge the lowest-ranked adjacent pair until none is left, on toy and Qwen ranks."""
    def body():
        def run(what, piece, ranks, max_rank):
            expected = _bpe(piece, ranks, max_rank)
            got = fn(piece, ranks) if max_rank is None else fn(piece, ranks, max_rank)
            if not isinstance(got, list) or not all(isinstance(p, bytes) for p in got):
                kind = type(got).__name__ if not isinstance(got, list) else f"list of {sorted({type(p).__name__ for p in got})}"
                fail(f"{what}: returned a {kind}, expected a list of bytes {expected}",
                     "piece[i] is an int in Python: take 1-byte parts with piece[i:i + 1]"
                     if isinstance(got, list) and any(isinstance(p, int) for p in got) else None)
            if got == expected:
                return
            message = f"{what} = {got}, expected {expected}"
            if b"".join(got) != piece:
                fail(message, "the parts must join back to the piece: merging replaces two parts by their concatenation")
            for hint, kw in _BPE_MISTAKES:
                if got == _bpe(piece, ranks, max_rank, **kw):
                    fail(message, hint)
            left = [(ranks[a + b], a + b) for a, b in zip(got, got[1:])
                    if a + b in ranks and (max_rank is None or ranks[a + b] < max_rank)]
            if left:
                fail(message, f"{min(left)[1]!r} (rank {min(left)[0]}) could still be merged: repeat until no adjacent "
                     "pair is in ranks (a merged part can merge again)")
            fail(message)

        for piece, max_rank in _TOY_CASES:
            run(f"bpe({piece!r}, toy ranks {_TOY_RANKS}" + (f", max_rank={max_rank})" if max_rank is not None else ")"),
                piece, _TOY_RANKS, max_rank)
        ranks = _qwen_ranks()
        for text in _QWEN_TEXTS:
            run(f"bpe({text.encode()!r}, Qwen's ranks)", text.encode(), ranks, None)
        token = b" tokenization"
        for token in (b" tokenization", b" hello", "你好".encode()):
            if token in ranks:
                run(f"bpe({token!r}, Qwen's ranks, max_rank={ranks[token]}) (its own rank)", token, ranks, ranks[token])
    return run_check("bpe", body)


# ------------------------------------------------------------------ 07 tokenizer: streaming UTF-8


class _ByteTokenizer:
    """The part of a Tokenizer that StreamDecoder and stream use: each id stands for a few bytes."""

    def __init__(self, pieces: list[bytes], special: dict[int, str] | None = None, eos: tuple[int, ...] = ()):
        self.pieces, self.special = pieces, special or {}
        self.special_ids = frozenset(self.special)
        self.eos_token_ids = eos

    def token_bytes(self, token_id: int) -> bytes:
        return self.special[token_id].encode() if token_id in self.special else self.pieces[token_id]


# "Café 你好 🙂!" cut mid-character, then a special token, then an incomplete character at the end
_PIECES = [b"Caf", b"\xc3", b"\xa9 ", b"\xe4", b"\xbd\xa0\xe5", b"\xa5", b"\xbd \xf0\x9f", b"\x99", b"\x82!", b"",
           b" ok", b"\xe4\xbd"]
_SPECIAL = {len(_PIECES): "<|im_end|>"}
_END = len(_PIECES)
_STREAMS = [("split characters", list(range(9))),
            ("a special token mid-stream", [0, 1, 2, _END, 10, 3, 4, 5]),
            ("an empty token and a character left incomplete at the end", [0, 9, 10, 11])]


def _stream_ref(ids: list[int], tok: _ByteTokenizer, skip: bool, alone: bool = False, skip_always: bool = False):
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = []
    for i in ids:
        data = tok.token_bytes(i)
        if i in tok.special_ids and (skip or skip_always):
            out.append("")
        else:
            out.append(data.decode("utf-8", errors="replace") if alone else utf8.decode(data))
    return out, ("" if alone else utf8.decode(b"", final=True))


def stream_decoder_push(cls) -> bool:
    """StreamDecoder.push(id): the text this token completes, holding back an unfinished UTF-8 character."""
    def body():
        tok = _ByteTokenizer(_PIECES, _SPECIAL)
        for skip in (False, True):
            for what, ids in _STREAMS:
                decoder = cls(tok, skip_special_tokens=skip)
                got = [decoder.push(i) for i in ids]
                expected, tail = _stream_ref(ids, tok, skip)
                name = f"StreamDecoder(skip_special_tokens={skip}), {what}"
                if got != expected:
                    n = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
                    message = (f"{name}: push #{n} (token {ids[n]}, bytes {tok.token_bytes(ids[n])!r}) returned "
                               f"{got[n]!r}, expected {expected[n]!r} (all pushes: {got}, expected {expected})")
                    if got == _stream_ref(ids, tok, skip, alone=True)[0]:
                        fail(message, "a character's bytes can be split across tokens: feed each token's bytes to "
                             "self._utf8 (an incremental decoder), which keeps an unfinished character for the next push")
                    if got == _stream_ref(ids, tok, skip=False)[0]:
                        fail(message, "with skip_special_tokens, a special token (its id in tokenizer.special_ids) gives ''")
                    if got == _stream_ref(ids, tok, skip, skip_always=True)[0]:
                        fail(message, "skip special tokens only when skip_special_tokens is set; otherwise they are text")
                    fail(message)
                got_tail = decoder.flush()
                if got_tail != tail:
                    fail(f"{name}: after your pushes, flush() gave {got_tail!r}, expected {tail!r}",
                         "keep the unfinished bytes in self._utf8 (decode each token's bytes with it): flush() reads them there")
    return run_check("StreamDecoder.push", body)


# ------------------------------------------------------------------ 10 generate: stop strings


def _stop_ref(text: str, stop: list[str]) -> str:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[: min(hits)] if hits else text


_STOP_CASES = [
    (["Observation:"], ["The answer is 4.", " Obs", "erv", "ation: done"]),
    (["\n\n"], ["one\n", "\ntwo"]),
    (["world", "lo"], ["hel", "lo wor", "ld"]),
    (["END"], ["no stop ", "string ", "here at all, E", "N"]),
    (["abc"], list("xxabxabcx")),
    ([], ["nothing ", "held"]),
    (["stop"], ["", "x", "st", "", "op"]),
]


def stop_strings_push(cls) -> bool:
    """StopStrings.push(text) -> (safe text, found): hold back a possible start of a stop string, cut before the first."""
    def body():
        for stop, pieces in _STOP_CASES:
            holder = cls(stop)
            full = "".join(pieces)
            expected = _stop_ref(full, stop)
            stop_at = next((n for n in range(len(pieces)) if _stop_ref("".join(pieces[: n + 1]), stop) != "".join(pieces[: n + 1])), None)
            hold = max((len(s) for s in stop if s), default=1) - 1
            emitted = ""
            for n, piece in enumerate(pieces):
                result = holder.push(piece)
                if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str)):
                    fail(f"StopStrings({stop}).push({piece!r}) returned {result!r}, expected a tuple (text, found)")
                out, found = result
                emitted += out
                so_far = "".join(pieces[: n + 1])
                what = f"StopStrings({stop}), pushes {pieces[: n + 1]}"
                if n == stop_at and not found:
                    fail(f"{what}: found={found}, but {so_far!r} contains a stop string",
                         "a stop string can arrive split across pushes: search the held-back text plus the new text")
                if not expected.startswith(emitted):
                    if stop_at is not None and emitted.startswith(expected):
                        fail(f"{what}: emitted {emitted!r} in all, but the output ends before the stop string: {expected!r}",
                             "cut before the stop string: it is not part of the output" if found else
                             "hold back the last len(longest stop string) - 1 characters: they may be the start of a "
                             "stop string that the next piece completes")
                    hit = [s for s in stop if s in so_far]
                    fail(f"{what}: emitted {emitted!r} in all, expected a beginning of {expected!r}",
                         "cut at the EARLIEST occurrence of any stop string, not at the first one in the list"
                         if len(hit) > 1 else None)
                if found and n != stop_at:
                    fail(f"{what}: found={found}, but {so_far!r} has no stop string")
                if found:
                    if emitted != expected:
                        fail(f"{what}: emitted {emitted!r} in all, expected {expected!r} (the text before the stop string)",
                             "on a stop string, emit everything held back before it")
                    break
                if len(emitted) < len(so_far) - hold:
                    fail(f"{what}: emitted {emitted!r} in all; only the last {hold} characters may be held back "
                         f"(the longest stop string minus one), so at least {so_far[: len(so_far) - hold]!r}",
                         "hold back at most len(longest stop string) - 1 characters: holding more delays the stream")
            if stop_at is None:
                tail = holder.flush()
                if emitted + tail != expected:
                    fail(f"StopStrings({stop}): pushes and flush() gave {emitted + tail!r}, expected {expected!r}",
                         "keep what you hold back in self.pending: flush() returns it")
    return run_check("StopStrings.push", body)


# ------------------------------------------------------------------ 10 generate: the generation loop


_VOCAB = "abcdefghijklmnopqrstuvwxyz .,!?"


def tiny_lm() -> tuple[CausalLM, _ByteTokenizer]:
    cfg = ModelConfig(model_type="qwen2", vocab_size=len(_VOCAB), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True)
    model = CausalLM(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else torch.randn(p.shape, generator=g) * 0.5)
    return model.eval().requires_grad_(False), _ByteTokenizer([c.encode() for c in _VOCAB])


@torch.no_grad()
def _reference_run(model, tok, prompt, params, max_new, eos, penalties=True):
    """The loop without the cache: every step runs the model over the whole sequence."""
    text_stream = TextStream(tok, len(prompt), max_new, model.config.max_position_embeddings, eos, ())
    generator = make_generator(params.seed)
    seen, finish, tokens, texts, logprobs = list(prompt), None, [], [], []
    while finish is None:
        logits = model(torch.tensor([seen]))[:, -1]
        pick = sample(logits, params, generator, **(dict(token_ids=[seen], prompt_lengths=[len(prompt)]) if penalties else {}))
        token = int(pick.tokens[0])
        seen.append(token)
        text, finish = text_stream.push(token)
        tokens.append(token), texts.append(text), logprobs.append(float(pick.logprobs[0]))
    return tokens, "".join(texts), logprobs, finish


def _record_calls(model):
    calls = []

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        calls.append((tuple(ids.shape), kwargs.get("start_pos", args[4] if len(args) > 4 else 0),
                      (kwargs.get("cache", args[3] if len(args) > 3 else None)) is not None))
    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def stream(fn) -> bool:
    """stream(model, tokenizer, prompt_ids, ...): prefill once, then decode one token at a time with the cache."""
    def body():
        model, tok = tiny_lm()
        prompt = [7, 4, 11, 11, 14]
        greedy = SamplingParams(temperature=0)
        sampled = SamplingParams(temperature=0.9, top_k=12, repetition_penalty=1.5, seed=0)
        probe = _reference_run(model, tok, prompt, greedy, 8, ())[0]
        runs = [("greedy, max_new_tokens=8", greedy, 8, ()),
                (f"greedy, end-of-turn id {probe[3]} (the 4th token)", greedy, 8, (probe[3],)),
                ("temperature 0.9, top_k 12, repetition_penalty 1.5, seed 0, max_new_tokens=10", sampled, 10, ())]
        for what, params, max_new, eos in runs:
            tokens, text, logprobs, finish = _reference_run(model, tok, prompt, params, max_new, eos)
            calls, handle = _record_calls(model)
            try:
                steps = list(fn(model, tok, prompt, params=params, max_new_tokens=max_new, eos_token_ids=eos))
            finally:
                handle.remove()
            name = f"stream({what})"
            T = len(prompt)
            want_calls = [((1, T), 0, True)] + [((1, 1), T + i, True) for i in range(len(tokens) - 1)]
            got_tokens = [getattr(s, "token_id", None) for s in steps]
            if got_tokens != tokens:
                if got_tokens[:-1] == tokens:
                    fail(f"{name}: tokens {got_tokens}, expected {tokens}",
                         "yield every step but the last inside the loop: the lines after the loop yield the last one")
                if got_tokens == tokens[:-1] or got_tokens[:-1] == tokens[:-1]:
                    fail(f"{name}: tokens {got_tokens}, expected {tokens}",
                         "yield a Step for every token that leaves finish None, then let the given lines yield the last")
                message = f"{name}: tokens {got_tokens}, expected {tokens}"
                if not calls or calls[0][0] != (1, T) or calls[0][1] != 0:
                    fail(message, f"prefill: run the whole prompt, shape (1, {T}), once at start_pos=0 with the cache")
                if _penalties_ignored(model, tok, prompt, params, max_new, eos, tokens, got_tokens):
                    fail(message, "pass token_ids=[seen] and prompt_lengths=[len(prompt_ids)] to sample: "
                         "the repetition penalty looks at the tokens so far")
                for n, (call, want) in enumerate(zip(calls[1:], want_calls[1:])):
                    if not call[2]:
                        fail(message, "decode with cache=cache: the new token attends to the cached keys and values")
                    if call[0] == (1, 1) and call[1] != want[1]:
                        fail(message, f"decode step {n + 1} ran at start_pos={call[1]}, expected {want[1]}: the token "
                             "just sampled sits at position len(seen) - 1 (0-based), after the prompt and the earlier tokens")
                fail(message, "sample from the last position's logits ([:, -1]) of each forward")
            if calls != want_calls:
                message = f"{name}: the right tokens, but the model was called as (input shape, start_pos, cache given) " \
                          f"{calls}, expected {want_calls}"
                if len(calls) == len(want_calls) + 1 and calls[:-1] == want_calls:
                    fail(message, "don't run the model after the last token: decode only while finish is None")
                if any(c[0][1] > 1 for c in calls[1:]):
                    fail(message, "decode one token at a time: the cache holds the earlier ones "
                         "(feed pick.tokens.view(1, 1) at start_pos=len(seen) - 1)")
                if any(not c[2] for c in calls):
                    fail(message, "pass cache=cache to every forward")
                fail(message)
            got_text = "".join(getattr(s, "text", "") for s in steps)
            if got_text != text:
                fail(f"{name}: text {got_text!r}, expected {text!r}", "each Step's text is what text_stream.push(token) returned")
            compare(f"{name}: logprobs", torch.tensor([float(s.logprob) for s in steps]), torch.tensor(logprobs),
                    atol=1e-4, hint="each Step's logprob is pick.logprobs[0]")
            reasons = [s.finish_reason for s in steps]
            if reasons != [None] * (len(steps) - 1) + [finish]:
                fail(f"{name}: finish reasons {reasons}, expected None for each step and {finish!r} for the last")
            metrics = steps[-1].metrics
            if metrics is None or (metrics.prompt_tokens, metrics.generated_tokens) != (T, len(tokens)):
                got = None if metrics is None else (metrics.prompt_tokens, metrics.generated_tokens)
                fail(f"{name}: the last step's metrics count (prompt, generated) = {got}, expected {(T, len(tokens))}",
                     "keep `seen` as the prompt followed by every generated token")
    return run_check("stream", body)


def _penalties_ignored(model, tok, prompt, params, max_new, eos, tokens, got_tokens) -> bool:
    """Whether got_tokens are what sampling without the repetition penalty's history gives."""
    if params.repetition_penalty == 1.0:
        return False
    return got_tokens == _reference_run(model, tok, prompt, params, max_new, eos, penalties=False)[0]
