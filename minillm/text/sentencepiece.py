# Generated from notebooks/07_tokenizer.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""SentencePiece vocabularies (GGUF `tokenizer.ggml.model` 'llama': Llama 1/2, Mistral, Phi-3).

Built in notebooks/07_tokenizer.ipynb. SentencePiece's BPE starts from characters, not bytes: a
space is written '▁' and the text gets one more in front; the adjacent pair whose join has the best
score in the vocabulary merges first (the leftmost on a tie); a character the vocabulary lacks
falls back to byte tokens '<0x..>'. `spm_encode` is that loop in Python, as llama.cpp runs it;
`sentencepiece_backend` runs it in `tokenizers` (Rust), with merges recovered from the scores.

References:
- Kudo, Richardson: SentencePiece, arXiv:1808.06226; google/sentencepiece (bpe_model.cc).
- llama.cpp, src/llama-vocab.cpp (llm_tokenizer_spm_session), and its vocab tests (data/llama-cpp-vocab/).
- transformers' GGUF tokenizer mapping (merges from scores; Phi-3's normalizer).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # '▁': how SentencePiece writes a space
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # the byte-fallback tokens: '<0x0A>' is a newline


def piece_bytes(piece: str) -> bytes:
    """The bytes one piece stands for: '▁Hello' -> b' Hello', '<0x0A>' -> b'\\n', '<s>' -> b'<s>'."""
    match = BYTE_PIECE.fullmatch(piece)
    return bytes([int(match.group(1), 16)]) if match else piece.replace(SPACE, " ").encode("utf-8")


def spm_encode(text: str, scores: dict[str, float], add_space_prefix: bool = True) -> list[str]:
    """SentencePiece BPE as llama.cpp runs it: spaces as '▁' (one more in front), then join the adjacent
    pair whose join scores best (the leftmost on a tie) until no join is a token; a character that is no
    token becomes its byte tokens '<0x..>'. Returns the pieces."""
    text = (" " + text if add_space_prefix and text else text).replace(" ", SPACE)
    parts = list(text)
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            score = scores.get(parts[i] + parts[i + 1])
            if score is not None and (best is None or score > best):
                best, at = score, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return [p for part in parts for p in ([part] if part in scores else [f"<0x{b:02X}>" for b in part.encode()])]


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merge list the scores imply, best first: each cut of a token into two tokens, ranked by the
    token's score (on a tie: the vocabulary's order, then the longer left part)."""
    ids = {token: i for i, token in enumerate(tokens)}
    found = [(-score, ids[token], -k, token[:k], token[k:]) for token, score in zip(tokens, scores)
             for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
    return [(left, right) for *_, left, right in sorted(found)]


def sentencepiece_backend(tokens: Sequence[str], scores: Sequence[float], add_space_prefix: bool = True,
                          unk_token: str | None = None) -> BackendTokenizer:
    """A `tokenizers.Tokenizer` that encodes as `spm_encode`: BPE over characters with the merges the scores
    imply and byte fallback; spaces as '▁' (one more in front if `add_space_prefix`), undone by decode."""
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges_from_scores(tokens, scores),
                       byte_fallback=True, unk_token=unk_token, fuse_unk=True)
    backend = BackendTokenizer(model)
    prefix = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def gguf_scores(meta: dict[str, Any], path: Path) -> list[float]:
    """`tokenizer.ggml.scores`: one finite number per token, or ValueError naming the file."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    numbers = all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)
    if len(scores) != len(tokens) or not numbers:
        raise ValueError(f"{path}: tokenizer.ggml.scores must be one finite number per token "
                         f"({len(tokens)} tokens, {len(scores)} scores)")
    return scores


def gguf_space_prefix(meta: dict[str, Any], path: Path) -> bool:
    """`tokenizer.ggml.add_space_prefix` (llama.cpp's default: True), or ValueError if it is not a bool."""
    value = meta.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(value, bool):
        raise ValueError(f"{path}: tokenizer.ggml.add_space_prefix must be a bool, got {value!r}")
    return value


def sentencepiece_text(backend: BackendTokenizer, ids: Sequence[int], skip: Collection[int] = (),
                       space_prefix: bool = True) -> str:
    """The text of token ids (those in `skip` left out): all their bytes through one UTF-8 decoding, an
    invalid sequence as U+FFFD (as StreamDecoder reads it), less the space the tokenizer put in front."""
    text = b"".join(piece_bytes(backend.id_to_token(i)) for i in ids if i not in skip).decode("utf-8", errors="replace")
    return text.removeprefix(" ") if space_prefix else text


def sentencepiece_flags(backend: BackendTokenizer) -> dict[str, bool]:
    """A tokenizer.json backend's flags for Tokenizer: SentencePiece if its decoder writes '▁' as a space
    (Replace, Metaspace); space_prefix if it drops a space in front (Strip from the start, Metaspace's prefix)."""
    spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    meta = [d for d in parts if d.get("type") == "Metaspace"]
    spm = bool(meta) or any(d.get("type") == "Replace" and d.get("pattern") == {"String": SPACE} for d in parts)
    strip = any(d.get("type") == "Strip" and d.get("start", 0) > 0 for d in parts) or any(
        d.get("prepend_scheme", "always" if d.get("add_prefix_space", True) else "never") != "never" for d in meta)
    return {"sentencepiece": spm, "space_prefix": spm and strip}


class FirstSpaceDropped:
    """An incremental decoder that drops the first character of its text if it is a space: the one a
    SentencePiece tokenizer put in front, which its decode drops."""

    def __init__(self, utf8: Any):
        self.utf8, self.started = utf8, False

    def decode(self, data: bytes, final: bool = False) -> str:
        text = self.utf8.decode(data, final)
        if text and not self.started:
            self.started, text = True, text.removeprefix(" ")
        return text
