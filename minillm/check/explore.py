"""Checks of the exploration tasks (plumbing): a question answered by a measurement and a sentence.

An exploration task sits in a reference notebook as a question (markdown), a code cell that
computes the answer into a named variable (a top-level solution region, stubbed in the exercise:
see tools/make_exercises.py), a hint, a check cell `check.explore_<name>(<name>)` and a markdown
cell for the student's explanation. Each check here computes the reference number itself, with the
package, and compares within a stated tolerance: only counts, bytes, sizes and ratios of them,
never times, so the answer is the same on every machine. It prints PASS or FAIL (naming a known
mistake, never the reference number), then reminds the student that the sentence is the other half
of the answer: a teacher reads it.
"""

from __future__ import annotations

import math
from functools import lru_cache, cache
from pathlib import Path

import torch

from minillm.api import load
from minillm.check.harness import as_pair, close_to, run_explore
from minillm.weights.embedded import embedded_gguf_path
from minillm.cache.dense import kv_cache_bytes
from minillm.model.decoder import CausalLM, ModelConfig
from minillm.speed.quant import Int4Linear
from minillm.text.tokenizer import Tokenizer, load_tiktoken_ranks, qwen_tiktoken_path

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


# ------------------------------------------------------------------ 01 tensors: views and copies


def transpose_copy_bytes():
    """Bytes that (.transpose(1, 2), then .contiguous()) copy for SmolLM2's queries of a 1024-token prompt.

    q is (B, T, H, D) = (1, 1024, 9, 64) float32; the transpose is a view (0 bytes), contiguous() copies all.
    """
    q = torch.zeros(1, 1024, 9, 64)
    t = q.transpose(1, 2)
    c = t.contiguous()
    def copied(new, old):
        return 0 if new.untyped_storage().data_ptr() == old.untyped_storage().data_ptr() else new.untyped_storage().nbytes()
    return copied(t, q), copied(c, t)


def explore_transpose_copy_bytes(value) -> bool:
    """(bytes .transpose(1, 2) copies, bytes .contiguous() after it copies) for q (1, 1024, 9, 64) float32; exact."""
    def body():
        view, copy = as_pair("transpose_copy_bytes", value)
        want_view, want_copy = transpose_copy_bytes()
        close_to("bytes copied by .transpose(1, 2)", view, want_view, mistakes=[
            ("a transpose is a view: compare the data_ptr() of the two tensors' untyped_storage()", want_copy)],
            hint="a view shares its storage: it copies nothing")
        close_to("bytes copied by .contiguous() after it", copy, want_copy, mistakes=[
            ("count bytes, not elements: numel() x element_size()", want_copy / 4),
            ("the transposed view is not contiguous, so contiguous() copies every element", 0)],
            hint="the copy's own storage: untyped_storage().nbytes()")
    return run_explore("transpose_copy_bytes", body)


# ------------------------------------------------------------------ 02 attention: what GQA saves


def gqa_saved_bytes_per_token() -> int:
    """Bytes of bf16 KV cache per token that SmolLM2's 3 kv heads save against 9 (full multi-head)."""
    c = ModelConfig.from_json(CONFIGS / "SmolLM2-135M-Instruct.json")
    per_head = 2 * c.num_hidden_layers * c.head_dim * 2  # k and v, every layer, bf16
    return per_head * (c.num_attention_heads - c.num_key_value_heads)


def explore_gqa_saved_bytes_per_token(value) -> bool:
    """Bytes of bf16 KV cache per token SmolLM2 saves with GQA against full multi-head; exact."""
    def body():
        want = gqa_saved_bytes_per_token()
        close_to("gqa_saved_bytes_per_token", value, want, mistakes=[
            ("the cache holds a key AND a value per head", want / 2),
            ("bf16 is 2 bytes per number, not 4", want * 2),
            ("every one of the 30 layers has its own cache", want / 30),
            ("kv_bytes_per_token above uses Qwen2.5-0.5B's 24 layers: take SmolLM2's from its config", want * 24 / 30),
            ("that is what full multi-head stores; the question asks what GQA saves (full minus GQA)", want * 1.5),
        ], hint="per token: 2 (k, v) x layers x heads x head_dim x 2 bytes, for 9 heads minus for 3")
    return run_explore("gqa_saved_bytes_per_token", body)


# ------------------------------------------------------------------ 03 rope: slow pairs and the base


