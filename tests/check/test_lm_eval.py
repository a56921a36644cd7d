"""lm-evaluation-harness in-process (minillm/check/lm_eval.py), held to lm-eval's own `hf` backend;
and lm-eval's `local-completions` model against `minillm serve`, held to the in-process run.

Both run lm-eval's evaluator on the same model, the embedded SmolLM2-135M-Instruct (transformers
dequantizes the same GGUF to float32, minillm loads it in float32), over the three local tasks of
data/lm-eval/ (multiple choice, greedy generation, rolling loglikelihood; 12 capitals), offline: the
hub variables are set, the datasets cache is a temporary folder and any network connection fails
except to 127.0.0.1, where the server runs.

Tolerance: TOL = 1e-3 on each request's loglikelihood (a sum over up to ~15 tokens, or a whole
sentence for the rolling task). Both are float32 on the CPU but with different kernels and
summation orders (minillm's attention and matmuls against transformers' eager attention), so the
sums differ in the last bits: measured at most 2.3e-5. A token scored in the wrong place moves a
sum by whole nats (the planted off-by-one below: > 1). Everything discrete is held equal: the
requests, each is_greedy flag, acc and acc_norm, the generated texts and exact_match.

Served: lm-eval's `local-completions` (its OpenAI legacy-completions client) sends each loglikelihood
request as token ids with `echo: true, logprobs: 1, max_tokens: 1` and reads the prompt's
`token_logprobs`/`top_logprobs` past the context, and each generation as ids with `stop` and
`temperature: 0`. It tokenizes through the server itself (its `remote` tokenizer, found by itself from
GET /tokenizer_info, with POST /tokenize and /detokenize). Same TOL against the in-process run: both are
minillm's float32 model, but the server scores a prompt in the engine's prefill (paged KV cache, packed
batch) where MiniLLM runs LLM.prompt_logprobs: measured at most 3.0e-5. The served run takes about
15 s with one thread.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from support import ROOT
from minillm.serve.server import BackgroundServer, create_app
from minillm.weights.embedded import embedded_gguf_path

TASKS = ["minillm_capitals", "minillm_capitals_gen", "minillm_capitals_rolling"]
TOL = 1e-3  # per request's loglikelihood; see the docstring
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class Lazy(dict):
    """A dict whose values are made on first use: a test that needs one backend's run does not wait for the other's."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = value = self.make(key)
        return value


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The hub variables set (and read, where datasets was imported before), the datasets cache in a
    temporary folder, the repository root as working directory (the tasks' data_files are relative
    to it), and every socket connection refused and recorded, except to this machine's loopback."""
    cache = tmp_path_factory.mktemp("datasets")
    attempts = []

    def only_loopback(connect):
        def guarded(sock, address, *args):
            if isinstance(address, tuple) and address[0] in LOOPBACK:
                return connect(sock, address, *args)
            attempts.append(address)
            raise OSError(f"network access during an offline evaluation: {address}")
        return guarded

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(cache)}.items():
            patch.setenv(name, value)
        import datasets.config
        import huggingface_hub.constants

        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(socket.socket, "connect", only_loopback(socket.socket.connect))
        patch.setattr(socket.socket, "connect_ex", only_loopback(socket.socket.connect_ex))
        patch.chdir(ROOT)
        yield {"cache": cache, "attempts": attempts}


def make_lm(name: str):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm.check.lm_eval import MiniLLM

    if name == "minillm":
        return MiniLLM()
    path = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)


@pytest.fixture(scope="module")
def lms(offline):
    return Lazy(make_lm)  # "minillm" and "hf", each loaded when a test first needs it


def evaluate(lm, tasks, limit=None) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    task_dict = TaskManager(include_path=str(ROOT / "data" / "lm-eval")).load(tasks)  # as simple_evaluate loads them
    return evaluator.evaluate(lm=lm, task_dict=task_dict, limit=limit, log_samples=True)


@pytest.fixture(scope="module")
def runs(lms, offline) -> dict:
    return Lazy(lambda name: evaluate(lms[name], TASKS))


