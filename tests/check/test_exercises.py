"""The classroom exercises: exercise notebooks are current, every stub raises NotImplementedError,
the reference package passes every check, and planted mistakes fail with the expected hint."""

from __future__ import annotations

import ast
import contextlib
import csv
import importlib.util
import io
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support import ROOT
from minillm.model import attention, decoder as model, gated_delta, layers, moe, rope, tensor
from minillm import check
from minillm.check import linear_attention as check_linear_attention, model as check_model, moe as check_moe
from minillm.cache import dense as kv_cache, paged as paged_cache, paged_attention
from minillm.speed import quant
from minillm.runtime import sampling

EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_exercises = load_tool("make_exercises")


def test_exercise_notebooks_are_current():
    result = subprocess.run([sys.executable, "tools/make_exercises.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_concept_notebook_has_an_exercise():
    names = {p.name for p in EXERCISES}
    for name in ["01_tensors", "02_attention", "03_rope", "04_norm_mlp", "05_model", "08_kv_cache", "09_sampling",
                 "15_block_manager", "16_paged_attention", "12_quantization"]:
        assert f"{name}.ipynb" in names


# ---------------------------------------------------------------- the stubs


def _calls(ns: dict) -> dict:
    """One small call per exercise name, made with the notebook's own definitions."""
    T = tensor.Tensor  # the package's: the notebook's own Tensor.from_list needs its contiguous_strides stub
    x4 = torch.randn(1, 2, 3, 4)
    cos = sin = torch.ones(1, 3, 4)
    cfg = check_model._tiny_config()
    c, s = torch.ones(1, 3, cfg.head_dim), torch.zeros(1, 3, cfg.head_dim)
    h = torch.randn(1, 3, cfg.hidden_size)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    return {
        "contiguous_strides": lambda f: f((2, 3)),
        "transpose": lambda f: f(T.from_list([[1.0, 2.0], [3.0, 4.0]]), 0, 1),
        "expand": lambda f: f(T.from_list([[1.0], [2.0]]), (2, 3)),
        "matmul": lambda f: f(T.from_list([[1.0, 2.0]]), T.from_list([[1.0], [2.0]])),
        "causal_mask": lambda f: f(3, 3, 0),
        "attention_weights": lambda f: f(x4, x4),
        "scaled_dot_product_attention": lambda f: f(x4, x4, x4),
        "rotate_half": lambda f: f(x4),
        "rope_cos_sin": lambda f: f(torch.arange(3), torch.ones(2)),
        "apply_rope": lambda f: f(x4, cos, sin),
        "rms_norm": lambda f: f(torch.randn(2, 4), torch.ones(4), 1e-6),
        "MLP.forward": lambda cls: cls(4, 8)(torch.randn(2, 4)),
        "Attention.forward": lambda cls: cls(cfg)(h, c, s, mask),
        "DecoderLayer.forward": lambda cls: cls(cfg)(h, c, s, mask),
        "KVCache.update": lambda cls: cls(1, 4, 1, 2).update(0, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2)),
        "gather_reference": lambda f: f(paged_cache.PagedKVCache(2, 4, 1, 2), [0, 1], 5),
        "batch_layout": lambda f: f(_one_sequence_manager(), ["s"], 1),
        "fold_block": lambda f: f(paged_attention.empty_state((1,), 2), torch.zeros(1, 3), torch.zeros(3, 2)),
        "top_k_filter": lambda f: f(torch.randn(1, 5), 2),
        "top_p_filter": lambda f: f(torch.randn(1, 5), 0.5),
        "min_p_filter": lambda f: f(torch.randn(1, 5), 0.1),
        "quantize_int4": lambda f: f(torch.randn(2, 32), 32),
        "dequantize_q4_1": lambda f: f(torch.zeros(20, dtype=torch.uint8), (1, 32)),
        **_loading_calls(),
        **_engine_calls(),
        **_first_version_calls(),
        "accept_sampled": lambda f: f(torch.softmax(torch.randn(2, 4), -1), torch.softmax(torch.randn(1, 4), -1), [0],
                                      None),
        "MultiLoRALinear.forward": lambda cls: cls(torch.nn.Linear(2, 3), torch.zeros(2, 1, 2), torch.zeros(2, 3, 1),
                                                   SimpleNamespace(ids=torch.tensor([1])))(torch.ones(1, 1, 2)),
        "decode_bytes": lambda f: f(check_performance.configs()["SmolLM2-135M-Instruct"], 2, 16),
        "Split.kv_heads": lambda cls: cls(check_parallel._config(4, 2), 0, 2).kv_heads,
        "Vocabulary.allowed": lambda cls: cls(check_structured._tokenizer(), 3).allowed(
            DFA(check_structured.PATTERNS["a b* }"][0]), 0),
        "recurrent_gated_delta_rule": lambda f: f(*check_linear_attention._inputs(1, 2, 1, 4, 4, seed=0)),
        "route": lambda f: f(*check_moe._router_inputs(3, 8, 4, seed=0), 2, True),
        "experts_loop": lambda f: f(torch.zeros(2, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3), torch.ones(2, 1),
                                    torch.tensor([[0], [2]])),
    }


def _one_sequence_manager():
    manager = paged_cache.BlockManager(4, 4)
    manager.allocate("s", [5, 6, 7])
    return manager


def exec_notebook_code(path: Path) -> tuple[dict, list[str]]:
    code, stubs = check._notebook_code(path)
    module = types.ModuleType("exercise_" + path.stem)
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__, stubs


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_stub_raises_not_implemented(path):
    ns, stubs = exec_notebook_code(path)
    assert stubs, f"{path.name}: no stubs recorded in metadata['minillm']['stubs']"
    calls = _calls(ns)
    for name in stubs:
        assert name in check.CHECKS, f"{name}: no check in minillm.check"
        obj = ns[name.split(".")[0]]
        with pytest.raises(NotImplementedError, match=f"exercise: implement {name}"):
            calls[name](obj)


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_exercise_notebook_has_check_cells_and_no_export_markup(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any(line.startswith("#|") for s in sources for line in s.splitlines())
    assert not any("### BEGIN SOLUTION" in s for s in sources)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"] if c["cell_type"] == "code")
    for name in nb["metadata"]["minillm"]["stubs"]:
        call = f"check.{make_exercises.check_name(name)}({name.split('.')[0]})"
        assert any(call in s for s in sources), f"{path.name}: no check cell {call}"
        assert hasattr(check, make_exercises.check_name(name))


def test_cli_fails_on_stubs_and_passes_on_the_reference(capsys):
    assert check.main([str(ROOT / "exercises" / "02_attention.ipynb")]) == 1
    assert "not implemented yet" in capsys.readouterr().out
    assert check.main([str(ROOT / "notebooks" / "02_attention.ipynb")]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "FAIL" not in out


def test_cli_checks_a_reference_notebooks_own_exercises(capsys):
    """Notebook 19 defines a `stream` of its own (speculative): the CLI checks only its solution regions."""
    assert check.check_path(ROOT / "notebooks" / "19_speculative.ipynb") == (1, 1)
    out = capsys.readouterr().out
    assert out.strip() == "PASS accept_sampled"
    assert check._solution_names("def stream(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
                                 "def accept_sampled():\n    pass\n") == ["stream"]
    assert check._solution_names("def stream(x):\n    return x\n") is None  # a student's module: every name


def test_cli_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "minillm.check", "exercises/08_kv_cache.ipynb"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL KVCache.update: not implemented yet" in result.stdout


def test_cli_checks_a_student_module(tmp_path, capsys):
    student = tmp_path / "student.py"
    student.write_text("import torch\n\ndef causal_mask(T, S, start=0, device=None):\n"
                       "    return torch.ones(T, S, dtype=torch.bool).tril()\n")  # ignores start
    assert check.main([str(tmp_path)]) == 1
    assert "offset by the cache position" in capsys.readouterr().out


# ---------------------------------------------------------------- notebooks 06, 07, 10: GGUF rows, BPE, streaming, the loop
# (minillm/check/loading.py: the stubs' calls, the references and the planted mistakes, used by the tests above and below)

import inspect  # noqa: E402

from minillm.check import loading as check_loading  # noqa: E402
from minillm.runtime import generate
from minillm.text import tokenizer
from minillm.weights import loading as weights


def test_loading_exercises_exist():
    names = {p.name for p in EXERCISES}
    for name in ["06_weights", "07_tokenizer", "10_generate"]:
        assert f"{name}.ipynb" in names


def _loading_calls() -> dict:
    lm, tok = check_loading.tiny_lm()
    return {
        "unpermute_qk": lambda f: f(torch.zeros(8, 4), 2),
        "bpe": lambda f: f(b"ab", {b"ab": 0}),
        "StreamDecoder.push": lambda cls: cls(tok).push(0),
        "StopStrings.push": lambda cls: cls(["x"]).push("a"),
        "stream": lambda f: list(f(lm, tok, [1, 2], max_new_tokens=2)),
    }


LOADING_REFERENCE = {
    "unpermute_qk": weights.unpermute_qk, "bpe": tokenizer.bpe, "StreamDecoder.push": tokenizer.StreamDecoder,
    "StopStrings.push": generate.StopStrings, "stream": generate.stream,
}


def unpermute_with_llama_cpp_permute(w, n_heads):
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_whole_matrix(w, n_heads):
    return weights.unpermute_qk(w, 1)


def bpe_first_pair_from_left(piece, ranks, max_rank=None):
    parts = [piece[i:i + 1] for i in range(len(piece))]
    merged = True
    while merged:
        merged = False
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (max_rank is None or rank < max_rank):
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
                merged = True
                break
    return parts


def bpe_ignoring_max_rank(piece, ranks, max_rank=None):
    return tokenizer.bpe(piece, ranks)


def bpe_one_merge(piece, ranks, max_rank=None):
    parts = [piece[i:i + 1] for i in range(len(piece))]
    pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
    if pairs:
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


class DecoderEachTokenAlone(tokenizer.StreamDecoder):
    def push(self, token_id):
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


class DecoderNeverSkipping(tokenizer.StreamDecoder):
    def push(self, token_id):
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))


class StopsWithoutHolding(generate.StopStrings):
    def push(self, text):
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        out, self.pending = (self.pending[: min(hits)] if hits else self.pending), ""
        return out, bool(hits)


class StopsSearchingNewTextOnly(generate.StopStrings):
    def push(self, text):
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending + text[: min(hits)], ""
            return out, True
        self.pending += text
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def _variant(function, old: str, new: str, label: str):
    """function with one line changed (a planted mistake in the student's region), named label."""
    source = inspect.getsource(function)
    assert source.count(old) == 1, old
    namespace = dict(vars(inspect.getmodule(function)))
    exec(compile(source.replace(old, new), label, "exec"), namespace)
    namespace[function.__name__].__name__ = label
    return namespace[function.__name__]


def _stream_variant(name: str, old: str, new: str):
    return _variant(generate.stream, old, new, name)


stream_decoding_one_position_late = _stream_variant("stream_decoding_one_position_late",
                                                    "start_pos=len(seen) - 1", "start_pos=len(seen)")
stream_without_cache = _stream_variant("stream_without_cache",
                                       "model(pick.tokens.view(1, 1), cache=cache, start_pos=len(seen) - 1)",
                                       "model(torch.tensor([seen], device=device))")
stream_without_history = _stream_variant("stream_without_history",
                                         "token_ids=[seen], prompt_lengths=[len(prompt_ids)]", "")

LOADING_PLANTED = [
    ("unpermute_qk", unpermute_with_llama_cpp_permute, "not its inverse"),
    ("unpermute_qk", unpermute_whole_matrix, "per head"),
    ("bpe", bpe_first_pair_from_left, "merge the pair of LOWEST rank anywhere"),
    ("bpe", bpe_ignoring_max_rank, "merge only pairs ranked below it"),
    ("bpe", bpe_one_merge, "repeat until no adjacent pair is in ranks"),
    ("StreamDecoder.push", DecoderEachTokenAlone, "a character's bytes can be split across tokens"),
    ("StreamDecoder.push", DecoderNeverSkipping, "tokenizer.special_ids"),
    ("StopStrings.push", StopsWithoutHolding, "hold back the last len(longest stop string) - 1 characters"),
    ("StopStrings.push", StopsSearchingNewTextOnly, "split across pushes"),
    ("stream", stream_decoding_one_position_late, "position len(seen) - 1"),
    ("stream", stream_without_cache, "decode one token at a time"),
    ("stream", stream_without_history, "pass token_ids=[seen]"),
]


def test_stream_check_uses_a_model_that_does_not_repeat_itself():
    """The tiny model's greedy run must vary, or a wrong decode position could go unnoticed."""
    lm, tok = check_loading.tiny_lm()
    tokens = check_loading._reference_run(lm, tok, [7, 4, 11, 11, 14], sampling.SamplingParams(temperature=0), 8, ())[0]
    assert len(set(tokens)) >= 4, tokens


def test_bpe_reference_matches_tiktoken():
    """The checker's BPE on Qwen's ranks gives tiktoken's tokens (an independent implementation)."""
    import tiktoken

    ranks = check_loading._qwen_ranks()
    enc = tiktoken.Encoding("qwen-ranks", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={})
    for text in check_loading._QWEN_TEXTS:
        assert [ranks[p] for p in check_loading._bpe(text.encode(), ranks)] == enc.encode_ordinary(text), text


# ---------------------------------------------------------------- notebooks 17, 18: the scheduler, the server's events
# (minillm/check/engine.py: the stubs' calls, the references and the planted mistakes, used by the tests above and below)

from collections import deque  # noqa: E402

from minillm.check import engine as check_engine  # noqa: E402
from minillm.runtime import engine
from minillm.serve import openai_protocol, server


def test_engine_exercises_exist():
    names = {p.name for p in EXERCISES}
    for name in ["17_engine", "18_server"]:
        assert f"{name}.ipynb" in names


def _engine_calls() -> dict:
    def scheduler_state():
        manager = paged_cache.BlockManager(4, 4, enable_prefix_caching=False)
        seq = engine.Sequence(0, [1, 2, 3], sampling.SamplingParams(temperature=0), text=None)
        return manager, deque([seq]), [], seq

    def admit_call(f):
        manager, waiting, running, _ = scheduler_state()
        return f(manager, waiting, running, 2, 64)

    def running_state():
        manager, waiting, running, seq = scheduler_state()
        engine.admit(manager, waiting, running, 2, 64)
        seq.pending = 9
        return manager, running, waiting, seq

    reply = openai_protocol.Reply(True, "m", 3)
    return {
        "admit": admit_call,
        "preempt_seq": lambda f: f(*running_state()),
        "make_room": lambda f: f(*running_state()[:3]),
        "output_events": lambda f: f(engine.Output(0, 42, "a"), reply, check_engine._Tokens(), False),
    }


ENGINE_REFERENCE = {"admit": engine.admit, "preempt_seq": engine.preempt_seq, "make_room": engine.make_room,
                    "output_events": openai_protocol.output_events}


def admit_skipping_the_oldest(manager, waiting, running, max_num_seqs, max_model_len):
    admitted, rejected = [], []
    for seq in list(waiting):  # every request that fits, in order: a small one passes a large one
        if len(running) >= max_num_seqs:
            break
        if manager.blocks_needed(len(seq.token_ids) + 1) > manager.num_blocks or len(seq.token_ids) >= max_model_len:
            waiting.remove(seq)
            rejected.append(seq)
        elif manager.can_allocate(seq.token_ids) and not manager.prefix_hits(seq.token_ids):
            waiting.remove(seq)
            seq.num_cached = manager.allocate(seq.id, seq.token_ids)
            seq.status = engine.RUNNING
            running.append(seq)
            admitted.append(seq)
    return admitted, rejected


def admit_without_max_num_seqs(manager, waiting, running, max_num_seqs, max_model_len):
    return engine.admit(manager, waiting, running, 10**9, max_model_len)


def preempt_dropping_pending(manager, running, waiting, seq):
    seq.pending = None  # the streamed token is lost: it will be sampled again
    engine.preempt_seq(manager, running, waiting, seq)


def make_room_preempting_the_oldest(manager, running, waiting):
    decoding, preempted = [], 0
    for seq in list(running):
        if seq.status != engine.RUNNING:
            continue
        while not manager.can_append(seq.id):
            victim = running[0]
            engine.preempt_seq(manager, running, waiting, victim)
            preempted += 1
            if victim is seq:
                break
        if seq.status == engine.RUNNING:
            manager.append(seq.id, seq.pending)
            decoding.append(seq)
    return decoding, preempted


def events_without_finish(out, reply, tokenizer, logprobs):
    return [e for e in openai_protocol.output_events(out, reply, tokenizer, logprobs) if '"finish_reason": null' in e]


def events_with_content_in_last_delta(out, reply, tokenizer, logprobs):
    return [e.replace('"delta": {}', '"delta": {"content": ""}') for e in
            openai_protocol.output_events(out, reply, tokenizer, logprobs)]


def events_for_every_output(out, reply, tokenizer, logprobs):
    events = openai_protocol.output_events(out, reply, tokenizer, logprobs)
    if not (out.text or (logprobs and out.token_id is not None)):
        events.insert(0, reply.chunk([reply.choice(out.text, None, None, delta=True)]))
    return events


def events_without_blank_line(out, reply, tokenizer, logprobs):
    return [e.rstrip("\n") + "\n" for e in openai_protocol.output_events(out, reply, tokenizer, logprobs)]


ENGINE_PLANTED = [
    ("admit", admit_skipping_the_oldest, "oldest first"),
    ("admit", admit_without_max_num_seqs, "at most max_num_seqs"),
    ("preempt_seq", preempt_dropping_pending, "keep the pending token"),
    ("make_room", make_room_preempting_the_oldest, "preempt the NEWEST running sequence"),
    ("output_events", events_without_finish, "followed by a finishing chunk"),
    ("output_events", events_with_content_in_last_delta, "the finishing chunk's delta is empty"),
    ("output_events", events_for_every_output, "an output without text sends no chunk"),
    ("output_events", events_without_blank_line, "the blank line that ends the event"),
]


def test_the_traces_preempt_reject_and_wait():
    """The scripted traces exercise every rule: a rejection, preemptions, and a prompt waiting for a
    prefix being computed (the planted mistakes below show that each rule changes a trace)."""
    logs = [check_engine._replay(check_engine._admit_ref, check_engine._make_room_ref, s) for s in check_engine._SCENARIOS]
    steps = [step for log in logs for step in log]
    assert any(step["rejected"] != "-" for step in steps)
    assert sum(step["preempted"] != "-" for step in steps) >= 3
    assert logs[-1][0]["admitted"] == "A" and logs[-1][1]["admitted"] == "B"  # the fresh rule


def _reference_stream() -> str:
    """Every reference event of the check's outputs, chat and text, with and without logprobs."""
    events = []
    for chat in (True, False):
        for logprobs in (False, True):
            reply = check_engine._reply(chat)
            for _, out in check_engine._OUTPUTS:
                events += openai_protocol.output_events(out, reply, check_engine._Tokens(), logprobs)
    return "".join(events) + openai_protocol.sse("[DONE]")


def test_sse_parser_agrees_with_the_openai_client():
    """The checker's SSE parser reads the reference events as the official client does, even when the
    bytes arrive cut at arbitrary places."""
    from openai._streaming import SSEDecoder

    stream = _reference_stream()
    ours = check_engine.parse_sse(stream)
    data = stream.encode()
    pieces = [data[i:i + 37] for i in range(0, len(data), 37)]
    theirs = [event.data for event in SSEDecoder().iter_bytes(iter(pieces))]
    assert len(ours) > 10 and ours == theirs
    assert ours[-1] == "[DONE]"
    assert check_engine.parse_sse(": comment\nevent: x\ndata: a\ndata:b\n\n") == ["a\nb"]
    assert [e.data for e in SSEDecoder().iter_bytes(iter([b": comment\nevent: x\ndata: a\ndata:b\n\n"]))] == ["a\nb"]


def test_stream_answer_uses_output_events():
    """The server streams what output_events returns (the exercise's function is the server's);
    only an answer offered tools goes through tool_stream's events instead."""
    source = inspect.getsource(server.stream_answer)
    assert "events = tool_events if req.tools else output_events" in source
    assert "events(out, reply, tokenizer, req.logprobs)" in source


def test_explorations_accept_plausible_numbers(capsys):
    assert check_engine.explore_speedup_16(5.0) and check_engine.explore_text_share(0.03)
    assert not check_engine.explore_speedup_16(0.2)
    assert "not the reverse" in capsys.readouterr().out
    assert not check_engine.explore_text_share(30.0)
    assert "not the reverse" in capsys.readouterr().out


# ---------------------------------------------------------------- the first versions of 02, 10, 13
# (minillm/check/first_versions.py: lesson cells, not exported, so the reference is the notebook's own cell)

from minillm.check.harness import bounded  # noqa: E402


def _cell_defining(notebook: str, name: str) -> str:
    nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return next("".join(c["source"]) for c in nb["cells"]
                if c["cell_type"] == "code" and f"def {name}(" in "".join(c["source"]))


def notebook_function(notebook: str, name: str, module, old: str = "", new: str = "", label: str = ""):
    """The reference notebook's own `name`, its cell run in the namespace of the module the notebook builds;
    with old -> new, one line of it changed (a planted mistake in the student's region), named label."""
    source = _cell_defining(notebook, name)
    if old:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = dict(vars(module))
    exec(compile(source, f"{notebook}.ipynb:{label or name}", "exec"), namespace)
    namespace[name].__name__ = label or name
    return namespace[name]


FIRST_REFERENCE = {
    "naive_attention": notebook_function("02_attention", "naive_attention", attention),
    "greedy_decode": notebook_function("10_generate", "greedy_decode", generate),
    "fake_quant": notebook_function("12_quantization", "fake_quant", quant),
}


def _first_version_calls() -> dict:
    lm, _ = check_loading.tiny_lm()
    return {
        "naive_attention": lambda f: f(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4)),
        "greedy_decode": lambda f: f(lm, [1, 2], 2),
        "fake_quant": lambda f: f(torch.randn(2, 32), 4, 32, False),
    }