def slow_pairs(rope_theta: float = 10_000.0, head_dim: int = 64, context: int = 8192) -> int:
    """How many of the head's D/2 pairs turn less than once in `context` tokens with base rope_theta."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # 2i/D
    wavelength = 2 * math.pi * rope_theta ** exponents  # tokens per turn of pair i
    return int((wavelength > context).sum())


def explore_slow_pairs_theta_10k(value) -> bool:
    """Pairs of SmolLM2's head (D = 64) slower than its 8192-token context if rope_theta were 10,000; exact."""
    def body():
        want = slow_pairs()
        close_to("slow_pairs_theta_10k", value, want, mistakes=[
            ("that is with SmolLM2's own rope_theta, 100,000: the question changes the base to 10,000", slow_pairs(1e5)),
            ("that counts the fast pairs (at least one turn), not the slow ones", 32 - want)],
            hint="the speeds for another base: the same function as smol_inv_freq with 10_000; a pair is slow "
                 "when its wavelength 2*pi/speed exceeds the context")
    return run_explore("slow_pairs_theta_10k", body)


# ------------------------------------------------------------------ 04 norm and mlp: where the parameters are


def mlp_share_of_model(config: str = "SmolLM2-135M-Instruct") -> float:
    """The share of a model's parameters (a tied head counted once) in its MLPs."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_json(CONFIGS / f"{config}.json"))
    mlp = sum(p.numel() for layer in model.model.layers for p in layer.mlp.parameters())
    return mlp / sum(p.numel() for p in model.parameters())


def explore_mlp_share_of_model(value) -> bool:
    """Share of all SmolLM2's parameters in its 30 MLPs, embedding counted once; within 0.002."""
    def body():
        want = mlp_share_of_model()
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_json(CONFIGS / "SmolLM2-135M-Instruct.json"))
        layers = sum(p.numel() for p in model.model.layers.parameters())
        mlp = want * sum(p.numel() for p in model.parameters())
        close_to("mlp_share_of_model", value, want, abs_=0.002, mistakes=[
            ("that is the share within the decoder layers: the question counts the whole model, embedding too",
             mlp / layers),
            ("a share, not a percentage: a number between 0 and 1", want * 100)],
            hint="sum numel() over every layer's mlp.parameters(), then over model.parameters() (which "
                 "counts the tied embedding and head once)")
    return run_explore("mlp_share_of_model", body)


# ------------------------------------------------------------------ 05 model: when attention outweighs the weights


def meta_model(config: str) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(ModelConfig.from_json(CONFIGS / f"{config}.json"))