@pytest.fixture(scope="module")
def served(lms, offline):
    """lm-eval's local-completions model against minillm's server on 127.0.0.1 (the in-process LM's model,
    in the server's own engine), its tokenizer backend left to lm-eval to choose: the run, its time."""
    from lm_eval.api.registry import get_model

    background = BackgroundServer(create_app(lms["minillm"].llm, model_name="smollm2", num_blocks=256))
    try:
        start = time.monotonic()
        lm = get_model("local-completions")(base_url=background.url + "/v1/completions", model="smollm2",
                                            max_retries=1)
        run = evaluate(lm, TASKS)
        yield {"url": background.url, "lm": lm, "run": run, "seconds": time.monotonic() - start}
    finally:
        background.stop()


def disagreements(ours: list[dict], hf: list[dict], tol: float = TOL) -> tuple[list[str], float]:
    """Where minillm's samples differ from hf's (same docs): the requests, a loglikelihood beyond tol,
    an is_greedy flag, a generated text; and the largest |Δ loglikelihood| seen."""
    found, worst = [], 0.0
    by_doc = {sample["doc_id"]: sample for sample in hf}
    for sample in ours:
        reference = by_doc[sample["doc_id"]]
        if sample["arguments"] != reference["arguments"]:
            found.append(f"doc {sample['doc_id']}: requests {sample['arguments']} != {reference['arguments']}")
        for (got,), (want,) in zip(sample["resps"], reference["resps"], strict=True):
            if isinstance(want, str):  # generate_until: the same text
                if got != want:
                    found.append(f"doc {sample['doc_id']}: generated {got!r}, hf {want!r}")
                continue
            (got_ll, got_greedy), (want_ll, want_greedy) = (got, want) if isinstance(want, tuple) else ((got, None),
                                                                                                      (want, None))
            worst = max(worst, abs(got_ll - want_ll))
            if abs(got_ll - want_ll) > tol or got_greedy != want_greedy:
                found.append(f"doc {sample['doc_id']}: ({got_ll}, {got_greedy}) != hf ({want_ll}, {want_greedy})")
    return found, worst


def assert_agree(ours: list[dict], reference: list[dict], label: str) -> None:
    """The same 12 requests with the same answers, every loglikelihood within TOL; prints the worst."""
    assert len(ours) == len(reference) == 12
    found, worst = disagreements(ours, reference)
    print(f"{label}: max |Δ loglikelihood| = {worst:.2e}")
    assert found == [] and worst <= TOL, label


def assert_metrics_equal(ours: dict, reference: dict) -> None:
    """Accuracy and exact match equal; the rolling task's perplexities within 1e-4."""
    for task, metric in [("minillm_capitals", "acc,none"), ("minillm_capitals", "acc_norm,none"),
                         ("minillm_capitals_gen", "exact_match,none")]:
        assert ours[task][metric] == reference[task][metric], (task, metric)
    for metric in ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"]:
        assert ours["minillm_capitals_rolling"][metric] == pytest.approx(reference["minillm_capitals_rolling"][metric],
                                                                         rel=1e-4)


@pytest.mark.parametrize("task", TASKS)
def test_every_request_agrees_with_the_hf_backend(runs, task):
    assert_agree(runs["minillm"]["samples"][task], runs["hf"]["samples"][task], task)


def test_the_metrics_are_equal(runs):
    ours = runs["minillm"]["results"]
    assert_metrics_equal(ours, runs["hf"]["results"])
    assert 0 < ours["minillm_capitals"]["acc,none"] < 1  # the task separates right from wrong answers
    assert 0 < ours["minillm_capitals_gen"]["exact_match,none"] < 1


def test_the_greedy_flags_are_not_all_alike(runs):  # is_greedy is compared on both values, not only False
    flags = [resp[0][1] for sample in runs["minillm"]["samples"]["minillm_capitals"] for resp in sample["resps"]]
    assert True in flags and False in flags


def test_a_planted_off_by_one_in_the_continuation_split_fails(lms, runs):
    from minillm.check.lm_eval import MiniLLM

    class OffByOne(MiniLLM):  # the split one token early: the context's last token scored, the last one lost
        def _score(self, context, continuation):
            return super()._score(context[:-1], context[-1:] + continuation[:-1])

    planted = evaluate(OffByOne(lms["minillm"].llm), ["minillm_capitals"], limit=2)
    found, worst = disagreements(planted["samples"]["minillm_capitals"], runs["hf"]["samples"]["minillm_capitals"])
    assert len(found) == 8 and worst > 1  # every choice of both docs


def test_the_evaluation_touched_no_network(runs, offline):
    assert offline["attempts"] == []
    assert any(offline["cache"].iterdir())  # the local JSONL went through datasets, into the temporary cache