FIRST_PLANTED = [(name, notebook_function(nb, name, module, old, new, label), hint)
                 for name, nb, module, old, new, label, hint in [
    ("naive_attention", "02_attention", attention, " / math.sqrt(q.shape[-1])", "", "naive_unscaled", "sqrt(D)"),
    ("naive_attention", "02_attention", attention, "softmax(dim=-1)", "softmax(dim=0)", "naive_softmax_over_queries",
     "softmax over the keys"),
    ("greedy_decode", "10_generate", generate, "ids = torch.tensor([[tokens[-1]]], device=device)",
     "ids, start_pos = torch.tensor([list(prompt_ids) + tokens], device=device), 0", "greedy_without_cache",
     "feed only the newest token"),
    ("greedy_decode", "10_generate", generate, "start_pos += ids.shape[1]", "start_pos += 1",
     "greedy_advancing_by_one", "the number of tokens already in the cache"),
    ("greedy_decode", "10_generate", generate, "for _ in range(n):", "for _ in range(n - 1):",
     "greedy_one_short", "n - 1 decode passes"),
    ("fake_quant", "12_quantization", quant, "(2**bits - 1)", "2**bits", "fake_quant_sixteen_steps",
     "divide by 2**bits - 1"),
    ("fake_quant", "12_quantization", quant, "w.reshape(N, K // group, group)", "w.reshape(N, 1, K)",
     "fake_quant_per_row", "reduce over the last axis"),
    ("fake_quant", "12_quantization", quant, "* s + lo)", "* s)", "fake_quant_without_zero_point", "q * s + lo"),
]]