def attention_crossover_tokens(config: str = "SmolLM2-135M-Instruct", heads: str = "num_attention_heads",
                               head: bool = True, values: bool = True) -> int:
    """The context length from which one new token's attention arithmetic (q.k over t keys, then the
    weighted sum of t values, every head of every layer) is at least its weight matmuls' (the head too).
    The keywords plant the known slips (kv heads, no output head, scores only)."""
    c = ModelConfig.from_json(CONFIGS / f"{config}.json")
    model = meta_model(config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if head and model.lm_head is None:  # tied: the head multiplies by the embedding matrix
        weights += c.vocab_size * c.hidden_size
    if not head and model.lm_head is not None:
        weights -= model.lm_head.weight.numel()
    per_key = (1 + values) * c.num_hidden_layers * getattr(c, heads) * c.head_dim  # multiply-adds per cached position
    return math.ceil(weights / per_key)


def explore_attention_crossover_tokens(value) -> bool:
    """SmolLM2's context length where attention's multiply-adds per new token reach its weights'; within 1%."""
    def body():
        want = attention_crossover_tokens()
        close_to("attention_crossover_tokens", value, want, rel=0.01, mistakes=[
            ("each of the 9 query heads computes its own scores and sums: GQA shares keys and values in memory, "
             "not the arithmetic", attention_crossover_tokens(heads="num_key_value_heads")),
            ("the output head is a matmul too: 49,152 x 576 with the tied embedding",
             attention_crossover_tokens(head=False)),
            ("attention does two products per key: q.k for the score, then the score times v",
             attention_crossover_tokens(values=False))],
            hint="weights: numel() of every nn.Linear's weight plus the tied head's V x h; attention per key: "
                 "2 x layers x heads x head_dim multiply-adds")
    return run_explore("attention_crossover_tokens", body)


# ------------------------------------------------------------------ 06 weights: a 7B model's file and memory

Q8_0_BYTES, Q4_1_BYTES = 34 / 32, 20 / 32  # a block of 32 weights: float16 d (+ m for Q4_1) and the values


def qwen7b_bytes(q8: float = Q8_0_BYTES, q4: float = Q4_1_BYTES, float_bytes: int = 4,
                 config: str = "Qwen2.5-7B-Instruct") -> tuple[float, float]:
    """(tensor bytes of a GGUF with SmolLM2's recipe, bytes in float32 after loading) for a config.

    The recipe: embedding and output head Q8_0, every other matrix Q4_1, norms and biases float32."""
    file = loaded = 0.0
    for name, p in meta_model(config).named_parameters():
        if "embed_tokens" in name or name.startswith("lm_head"):
            file += p.numel() * q8
        elif p.dim() == 2:
            file += p.numel() * q4
        else:
            file += p.numel() * 4
        loaded += p.numel() * float_bytes
    return file, loaded


def explore_qwen7b_bytes(value) -> bool:
    """(GGUF tensor bytes with SmolLM2's Q8_0/Q4_1 recipe, float32 bytes after from_gguf) of Qwen2.5-7B; 1%."""
    def body():
        file, loaded = as_pair("qwen7b_bytes", value)
        want_file, want_loaded = qwen7b_bytes()
        close_to("the GGUF file's tensor bytes", file, want_file, rel=0.01, mistakes=[
            ("a block stores its float16 scale (and Q4_1 its minimum) besides the values: 34 bytes per 32 "
             "weights for Q8_0, 20 for Q4_1 (gguf.GGML_QUANT_SIZES)", qwen7b_bytes(q8=1.0, q4=0.5)[0]),
            ("bits, not bytes: divide by 8", want_file * 8)],
            hint="per parameter tensor: numel() x its type's bytes per weight; Qwen2.5-7B's head is a "
                 "tensor of its own (untied)")
        close_to("the float32 bytes after loading", loaded, want_loaded, rel=0.01, mistakes=[
            ("from_gguf dequantizes to float32: 4 bytes per parameter", qwen7b_bytes(float_bytes=2)[1]),
            ("that is the file's size: loading turns every weight into a float32", want_file)],
            hint="4 bytes for every parameter, the untied head included")
    return run_explore("qwen7b_bytes", body)


# ------------------------------------------------------------------ 07 tokenizer: whose vocabulary speaks Chinese


def _has_cjk(token: bytes) -> bool:
    """Whether the token is valid UTF-8 holding a CJK Unified Ideograph (U+4E00 to U+9FFF)."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


@lru_cache(maxsize=1)
def chinese_share() -> tuple[float, float]:
    """(Qwen2.5's share, SmolLM2's share) of vocabulary tokens that hold a Chinese character."""
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    smol = Tokenizer.from_gguf(embedded_gguf_path())
    smol_tokens = [smol.token_bytes(i) for i in range(smol.vocab_size)]
    return sum(map(_has_cjk, ranks)) / len(ranks), sum(map(_has_cjk, smol_tokens)) / len(smol_tokens)


def explore_chinese_share(value) -> bool:
    """(Qwen2.5, SmolLM2) shares of tokens that decode to text with a CJK ideograph; within 0.002 and 0.0002."""
    def body():
        qwen, smol = as_pair("chinese_share", value)
        want_qwen, want_smol = chinese_share()
        close_to("Qwen2.5's share", qwen, want_qwen, abs_=0.002, mistakes=[
            ("the pair is (Qwen2.5, SmolLM2), in that order", want_smol),
            ("a share, not a percentage: a number between 0 and 1", want_qwen * 100)],
            hint="count the ranks' tokens (bytes) that decode as UTF-8 and hold a character between "
                 "U+4E00 and U+9FFF, over all 151,643")
        close_to("SmolLM2's share", smol, want_smol, abs_=0.0002, mistakes=[
            ("the pair is (Qwen2.5, SmolLM2), in that order", want_qwen),
            ("no token spelled in the byte alphabet holds a Chinese character: decode the token's bytes "
             "(token_bytes, or unspell)", 0.0)],
            hint="id_to_token gives a token in the byte alphabet: take its bytes (token_bytes, or unspell) "
                 "before decoding them as UTF-8")
    return run_explore("chinese_share", body)


# ------------------------------------------------------------------ 08 kv cache: cache against weights


@cache
def kv_crossover_tokens(config: str = "Qwen2.5-0.5B-Instruct") -> int:
    """The fewest tokens (batch 1) whose bf16 KV cache exceeds or equals the model's bf16 weights."""
    c = ModelConfig.from_json(CONFIGS / f"{config}.json")
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = CausalLM(c)
    weights = sum(t.numel() for t in model.parameters()) * 2  # a tied head is one parameter
    return math.ceil(weights / kv_cache_bytes(c, 1))


def explore_kv_crossover_tokens(value) -> bool:
    """Context length at which Qwen2.5-0.5B's bf16 KV cache outweighs its bf16 weights; within 1%."""
    def body():
        want = kv_crossover_tokens()
        close_to("kv_crossover_tokens", value, want, rel=0.01, mistakes=[
            ("the cache holds a key AND a value per kv head, and both it and the weights are bf16 (2 bytes)",
             want * 2),
            ("both in bf16: 2 bytes per weight as well as per cached number", want / 2),
            ("count the tied embedding/head once (model.parameters() does)", want + 151936 * 896 * 2 / 12288),
        ], hint="weights in bytes: count the parameters (a CausalLM built under torch.device('meta') has "
                "the shapes without the memory); per token: kv_cache_bytes(config, 1)")
    return run_explore("kv_crossover_tokens", body)


# ------------------------------------------------------------------ 09 sampling: the tail of a real row


@lru_cache(maxsize=1)
def _story_probs() -> torch.Tensor:
    llm = load()
    ids = llm.tokenizer.encode("Once upon a time, there was a little")
    with torch.no_grad():
        return torch.softmax(llm.model(torch.tensor([ids]))[0, -1].float(), -1)


def tail(threshold: float = 1e-4) -> tuple[int, float]:
    """(how many tokens, their total probability) below `threshold` on SmolLM2's row after "little", t = 1."""
    p = _story_probs()
    below = p < threshold
    return int(below.sum()), float(p[below].sum())


def explore_tail(value) -> bool:
    """(count, mass) of the tokens below probability 1e-4 after "...a little"; count within 0.5%, mass 0.002."""
    def body():
        count, mass = as_pair("tail", value)
        want_count, want_mass = tail()
        vocab = 49152
        close_to("tail count", count, want_count, rel=0.005, mistakes=[
            ("that counts the tokens above the threshold, not below", vocab - want_count)],
            hint="probabilities are softmax(logits) of the last row, temperature 1; count p < 1e-4")
        close_to("tail mass", mass, want_mass, abs_=0.002, mistakes=[
            ("that is the mass above the threshold: sum the probabilities of the tokens below it", 1 - want_mass)],
            hint="sum the probabilities of the same tokens (a number between 0 and 1)")
    return run_explore("tail", body)


# ------------------------------------------------------------------ 10 generate: tokens that are not text


@lru_cache(maxsize=1)
def broken_tokens() -> int:
    """How many of SmolLM2's tokens are not valid UTF-8 on their own (fragments of a character)."""
    tok = Tokenizer.from_gguf(embedded_gguf_path())
    count = 0
    for i in range(tok.vocab_size):
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            count += 1
    return count


def explore_broken_tokens(value) -> bool:
    """How many of SmolLM2's 49,152 tokens do not decode alone (their bytes are not valid UTF-8); exact."""
    def body():
        want = broken_tokens()
        close_to("broken_tokens", value, want, mistakes=[
            ("that counts the tokens that DO decode alone", 49152 - want)],
            hint="decode each token's bytes (token_bytes) strictly, bytes.decode('utf-8'), and count the "
                 "UnicodeDecodeErrors; tokenizer.decode replaces bad bytes with \ufffd instead of failing")
    return run_explore("broken_tokens", body)


# ------------------------------------------------------------------ 11 paged cache: what reserving costs


def sequences_that_fit(budget: int = 2**30 * 2, length: int = 300, block_size: int = 16) -> tuple[int, int]:
    """SmolLM2 sequences of `length` tokens a bf16 cache of `budget` bytes holds: (dense at 8192, paged)."""
    c = ModelConfig.from_json(CONFIGS / "SmolLM2-135M-Instruct.json")
    dense = kv_cache_bytes(c, c.max_position_embeddings)
    paged = kv_cache_bytes(c, math.ceil(length / block_size) * block_size)  # whole blocks
    return budget // dense, budget // paged


def explore_sequences_that_fit(value) -> bool:
    """(dense, paged) count of 300-token SmolLM2 sequences in a 2 GiB bf16 cache, blocks of 16; exact."""
    def body():
        dense, paged = as_pair("sequences_that_fit", value)
        want_dense, want_paged = sequences_that_fit()
        close_to("sequences that fit, dense", dense, want_dense, mistakes=[
            ("the dense cache reserves the whole 8192-token context per sequence, in bf16 (2 bytes)",
             2**31 // kv_cache_bytes(ModelConfig.from_json(CONFIGS / "SmolLM2-135M-Instruct.json"), 8192,
                                     dtype=torch.float32))],
            hint="a whole number of sequences: round down")
        close_to("sequences that fit, paged", paged, want_paged, mistakes=[
            ("a sequence holds whole blocks: 300 tokens take ceil(300 / 16) blocks", 2**31 // (300 * 23040)),
            ("that is the dense count: with paging a sequence reserves only its blocks", want_dense)],
            hint="a whole number of sequences: round down")
    return run_explore("sequences_that_fit", body)


# ------------------------------------------------------------------ 13 quantization: bits per weight


def int4_bits_per_weight(group_size: int = 32) -> float:
    """Bits per weight an Int4Linear of SmolLM2's gate_proj shape stores, buffers counted (5.0 for g32)."""
    linear = torch.nn.Linear(576, 1536, bias=False)
    layer = Int4Linear.from_linear(linear, group_size, kernel="reference")
    return sum(b.nbytes for b in layer.buffers()) * 8 / linear.weight.numel()


def explore_int4_bits_per_weight(value) -> bool:
    """Bits per weight of int4 g32 with its scales and zeros counted; within 0.01 bit."""
    def body():
        want = int4_bits_per_weight()
        close_to("int4_bits_per_weight", value, want, abs_=0.01, mistakes=[
            ("count the scales and zeros too: sum the nbytes of every buffer of the layer", 4.0),
            ("every group stores a zero as well as a scale", 4.5),
            ("the scales and zeros are bf16 (2 bytes each), not float32", 6.0),
            ("two 4-bit values share a byte: count qweight's bytes, not its values", want + 4),
        ], hint="bits = 8 x (bytes of all buffers) / (number of weights)")
    return run_explore("int4_bits_per_weight", body)


# ------------------------------------------------------------------ 16 paged attention: the gather's copy


def gather_copy_mib(batch: int = 8, context: int = 4096) -> float:
    """MiB of keys and values a gathered decode step copies: SmolLM2 in float32, every layer, every sequence."""
    config = ModelConfig.from_json(CONFIGS / "SmolLM2-135M-Instruct.json")
    return batch * kv_cache_bytes(config, context, dtype=torch.float32) / 2**20


def explore_gather_copy_mib(value) -> bool:
    """MiB the gather copies in one decode step of 8 SmolLM2 sequences of 4096 tokens, float32; within 0.5%."""
    def body():
        want = gather_copy_mib()
        close_to("gather_copy_mib", value, want, rel=0.005, mistakes=[
            ("the copy moves keys and values, 4 bytes a number in float32", want / 2),
            ("the cache holds num_key_value_heads heads of head_dim, not num_attention_heads", want * 3),
            ("every layer's keys and values are copied, num_hidden_layers of them", want / 30),
            ("MiB is 2**20 bytes, not 10**6", want * 2**20 / 1e6),
            ("that is one sequence: the step copies all eight", want / 8)])
    return run_explore("gather_copy_mib", body)


EXPLORE = {
    "slow_pairs_theta_10k": explore_slow_pairs_theta_10k,
    "mlp_share_of_model": explore_mlp_share_of_model,
    "attention_crossover_tokens": explore_attention_crossover_tokens,
    "qwen7b_bytes": explore_qwen7b_bytes,
    "chinese_share": explore_chinese_share,
    "transpose_copy_bytes": explore_transpose_copy_bytes,
    "gqa_saved_bytes_per_token": explore_gqa_saved_bytes_per_token,
    "kv_crossover_tokens": explore_kv_crossover_tokens,
    "tail": explore_tail,
    "broken_tokens": explore_broken_tokens,
    "int4_bits_per_weight": explore_int4_bits_per_weight,
    "sequences_that_fit": explore_sequences_that_fit,
    "gather_copy_mib": explore_gather_copy_mib,
}
"""Exploration name (the answer's variable) -> its check; the reference values come from the functions above."""