@pytest.mark.parametrize("task", TASKS)
def test_local_completions_against_the_server_agrees_with_the_in_process_lm(served, runs, task):
    assert_agree(served["run"]["samples"][task], runs["minillm"]["samples"][task],
                 f"{task}: served vs in-process ({served['seconds']:.0f} s served)")


def test_the_served_metrics_equal_the_in_process_ones(served, runs):
    assert served["lm"].tokenizer_backend == "remote"  # lm-eval found /tokenizer_info and tokenized through the server
    assert_metrics_equal(served["run"]["results"], runs["minillm"]["results"])


def test_the_served_run_agrees_with_the_hf_backend_too(served, runs):
    for task in TASKS:
        assert_agree(served["run"]["samples"][task], runs["hf"]["samples"][task], f"{task}: served vs hf")


def test_lm_evals_cli_runs_local_completions_against_the_server(served, tmp_path, monkeypatch):
    """The command docs/eval.md shows, through lm-eval's CLI in-process (minillm.check.lm_eval.main is that
    CLI): its samples are the ones above."""
    from minillm.check import lm_eval as module

    monkeypatch.setattr(sys, "argv", ["minillm.check.lm_eval"])
    module.main(["--model", "local-completions", "--model_args",
                 f"base_url={served['url']}/v1/completions,model=smollm2,max_retries=1", "--include_path",
                 "data/lm-eval", "--tasks", "minillm_capitals", "--limit", "2", "--output_path", str(tmp_path),
                 "--log_samples"])
    (samples,) = tmp_path.rglob("samples_minillm_capitals_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    logged = [{**s, "resps": [[(float(ll), greedy == "True")] for (ll, greedy), in s["resps"]],
               "arguments": [tuple(request.values()) for request in s["arguments"].values()]} for s in logged]
    found, _ = disagreements(logged, served["run"]["samples"]["minillm_capitals"], tol=1e-6)
    assert len(logged) == 2 and found == []


def test_lm_evals_cli_runs_minillm_by_name(tmp_path, lms, runs, monkeypatch):
    """`python -m minillm.check.lm_eval` (main) is lm-eval's CLI with `--model minillm` registered
    (docs/eval.md), run here in-process on the model already loaded; its answers are the ones above."""
    from minillm.check import lm_eval as module

    monkeypatch.setattr(module, "load", lambda *args, **kwargs: lms["minillm"].llm)
    monkeypatch.setattr(sys, "argv", ["minillm.check.lm_eval"])
    module.main(["--model", "minillm", "--include_path", "data/lm-eval", "--tasks", "minillm_capitals",
                 "--limit", "2", "--output_path", str(tmp_path), "--log_samples"])  # lm-eval's default device: cuda:0
    (samples,) = tmp_path.rglob("samples_minillm_capitals_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]  # (loglikelihood, is_greedy) as strings
    logged = [{**s, "resps": [[(float(ll), greedy == "True")] for (ll, greedy), in s["resps"]],
               "arguments": [tuple(request.values()) for request in s["arguments"].values()]} for s in logged]
    found, _ = disagreements(logged, runs["minillm"]["samples"]["minillm_capitals"], tol=1e-6)
    assert len(logged) == 2 and found == []


def test_the_module_refuses_what_it_does_not_do(lms):
    from minillm.check.lm_eval import sampling_params

    with pytest.raises(ValueError, match="num_beams"):
        sampling_params({"do_sample": False, "num_beams": 4})
    assert sampling_params({"do_sample": False, "temperature": 0.0}).greedy
    assert sampling_params({"do_sample": True, "temperature": 0.7, "seed": 1}).temperature == 0.7
    ours, hf = lms["minillm"], lms["hf"]
    assert (ours.eot_token_id, ours.prefix_token_id, ours.max_length) == (hf.eot_token_id, hf.prefix_token_id,
                                                                            hf.max_length)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages)


def test_the_package_runs_without_lm_eval():
    """Importing minillm (its CLI and checker too) never imports lm-eval; without lm-eval installed,
    the module says what to install."""
    code = ("import sys; import minillm, minillm.api, minillm.check, minillm.__main__\n"
            "assert 'lm_eval' not in sys.modules, 'the runtime imported lm_eval'\n"
            "sys.modules['lm_eval'] = None  # as if not installed\n"
            "try:\n    import minillm.check.lm_eval\nexcept ImportError as error:\n    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pip install lm-eval==0.4.13" in result.stdout