def test_a_loop_that_never_ends_fails_instead_of_hanging(capsys):
    def admit_forever(manager, waiting, running, max_num_seqs, max_model_len):
        while waiting:  # never takes anyone off the queue
            pass
    assert check.admit(admit_forever) is False
    assert "did not return after 200,000 lines of Python" in capsys.readouterr().out
    assert sys.gettrace() is None or "coverage" in type(sys.gettrace()).__module__  # the tracer is gone


def test_bounded_leaves_a_function_that_returns_alone():
    assert bounded(sum, "sum")([1, 2, 3]) == 6
    assert bounded(lambda n: sum(i for i in range(n)), "count")(1000) == 499500


# ---------------------------------------------------------------- notebook 19: the sampling rule (minillm/check/speculative.py)

from minillm.check import speculative as validate_speculative  # noqa: E402
from minillm.runtime import speculative


def _rule_variant(old: str, new: str, label: str):
    return _variant(speculative.accept_sampled, old, new, label)


_KEEP = "if ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=generator, device=p.device)) < ratio):"
SPECULATIVE_PLANTED = [
    ("accept_sampled", _rule_variant(_KEEP, "if ratio >= 1:", "keep_if_p_above_q"), "whenever p(x) > q(x)"),
    ("accept_sampled", _rule_variant(_KEEP, "if ratio > 1:", "reject_ties"), "below min(1, p(x) / q(x))"),
    ("accept_sampled", _rule_variant("residual = (p[i] - q[i]).clamp(min=0)", "residual = p[i]", "resample_from_p"),
     "not from p"),
    ("accept_sampled", _rule_variant("ratio = float(p[i, x] / q[i, x])", "ratio = float(q[i, x] / p[i, x])",
                                     "ratio_upside_down"), "has ratio p(x) / q(x) = 0"),
]


# ---------------------------------------------------------------- notebook 20: serving many adapters (minillm/check/lora.py)

from minillm.check import lora as check_lora  # noqa: E402
from minillm.weights import lora


def _multi_variant(old: str, new: str, label: str):
    return _variant(lora.MultiLoRALinear, old, new, label)


_ADD = "return y + (x @ A.transpose(1, 2)) @ B.transpose(1, 2)"
_GATHER = "self.lora_A[self.rows.ids], self.lora_B[self.rows.ids]"
LORA_PLANTED = [
    ("MultiLoRALinear.forward", _multi_variant(_ADD, "return (x @ A.transpose(1, 2)) @ B.transpose(1, 2)",
                                               "multi_lora_without_base"), "add the base layer's output"),
    ("MultiLoRALinear.forward", _multi_variant(_ADD, "return y", "multi_lora_base_only"), "the base layer alone"),
    ("MultiLoRALinear.forward", _multi_variant(_GATHER, "self.lora_A[self.rows.ids[:1]], self.lora_B[self.rows.ids[:1]]",
                                               "multi_lora_first_row_adapter"), "each row has its own adapter"),
    ("MultiLoRALinear.forward", _multi_variant("if self.rows.ids is None:", "if False:", "multi_lora_ids_none"),
     "rows.ids is None when no row has an adapter"),
]


# ---------------------------------------------------------------- notebook 14: the trie walk (minillm/check/structured.py)

from minillm.check import structured as check_structured  # noqa: E402
from minillm.text import constrained
from minillm.text.grammar import DFA


def _walk_variant(old: str, new: str, label: str):
    return _variant(constrained.Vocabulary, old, new, label)


_WALK_ADD = """                if t != DFA.DEAD:
                    found.extend(child[1])
                    todo.append((child, t))"""
STRUCTURED_PLANTED = [
    ("Vocabulary.allowed", _walk_variant("t = dfa.step(s, b)", "t = dfa.step(s, b) if children is self.root[0] else s",
                                         "walk_first_byte_only"), "not just the first"),
    ("Vocabulary.allowed", _walk_variant("[(self.root, state)]", "[(self.root, dfa.start)]", "walk_from_start"),
     "not from dfa.start"),
    ("Vocabulary.allowed", _walk_variant("found.extend(child[1])", "found.extend([] if child[0] else child[1])",
                                         "walk_leaves_only"), "not only the leaves"),
    ("Vocabulary.allowed", _walk_variant(_WALK_ADD, """                found.extend(child[1])
                if t != DFA.DEAD:
                    todo.append((child, t))""", "walk_adds_before_the_step"), "alive after reading the child's byte"),
]


# ---------------------------------------------------------------- notebook 21: a rank's KV heads (minillm/check/parallel.py)

from minillm.check import parallel as check_parallel  # noqa: E402
from minillm.parallel import tensor_parallel


def _split_variant(old: str, new: str, label: str):
    return _variant(tensor_parallel.Split, old, new, label)


PARALLEL_PLANTED = [
    ("Split.kv_heads", _split_variant("first = self.rank * Hkv // self.world", "first = self.rank % Hkv", "kv_modulo"),
     "not rank % Hkv"),
    ("Split.kv_heads", _split_variant("if Hkv >= self.world:", "if True:", "kv_not_replicated"), "Hkv // N is 0"),
    ("Split.kv_heads", _split_variant("return slice(first, first + 1)", "return slice(0, Hkv)", "kv_all_heads"),
     "not every KV head"),
    ("Split.kv_heads", _split_variant("n = Hkv // self.world", "n = self.config.num_attention_heads // self.world",
                                      "kv_query_heads"), "not the query heads"),
]


# ---------------------------------------------------------------- notebook 11: a decode step's bytes (minillm/check/performance.py)
# (a lesson cell, not exported: the reference is the notebook's own decode_bytes, the mistakes planted in it)

from minillm.check import performance as check_performance  # noqa: E402


def _decode_bytes_variant(old: str, new: str, label: str):
    return notebook_function("11_roofline", "decode_bytes", check_performance, old, new, label)


PERFORMANCE_PLANTED = [("decode_bytes", _decode_bytes_variant(old, new, label), hint) for old, new, label, hint in [
    ("weights = nbytes * (L * layer + head)", "weights = nbytes * L * layer", "bytes_without_head", "the head: every"),
    ("+ head)", "+ 2 * head)", "bytes_embedding_and_head", "the embedding lookup reads one row"),
    ("head = config.vocab_size * h", "head = 0 if config.tie_word_embeddings else config.vocab_size * h",
     "bytes_tied_head_free", "a tied head IS the embedding table"),
    ("weights = nbytes * (", "weights = 8 * nbytes * (", "bytes_in_bits", "do not multiply by 8"),
    ("+ 2 * Hkv * D * h +", "+ 2 * H * D * h +", "bytes_kv_projections_full_width", "k and v have num_key_value_heads"),
    ("layer = H * D * h + 2 * Hkv * D * h + h * H * D", "layer = h * h + 2 * Hkv * D * h + h * h", "bytes_q_as_hidden",
     "not hidden_size in every model"),
    ("kv = nbytes * 2 * L", "kv = nbytes * L", "bytes_keys_only", "a key AND a value"),
    ("2 * L * Hkv * D * context", "2 * L * H * D * context", "bytes_cache_per_query_head", "not one per query head"),
    ("kv = nbytes * 2 * L * Hkv", "kv = nbytes * 2 * Hkv", "bytes_cache_one_layer", "has its own cache"),
    ("kv = nbytes * 2 * L * Hkv * D * context", "kv = 0", "bytes_without_cache", "they grow with `context`"),
]]


# ---------------------------------------------------------------- the reference passes

REFERENCE = {
    "contiguous_strides": tensor.contiguous_strides, "transpose": tensor.transpose, "expand": tensor.expand,
    "matmul": tensor.matmul, "causal_mask": attention.causal_mask, "attention_weights": attention.attention_weights,
    "scaled_dot_product_attention": attention.scaled_dot_product_attention, "rotate_half": rope.rotate_half,
    "rope_cos_sin": rope.rope_cos_sin, "apply_rope": rope.apply_rope, "rms_norm": layers.rms_norm,
    "MLP.forward": layers.MLP, "Attention.forward": model.Attention, "DecoderLayer.forward": model.DecoderLayer,
    "KVCache.update": kv_cache.KVCache, "gather_reference": paged_cache.gather_reference,
    "batch_layout": paged_cache.batch_layout, "fold_block": paged_attention.fold_block,
    "top_k_filter": sampling.top_k_filter,
    "top_p_filter": sampling.top_p_filter, "min_p_filter": sampling.min_p_filter,
    "quantize_int4": quant.quantize_int4, "dequantize_q4_1": quant.dequantize_q4_1,
    **LOADING_REFERENCE,
    **ENGINE_REFERENCE,
    **FIRST_REFERENCE,
    "accept_sampled": speculative.accept_sampled,
    "MultiLoRALinear.forward": lora.MultiLoRALinear,
    "decode_bytes": notebook_function("11_roofline", "decode_bytes", check_performance),
    "Split.kv_heads": tensor_parallel.Split,
    "Vocabulary.allowed": constrained.Vocabulary,
    "recurrent_gated_delta_rule": gated_delta.recurrent_gated_delta_rule,
    "route": moe.route, "experts_loop": moe.experts_loop,
}


def test_every_check_has_a_reference():
    assert set(REFERENCE) == set(check.CHECKS)


@pytest.mark.parametrize("name", list(REFERENCE))
def test_reference_passes(name, capsys):
    assert check.CHECKS[name](REFERENCE[name]) is True
    assert capsys.readouterr().out.strip() == f"PASS {name}"


# ---------------------------------------------------------------- planted mistakes fail with the hint


def rms_norm_in_input_dtype(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_without_eps(x, weight, eps):
    return layers.rms_norm(x, weight, 0.0)


def causal_mask_ignoring_start(T, S, start=0, device=None):
    return torch.ones(T, S, dtype=torch.bool).tril()


def causal_mask_off_by_one(T, S, start=0, device=None):
    return torch.ones(T, S, dtype=torch.bool).tril(start - 1)


def attention_weights_unscaled(q, k, mask=None, scale=None):
    return attention.attention_weights(q, k, mask, scale=1.0)


def sdpa_gqa_repeat(q, k, v, mask=None, scale=None):
    rep = q.shape[1] // k.shape[1]
    return attention.scaled_dot_product_attention(q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), mask, scale)


def rotate_half_interleaved(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_cos_sin_bf16_angles(positions, inv_freq, dtype=torch.float32):
    if positions.ndim == 1:
        positions = positions[None]
    freqs = positions[..., None].to(dtype) * inv_freq.to(dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope_minus(x, cos, sin):
    return x * cos[:, None] - rope.rotate_half(x) * sin[:, None]


def contiguous_strides_unreversed(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(strides)


def transpose_dropping_offset(t, dim0, dim1):
    view = tensor.transpose(t, dim0, dim1)
    return tensor.Tensor(t.storage, tensor.Layout(view.shape, view.stride(), 0))


def matmul_storage_order(a, b):
    if a.ndim != 2 or b.ndim != 2:
        return tensor.matmul(a, b)
    (m, k), n = a.shape, b.shape[1]
    out = [sum(a.storage[a.layout.offset + i * k + kk] * b.storage[b.layout.offset + kk * n + j] for kk in range(k))
           for i in range(m) for j in range(n)]
    return tensor.Tensor(tensor.Storage(out, a.dtype), tensor.Layout.contiguous((m, n)))


class MLPSiluOnUp(layers.MLP):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * torch.nn.functional.silu(self.up_proj(x)))


class AttentionWithoutRope(model.Attention):
    def forward(self, x, cos, sin, mask, cache=None, pos=0):
        return super().forward(x, torch.ones_like(cos), torch.zeros_like(sin), mask, cache, pos)


class PostNormLayer(model.DecoderLayer):
    def forward(self, x, cos, sin, mask, cache=None, pos=0):
        h = self.input_layernorm(x + self.self_attn(x, cos, sin, mask, cache, pos))
        return self.post_attention_layernorm(h + self.mlp(h))


class CacheReturningBuffer(kv_cache.KVCache):
    def update(self, pos, k, v):
        super().update(pos, k, v)
        return self.k, self.v


class CacheReturningCopies(kv_cache.KVCache):
    def update(self, pos, k, v):
        k, v = super().update(pos, k, v)
        return k.clone(), v.clone()


def top_k_zero_fill(logits, k):
    return logits.masked_fill(logits < logits.topk(k, -1).values[:, -1:], 0.0) if 0 < k < logits.shape[-1] else logits


def top_p_drops_crossing(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    remove_sorted = torch.softmax(sorted_logits, -1).cumsum(-1) > p
    remove_sorted[:, 0] = False
    return logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))


def min_p_absolute(logits, p):
    return logits.masked_fill(torch.softmax(logits, -1) < p, float("-inf"))


def gather_whole_blocks(cache, block_table, length):
    k = cache.k[block_table].reshape(-1, *cache.k.shape[2:]).transpose(0, 1)  # ignores length
    v = cache.v[block_table].reshape(-1, *cache.v.shape[2:]).transpose(0, 1)
    return k, v


def _fold_variant(old: str, new: str, label: str):
    return _variant(paged_attention.fold_block, old, new, label)


def layout_left_aligned(manager, seq_ids, T, device=None):
    right = paged_cache.batch_layout(manager, seq_ids, T, device=device)
    lengths = [manager.num_tokens(s) for s in seq_ids]
    S = max(lengths)
    gather = torch.tensor([[manager.slot(s, p) for p in range(L)] + [0] * (S - L) for s, L in zip(seq_ids, lengths)])
    return paged_cache.BatchLayout(right.slots, gather, right.attention_mask, right.positions, right.start_pos)


def int4_zeros_at_lo(w, group_size=32, name="weight"):
    q, scales, zeros = quant.quantize_int4(w, group_size, name)
    return q, scales, zeros - 8 * scales  # the group's minimum, not the value q = 8 stands for


def int4_sixteen_steps(w, group_size=32, name="weight"):
    N, K = w.shape
    wg = w.float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = (hi - lo) / 16
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(N, K), scales, lo + 8 * scales


def q4_1_adjacent_nibbles(raw, shape):
    b = raw.reshape(-1, 20)
    q = torch.stack([b[:, 4:] & 0x0F, b[:, 4:] >> 4], -1).reshape(-1, 32).float()  # q_2j low, q_2j+1 high
    d, m = (b[:, i:i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
    return (d * q + m).reshape(tuple(shape))


def _delta_variant(old: str, new: str, label: str):
    return _variant(gated_delta.recurrent_gated_delta_rule, old, new, label)


DELTA_PLANTED = [  # notebook 22's loop, one step changed each
    ("recurrent_gated_delta_rule", _delta_variant("S = S * g[:, :, t, None, None].exp()", "S = S", "delta_without_decay"),
     "decay the state first"),
    ("recurrent_gated_delta_rule", _delta_variant("correction = beta[:, :, t, None] * (v[:, :, t] - predicted)",
                                                  "correction = v[:, :, t] - predicted", "delta_without_beta"),
     "scale the error by beta_t"),
    ("recurrent_gated_delta_rule", _delta_variant("correction = beta[:, :, t, None] * (v[:, :, t] - predicted)",
                                                  "correction = beta[:, :, t, None] * v[:, :, t]", "running_sum"),
     "write the error"),
]


MOE_PLANTED = [  # notebook 23's router and loop, one step changed each
    ("route", _variant(moe.route, "    if norm_topk_prob:\n", "    if False:\n", "route_without_renormalising"),
     "renormalise the k kept weights"),
    ("route", _variant(moe.route, "probs = torch.softmax(F.linear(x, weight).float(), dim=-1)  # (N, E): every expert's share\n"
                                  "    top, experts = probs.topk(top_k, dim=-1)",
                       "top, experts = F.linear(x, weight).float().topk(top_k, dim=-1)\n"
                       "    top = torch.softmax(top, dim=-1)", "route_top_k_of_logits"), "softmax over ALL experts first"),
    ("experts_loop", _variant(moe.experts_loop, "y * weights[token, slot, None]", "y", "loop_unweighted"),
     "weight each expert's output"),
    ("experts_loop", _variant(moe.experts_loop, "y * weights[token, slot, None]", "y * weights[token, 0, None]",
                              "loop_first_slot"), "the one of the slot"),
]


PLANTED = [
    ("rms_norm", rms_norm_in_input_dtype, "did you accumulate in fp32?"),
    ("rms_norm", rms_norm_without_eps, "add eps inside the square root"),
    ("causal_mask", causal_mask_ignoring_start, "is the mask offset by the cache position?"),
    ("causal_mask", causal_mask_off_by_one, "off by one"),
    ("attention_weights", attention_weights_unscaled, "1/sqrt(D)"),
    ("scaled_dot_product_attention", sdpa_gqa_repeat, "repeat_interleave"),
    ("rotate_half", rotate_half_interleaved, "the two halves"),
    ("rope_cos_sin", rope_cos_sin_bf16_angles, "compute the angles in float32"),
    ("apply_rope", apply_rope_minus, "a plus sign"),
    ("contiguous_strides", contiguous_strides_unreversed, "reverse the list"),
    ("transpose", transpose_dropping_offset, "keep the layout's offset"),
    ("matmul", matmul_storage_order, "layout.position"),
    ("MLP.forward", MLPSiluOnUp, "SiLU goes on gate_proj"),
    ("Attention.forward", AttentionWithoutRope, "apply RoPE to q and k"),
    ("DecoderLayer.forward", PostNormLayer, "pre-norm"),
    ("KVCache.update", CacheReturningBuffer, "not the whole preallocated buffer"),
    ("KVCache.update", CacheReturningCopies, "not a view"),
    ("gather_reference", gather_whole_blocks, "the last block is only partly used"),
    ("batch_layout", layout_left_aligned, "padding goes on the LEFT"),
    ("fold_block", _fold_variant("state.l * rescale", "state.l", "fold_without_rescaling_l"), "rescale l too"),
    ("fold_block", _fold_variant("state.acc * rescale[..., None]", "state.acc", "fold_without_rescaling_acc"),
     "rescale acc too"),
    ("fold_block", _fold_variant("torch.exp(state.m - m_safe)", "torch.exp(m_safe - state.m)", "fold_inverted_rescale"),
     "which is at most 1 (not exp(m' - m))"),
    ("fold_block", _fold_variant("m = torch.maximum(state.m, scores.amax(-1))", "m = scores.amax(-1)",
                                 "fold_block_maximum_only"), "the larger of the old m and the block's own maximum"),
    ("fold_block", _fold_variant("m_safe = m.masked_fill(m == -math.inf, 0.0)", "m_safe = m", "fold_nan_when_masked"),
     "subtract 0 for it instead"),
    ("top_k_filter", top_k_zero_fill, "-inf, not 0"),
    ("top_p_filter", top_p_drops_crossing, "did you keep the token that crosses the threshold?"),
    ("min_p_filter", min_p_absolute, "p times the top token's probability"),
    ("quantize_int4", int4_zeros_at_lo, "lo + 8 * scale"),
    ("quantize_int4", int4_sixteen_steps, "divide by 15, not 16"),
    ("dequantize_q4_1", q4_1_adjacent_nibbles, "not q_{2j} and q_{2j+1}"),
    *LOADING_PLANTED,
    *ENGINE_PLANTED,
    *FIRST_PLANTED,
    *SPECULATIVE_PLANTED,
    *LORA_PLANTED,
    *PERFORMANCE_PLANTED,
    *PARALLEL_PLANTED,
    *STRUCTURED_PLANTED,
    *DELTA_PLANTED,
    *MOE_PLANTED,
]


@pytest.mark.parametrize("name, wrong, hint", PLANTED, ids=[f"{n}-{w.__name__}" for n, w, _ in PLANTED])
def test_planted_mistake_fails_with_hint(name, wrong, hint, capsys):
    assert check.CHECKS[name](wrong) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {name}"), out
    assert hint in out, out


def test_a_crash_is_reported_not_raised(capsys):
    assert check.causal_mask(lambda T, S, start=0, device=None: 1 / 0) is False
    assert "ZeroDivisionError" in capsys.readouterr().out


# ---------------------------------------------------------------- make_exercises on a small notebook


def test_stub_cell_keeps_signature_docstring_and_indentation():
    src = ('class Cache:\n    def update(self, pos):\n        """Doc."""\n        if pos < 0:\n'
           '            raise ValueError("pos")\n        ### BEGIN SOLUTION\n        return pos + 1\n'
           '        ### END SOLUTION\n\n\ndef f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n')
    out, stubs = make_exercises.stub_cell(src, "test")
    assert stubs == ["Cache.update", "f"]
    assert f'        raise NotImplementedError("exercise: implement Cache.update; {make_exercises.SEE_HINT}")' in out
    assert f'    raise NotImplementedError("exercise: implement f; {make_exercises.SEE_HINT}")' in out
    assert '"""Doc."""' in out and 'raise ValueError("pos")' in out and "return pos + 1" not in out
    with pytest.raises(make_exercises.ExerciseError):
        make_exercises.stub_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "test")


def test_check_names():
    assert make_exercises.check_name("KVCache.update") == "kv_cache_update"
    assert make_exercises.check_name("MLP.forward") == "mlp_forward"
    assert make_exercises.check_name("DecoderLayer.forward") == "decoder_layer_forward"
    assert make_exercises.check_name("top_p_filter") == "top_p_filter"
    assert make_exercises.check_name("MultiLoRALinear.forward") == "multi_lora_linear_forward"


def _write_reference(root: Path, body: str, doc: str = "Doc.") -> Path:
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Doubling\n", "Twice x: `2 * x`."]},
        {"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": [], "source": ["#| default_exp double"]},
        {"cell_type": "code", "execution_count": 2, "metadata": {},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": ["6\n"]}],
         "source": ["#| export\n", "def rms_norm(x):\n", f'    """{doc}"""\n', "    ### BEGIN SOLUTION\n",
                    f"    {body}\n", "    ### END SOLUTION\n"]},
        {"cell_type": "markdown", "metadata": {}, "source": ["<!-- exercise: hint rms_norm -->\n", "Twice x."]},
        {"cell_type": "code", "execution_count": 3, "metadata": {}, "outputs": [],
         "source": ["from minillm.double import rms_norm\n", "print(rms_norm(3))"]},
    ]
    path = root / "notebooks" / "01_double.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_make_exercises_writes_and_checks_a_small_project(tmp_path, capsys):
    (tmp_path / "notebooks").mkdir()
    _write_reference(tmp_path, "return 2 * x")
    assert make_exercises.main(["--check", "--root", str(tmp_path)]) == 1  # missing
    assert make_exercises.main(["--root", str(tmp_path)]) == 0
    assert make_exercises.main(["--check", "--root", str(tmp_path)]) == 0
    nb = json.loads((tmp_path / "exercises" / "01_double.ipynb").read_text())
    assert nb["metadata"]["minillm"] == {"exercise_of": "notebooks/01_double.ipynb", "stubs": ["rms_norm"]}
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert code[0].startswith("def rms_norm(x):") and "return 2 * x" not in code[0]
    assert code[1] == "from minillm import check\n\ncheck.rms_norm(rms_norm)"
    assert code[2] == "print(rms_norm(3))"  # the import of the notebook's own module is gone
    assert all(not c.get("outputs") and c["execution_count"] is None for c in nb["cells"] if c["cell_type"] == "code")
    _write_reference(tmp_path, "return x + x")  # only the solution changed: the exercise is the same
    assert make_exercises.main(["--check", "--root", str(tmp_path)]) == 0
    _write_reference(tmp_path, "return x + x", doc="Twice x.")
    capsys.readouterr()
    assert make_exercises.main(["--check", "--root", str(tmp_path)]) == 1
    assert "exercises/01_double.ipynb" in capsys.readouterr().out


# ---------------------------------------------------------------- no answers leak, every stub has a hint


def _defined(source: str) -> list[tuple[str, str]]:
    """(name, code) of each top-level def, class and `name = lambda` of a cell (not the rest: no plots)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, ast.get_source_segment(source, node, padded=True)))
            if node.decorator_list:  # the segment starts at `def`: put the decorators back
                out[-1] = (node.name, "\n".join("@" + ast.get_source_segment(source, d) for d in node.decorator_list)
                           + "\n" + out[-1][1])
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)
              and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            out.append((node.targets[0].id, ast.get_source_segment(source, node)))
    return out


def exercise_candidates(path: Path) -> tuple[dict, dict, list[tuple[list[str], list[tuple[str, object]]]]]:
    """Run an exercise's module cells and the definitions of its other cells (stubs in place).

    Returns the module namespace, the other cells' namespace and, for each check cell in order:
    (the stubs it checks, every (name, function or class) that the cells above it define).
    """
    ns, stubs = exec_notebook_code(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    extra = dict(ns)  # the other cells' definitions see the module's names, and do not shadow them in ns
    by_check = {make_exercises.check_name(s): s for s in stubs}
    seen: dict[str, object] = {}
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if src.startswith("from minillm import check"):
            names = [by_check[m] for m in __import__("re").findall(r"check\.(\w+)\(", src)]
            out.append((names, list(seen.items())))
            continue
        module = "module" in cell["metadata"].get("tags", [])
        for name, code in _defined(src):
            if not module:
                try:
                    exec(compile(code, f"{path.name}:{name}", "exec"), extra)
                except Exception:  # a class body or default that needs the cell's data: not a candidate
                    continue
            obj = (ns if module else extra).get(name)
            if callable(obj):
                seen[name] = obj
    return ns, extra, out


@contextlib.contextmanager
def _solved_except(spaces: list[dict], stubs: list[str], keep: str):
    """Every stub but `keep` replaced by the reference in the namespaces: a leak that needs the others shows."""
    tops = {s.split(".")[0] for s in stubs} - {keep.split(".")[0]}
    saved = [{t: space.get(t) for t in tops} for space in spaces]
    for space in spaces:
        for s in stubs:
            if s.split(".")[0] in tops and s in REFERENCE:
                space[s.split(".")[0]] = REFERENCE[s]
    try:
        yield
    finally:
        for space, old in zip(spaces, saved):
            space.update(old)


def find_leaks(path: Path) -> list[str]:
    """With its stubs in place every check fails (asserted), and the functions and classes defined
    above a check (module cells and the lesson's own cells) that pass it, with the notebook's other
    stubs solved (a leak that needs them shows too)."""
    ns, extra, checks = exercise_candidates(path)
    leaks = []
    for names, candidates in checks:
        for name in names:
            if name not in check.CHECKS:
                continue  # test_every_stub_raises_not_implemented names it
            stub = ns[name.split(".")[0]]
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert check.CHECKS[name](stub) is False, f"{path.name}: {name}'s check passes on the stub"
            assert "not implemented yet" in out.getvalue(), out.getvalue()
            stubs = [n for group, _ in checks for n in group]
            with _solved_except([ns, extra], stubs, name):
                for cand_name, obj in candidates:
                    if obj is stub:
                        continue
                    with contextlib.redirect_stdout(io.StringIO()):
                        if check.CHECKS[name](obj):
                            leaks.append(f"{cand_name} passes check.{make_exercises.check_name(name)}")
    return leaks


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_no_cell_above_a_check_passes_it(path):
    leaks = find_leaks(path)
    assert not leaks, f"{path.name}: cells above a check give its answer away (mark them, see make_exercises): {leaks}"


def test_the_leak_test_finds_a_leak(tmp_path):
    """A lesson cell that computes top_p_filter above its check (needing top_k_filter, solved) is found."""
    nb = json.loads((ROOT / "exercises" / "09_sampling.ipynb").read_text(encoding="utf-8"))
    at = next(i for i, c in enumerate(nb["cells"]) if "check.top_p_filter(top_p_filter)" in "".join(c["source"]))
    leak = inspect.getsource(sampling.top_p_filter).replace("def top_p_filter(", "def nucleus(")
    leak = leak.replace("    return logits.masked_fill(remove", "    top_k_filter(logits, 0)\n    return logits.masked_fill(remove")
    nb["cells"].insert(at - 3, {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                                "source": leak.splitlines(keepends=True)})
    path = tmp_path / "09_sampling.ipynb"
    path.write_text(json.dumps(nb))
    assert find_leaks(path) == ["nucleus passes check.top_p_filter"]


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_stub_has_one_collapsed_hint_between_it_and_its_check(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    for name in nb["metadata"]["minillm"]["stubs"]:
        call = f"check.{make_exercises.check_name(name)}({name.split('.')[0]})"
        at = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and call in "".join(c["source"]))
        stub = max(i for i, c in enumerate(cells[:at]) if f"exercise: implement {name};" in "".join(c["source"]))
        between = ["".join(c["source"]) for c in cells[stub + 1 : at]]
        assert all(c["cell_type"] == "markdown" for c in cells[stub + 1 : at])
        assert len(between) >= 1 and all(b.startswith("<details><summary>Hint</summary>") for b in between), between
        assert make_exercises.SEE_HINT in "".join(cells[stub]["source"])
        assert "### BEGIN SOLUTION" not in "".join(between) and "exercise:" not in "".join(between)
    text = path.read_text(encoding="utf-8")
    assert "hint above" not in text and "# exercise:" not in text and "<!-- exercise:" not in text


def test_make_exercises_markers(tmp_path):
    """drop, collapse, after check NAME[, collapsed] and hint NAME, on a small project; the errors name the cell."""
    (tmp_path / "notebooks").mkdir()

    def md(*lines):
        return {"cell_type": "markdown", "metadata": {}, "source": "\n".join(lines)}

    def code(*lines):
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "\n".join(lines)}

    def write(cells):
        path = tmp_path / "notebooks" / "01_double.ipynb"
        cells = [code("#| default_exp double"), *cells]
        path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        return path

    lesson = [
        md("# Doubling"),
        code("# exercise: after check rms_norm, collapsed", "def by_hand(x):", "    return 2 * x", "y = by_hand(3)"),
        code("# exercise: drop", "assert by_hand(1) == 2"),
        code("# exercise: collapse", "twice = 2"),
        code("#| export", "def rms_norm(x):", "    ### BEGIN SOLUTION", "    return twice * x", "    ### END SOLUTION"),
        md("<!-- exercise: hint rms_norm -->", "Twice x."),
        code("# exercise: after check rms_norm", "print(y)"),
    ]
    nb = make_exercises.exercise_notebook(write(lesson), tmp_path)
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert not any("exercise:" in s and "implement" not in s for s in sources), sources
    i = sources.index("from minillm import check\n\ncheck.rms_norm(rms_norm)")
    assert sources[i - 1] == "<details><summary>Hint</summary>\n\nTwice x.\n\n</details>"
    assert sources[i - 2].startswith("def rms_norm(x):") and make_exercises.SEE_HINT in sources[i - 2]
    assert sources[i + 1].startswith("def by_hand(x):") and sources[i + 2] == "print(y)"  # moved, in order
    hidden = [s for s, c in zip(sources, nb["cells"]) if c["metadata"].get("jupyter", {}).get("source_hidden")]
    assert hidden == ["twice = 2", sources[i + 1]]
    assert not any("assert by_hand" in s for s in sources)  # dropped

    for cells, message in [
        ([c for c in lesson if "hint" not in "".join(c["source"])], "has no hint cell"),
        (lesson[:2] + lesson[3:5] + [md("<!-- exercise: hint rms_norm -->", "x")] + lesson[5:], "a second hint"),
        (lesson[:3] + [code("# exercise: drop", "#| export", "z = 1")] + lesson[3:], "on an exported cell"),
        (lesson + [code("# exercise: after check nothing", "1")], "not a stub above"),
        ([lesson[0], code("# exercise: after check rms_norm", "y = 3"), code("print(y)")] + lesson[3:6], "reads `y`"),
    ]:
        with pytest.raises(make_exercises.ExerciseError, match=message):
            make_exercises.exercise_notebook(write(cells), tmp_path)


# ---------------------------------------------------------------- grading a folder of submissions


def test_grade_a_folder_of_two_students(tmp_path, capsys):
    import shutil

    subs = tmp_path / "submissions"
    (subs / "alice").mkdir(parents=True)
    (subs / "bob" / "work").mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / "09_sampling.ipynb", subs / "alice" / "09_sampling.ipynb")  # solved
    shutil.copy(ROOT / "exercises" / "09_sampling.ipynb", subs / "bob" / "work" / "my_copy.ipynb")  # stubs
    (subs / "bob" / ".ipynb_checkpoints").mkdir()
    shutil.copy(ROOT / "notebooks" / "09_sampling.ipynb", subs / "bob" / ".ipynb_checkpoints" / "x.ipynb")  # ignored
    (subs / "carol.py").write_text("import torch\n\ndef causal_mask(T, S, start=0, device=None):\n"
                                   "    return torch.ones(T, S, dtype=torch.bool).tril()\n")  # a loose file: student carol
    assert check.grade(subs) == {"alice": {"09_sampling": (3, 3)}, "bob": {"09_sampling": (0, 3)},
                                 "carol": {"carol": (0, 1)}}
    grades = tmp_path / "grades.csv"
    assert check.main(["grade", str(subs), "--csv", str(grades)]) == 0
    out = capsys.readouterr().out
    assert "PASS" not in out and "FAIL" not in out  # the table only
    table = [line.split() for line in out.splitlines()]
    assert table[0] == ["student", "09_sampling", "carol", "total"]
    assert table[1:4] == [["alice", "3/3", "-", "3/3"], ["bob", "0/3", "-", "0/3"], ["carol", "-", "0/1", "0/1"]]
    with open(grades, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["student"] for r in rows] == ["alice", "bob", "carol"]
    assert (rows[0]["09_sampling passed"], rows[0]["09_sampling total"], rows[0]["passed"], rows[0]["total"]) == ("3", "3", "3", "3")
    assert (rows[1]["09_sampling passed"], rows[1]["total"], rows[1]["carol passed"]) == ("0", "3", "")
    assert check.main(["grade", str(tmp_path / "nothing")]) == 2


def test_grade_runs_as_a_module(tmp_path):
    import shutil

    (tmp_path / "dan").mkdir()
    shutil.copy(ROOT / "exercises" / "08_kv_cache.ipynb", tmp_path / "dan")
    result = subprocess.run([sys.executable, "-m", "minillm.check", "grade", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["student", "08_kv_cache", "total", "dan", "0/1", "0/1"]


# ---------------------------------------------------------------- exploration tasks (minillm/check/explore.py)
# A question answered by a measurement and a sentence: a top-level solution region in the reference,
# a stub in the exercise, a check that computes the reference number itself and names known slips.

from minillm.check import explore as check_explore  # noqa: E402

EXPLORE_REFERENCE = {  # name -> (the reference value, a wrong value, a word of the feedback it gets)
    "transpose_copy_bytes": ((0, 2359296), (0, 589824), "numel() x element_size()"),
    "gqa_saved_bytes_per_token": (46080, 36864, "SmolLM2's from its config"),
    "kv_crossover_tokens": (80409, 160818, "a key AND a value"),
    "tail": (check_explore.tail(), (49152 - check_explore.tail()[0], 0.0425), "above the threshold"),
    "int4_bits_per_weight": (5.0, 4.0, "scales and zeros too"),
    "broken_tokens": (313, 49152 - 313, "DO decode alone"),
    "slow_pairs_theta_10k": (7, 12, "SmolLM2's own rope_theta"),
    "mlp_share_of_model": (check_explore.mlp_share_of_model(), 0.7498, "the whole model"),
    "sequences_that_fit": ((11, 306), (11, 310), "whole blocks"),
    "gather_copy_mib": (1440.0, 720.0, "keys and values"),
    "attention_crossover_tokens": (3892, 11674, "GQA shares keys and values in memory"),
    "qwen7b_bytes": (check_explore.qwen7b_bytes(), (check_explore.qwen7b_bytes(q8=1.0, q4=0.5)[0],
                                                    check_explore.qwen7b_bytes()[1]), "float16 scale"),
    "chinese_share": (check_explore.chinese_share(), (check_explore.chinese_share()[0], 0.0), "byte alphabet"),
    "lookup_forwards_saved": (validate_speculative.lookup_forwards_saved(), 1 - validate_speculative.lookup_forwards_saved(),
                              "share of forwards run"),
    "adapter_megabytes": (check_lora.adapter_megabytes(), check_lora.adapter_megabytes(gqa=False), "3 KV heads"),
    "h200_crossover_batch": (452, 207, "the activations' bytes"),
    "kv_bytes_per_token_tp4": (check_parallel.kv_bytes_per_token_tp4(),
                               check_parallel.kv_bytes_per_token_tp4(replicate=False), "whole KV heads"),
    "state_crossover_tokens": (1590, 822, "float32"),
    "experts_touched_16": (check_moe.experts_touched(), check_moe.experts_touched(per_token=1 / 256), "not 1"),
    "allowed_after_twelve": (check_structured.allowed_after_twelve(),
                             check_structured.allowed_after_twelve(maximum=False), "may not pass it"),
}
MEASURED = {"speedup_16", "text_share"}  # measurements on this machine: test_explorations_accept_plausible_numbers


def test_every_exploration_has_a_reference():
    assert set(EXPLORE_REFERENCE) == (set(check_explore.EXPLORE) | set(validate_speculative.EXPLORE) | set(check_lora.EXPLORE)
                                      | set(check_parallel.EXPLORE) | set(check_structured.EXPLORE)
                                      | set(check_linear_attention.EXPLORE) | set(check_moe.EXPLORE)
                                      | set(check_performance.EXPLORE))
    assert MEASURED == set(check_engine.EXPLORE)
    assert set(check.EXPLORE) == set(EXPLORE_REFERENCE) | MEASURED  # one registry
    for name, explore in check.EXPLORE.items():
        assert getattr(check, f"explore_{name}") is explore
        assert f"explore_{name}" in check.__all__
    in_notebooks = {n for p in EXERCISES for n in json.loads(p.read_text(encoding="utf-8"))["metadata"]["minillm"].get("explore", [])}
    assert in_notebooks == set(check.EXPLORE)


def test_exploration_references_are_the_numbers_the_notebooks_print():
    assert check_explore.transpose_copy_bytes() == (0, 1024 * 9 * 64 * 4)
    # notebook 22: 18 layers x (6144 x 3 x 2 bytes + 16 x 128 x 128 x 4) over 6 layers x 2 x 2 x 256 x 2 bytes a token
    assert check_linear_attention.state_crossover_tokens() == -(-18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4) // (6 * 2 * 2 * 256 * 2))
    assert check_moe.experts_touched() == pytest.approx(101.96, abs=0.01)  # notebook 23: 256 x (1 - (248/256)^16)
    assert check_explore.gqa_saved_bytes_per_token() == 2 * 30 * 64 * 2 * (9 - 3)
    assert check_explore.kv_crossover_tokens() == 80409  # 494,032,768 bf16 parameters / 12 KiB per token
    assert check_explore.int4_bits_per_weight() == 5.0
    assert check_explore.broken_tokens() == 313  # of SmolLM2's 49,152: fragments of multi-byte characters
    assert check_explore.slow_pairs() == 7 and check_explore.slow_pairs(100_000.0) == 12  # notebook 03's first_slow = 20
    assert abs(check_explore.mlp_share_of_model() - 30 * 3 * 576 * 1536 / 134_515_008) < 1e-9
    assert check_explore.sequences_that_fit() == (2**31 // (8192 * 23040), 2**31 // (19 * 16 * 23040))
    assert check_explore.gather_copy_mib() == 8 * 4096 * 2 * 30 * 3 * 64 * 4 / 2**20  # = 1440
    assert check_explore.attention_crossover_tokens() == -(-(30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
                                                             + 49152 * 576) // (2 * 30 * 9 * 64))
    smol_file, smol_float = check_explore.qwen7b_bytes(config="SmolLM2-135M-Instruct")
    assert smol_file == 96_576_768 and smol_float == 4 * 134_515_008  # the embedded file's tensor bytes, exactly
    qwen, smol = check_explore.chinese_share()
    assert 0.15 < qwen < 0.19 and 0.001 < smol < 0.002  # 25,511 of 151,643 and 80 of 49,152
    assert 0.5 < validate_speculative.lookup_forwards_saved() < 0.95  # the answer copies the passage
    assert check_performance.crossover_batch() == 452 and check_performance.crossover_batch(nbytes=4) is None
    assert check_lora.adapter_megabytes() == pytest.approx(32 * 30 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536)) * 4 / 1e6)
    count, mass = check_explore.tail()
    assert abs(count - 48816) <= 250 and abs(mass - 0.0425) <= 0.002


@pytest.mark.parametrize("name", list(EXPLORE_REFERENCE))
def test_exploration_check_passes_the_reference_and_fails_a_slip(name, capsys):
    good, wrong, hint = EXPLORE_REFERENCE[name]
    explore = check.EXPLORE[name]
    assert explore(good) is True
    out = capsys.readouterr().out
    assert out.startswith(f"PASS explore_{name}") and "one sentence" in out
    assert explore(wrong) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL explore_{name}") and hint in out, out
    assert str(good) not in out.replace(str(wrong), "")  # the feedback never gives the answer away
    assert explore(None) is False  # the stub's value, or no answer at all
    assert "FAIL" in capsys.readouterr().out


def test_exploration_tolerances_are_stated_and_kept(capsys):
    assert check.explore_kv_crossover_tokens(80409 * 1.009) is True  # within 1%
    assert check.explore_kv_crossover_tokens(80409 * 1.02) is False
    assert check.explore_int4_bits_per_weight(5.009) is True and check.explore_int4_bits_per_weight(5.02) is False
    assert check.explore_gqa_saved_bytes_per_token(46081) is False  # bytes: exact
    assert check.explore_gqa_saved_bytes_per_token(torch.tensor(46080)) is True  # a 0-d tensor is a number
    assert check.explore_tail([48816, 0.0425]) is True and check.explore_tail((48816, 0.05)) is False
    capsys.readouterr()


EXPLORED = [p for p in EXERCISES if json.loads(p.read_text(encoding="utf-8"))["metadata"]["minillm"].get("explore")]


def test_every_exercise_notebook_has_an_exploration():
    assert EXPLORED == EXERCISES


@pytest.mark.parametrize("path", EXPLORED, ids=lambda p: p.stem)
def test_exploration_is_stubbed_in_the_exercise_and_passes_in_the_reference(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = [("".join(c["source"]), c) for c in nb["cells"]]
    reference = json.loads((ROOT / nb["metadata"]["minillm"]["exercise_of"]).read_text(encoding="utf-8"))
    ref_out = {"".join(c["source"]): "".join("".join(o.get("text", "")) for o in c.get("outputs", []))
               for c in reference["cells"] if c["cell_type"] == "code"}
    assert "SOLUTION" not in path.read_text(encoding="utf-8")  # code and markdown regions both replaced
    for name in nb["metadata"]["minillm"]["explore"]:
        assert callable(getattr(check, f"explore_{name}", None)), f"{path.name}: no check.explore_{name}"
        stub = next(i for i, (s, _) in enumerate(cells) if f"exercise: compute {name}; {make_exercises.SEE_HINT}" in s)
        with pytest.raises(NotImplementedError, match=f"exercise: compute {name}"):  # the student's cell, as given
            exec(compile(cells[stub][0], f"{path.name}:{name}", "exec"), {"__name__": "__main__"})
        if name in MEASURED:
            continue  # a measurement on this machine: its own tests
        hint, call, answer = cells[stub + 1], cells[stub + 2], cells[stub + 3]
        assert hint[1]["cell_type"] == "markdown" and hint[0].startswith("<details><summary>Hint</summary>")
        assert f"check.explore_{name}({name})" in call[0] and not call[0].startswith("from minillm import check")
        assert answer[1]["cell_type"] == "markdown" and make_exercises.YOUR_ANSWER in answer[0]
        assert f"PASS explore_{name}" in ref_out[call[0]], f"{path.name}: the reference's check of {name} did not pass"


def test_make_exercises_explorations(tmp_path):
    """A top-level solution region becomes a stub named by its answer, with its hint; markdown answers go too."""
    (tmp_path / "notebooks").mkdir()

    def md(*lines):
        return {"cell_type": "markdown", "metadata": {}, "source": "\n".join(lines)}

    def code(*lines):
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "\n".join(lines)}

    lesson = [
        code("#| default_exp double"),
        code("#| export", "def rms_norm(x):", "    ### BEGIN SOLUTION", "    return 2 * x", "    ### END SOLUTION"),
        md("<!-- exercise: hint rms_norm -->", "Twice x."),
        md("### Explore: how big?"),
        code("import math", "### BEGIN SOLUTION", "size = rms_norm(21)", "answer = size", "### END SOLUTION", "print(answer)"),
        md("<!-- exercise: hint answer -->", "Call it."),
        code("# checked", "check.explore_answer(answer)"),
        md("**Your explanation:**", "", "<!-- BEGIN SOLUTION -->", "Because 42.", "<!-- END SOLUTION -->"),
    ]

    def build(cells):
        path = tmp_path / "notebooks" / "01_double.ipynb"
        path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        return make_exercises.exercise_notebook(path, tmp_path)

    nb = build(lesson)
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert nb["metadata"]["minillm"]["stubs"] == ["rms_norm"] and nb["metadata"]["minillm"]["explore"] == ["answer"]
    i = sources.index(f'import math\nraise NotImplementedError("exercise: compute answer; {make_exercises.SEE_HINT}")'
                      "\nprint(answer)")
    assert sources[i + 1] == "<details><summary>Hint</summary>\n\nCall it.\n\n</details>"
    assert sources[i + 2] == "# checked\ncheck.explore_answer(answer)"  # the reference's own check cell, no generated one
    assert sources[i + 3] == f"**Your explanation:**\n\n{make_exercises.YOUR_ANSWER}"
    assert any(s.startswith("**Exercise notebook.**") and "Explore" in s and "`answer`" in s for s in sources)
    assert not any("42" in s or "SOLUTION" in s for s in sources)
    for cells, message in [
        ([c for c in lesson if "hint answer" not in "".join(c["source"])], "exploration answer has no hint"),
        (lesson[:4] + [code("### BEGIN SOLUTION", "print(1)", "### END SOLUTION")] + lesson[5:], "assigns no name"),
        (lesson[:7] + [md("<!-- BEGIN SOLUTION -->", "x")], "no matching END"),
        (lesson[:4] + [code("#| export", "### BEGIN SOLUTION", "answer = 1", "### END SOLUTION")] + lesson[5:],
         "outside a function"),  # an exported cell is a lesson's module: no explorations there
    ]:
        with pytest.raises(make_exercises.ExerciseError, match=message):
            build(cells)


# ---------------------------------------------------------------- check_path: a definition that a later import rebinds


def test_check_path_checks_the_notebooks_own_definition_when_an_import_rebinds_it(capsys):
    """notebooks/10_generate.ipynb's `api` cell imports the package's stream over the notebook's own."""
    assert check.check_path(ROOT / "notebooks" / "10_generate.ipynb") == (2, 2)
    out = capsys.readouterr().out
    assert "PASS stream" in out and "PASS StopStrings.push" in out
    assert check.check_path(ROOT / "exercises" / "10_generate.ipynb") == (0, 3)  # greedy_decode too
    assert "FAIL stream: not implemented yet" in capsys.readouterr().out


def test_check_path_a_module_whose_function_is_rebound_by_an_import(tmp_path, capsys):
    student = tmp_path / "student.py"
    student.write_text("import torch\n\ndef causal_mask(T, S, start=0, device=None):\n"
                       "    return torch.ones(T, S, dtype=torch.bool).tril()\n\n"  # ignores start: wrong
                       "from minillm.model.attention import causal_mask\n")  # the package's, correct, over it
    assert check.check_path(student) == (0, 1)
    assert "offset by the cache position" in capsys.readouterr().out
