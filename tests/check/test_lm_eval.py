"""lm-evaluation-harness in-process (minillm/check/lm_eval.py), held to lm-eval's own `hf` backend.

Both run lm-eval's evaluator on the same model, the embedded SmolLM2-135M-Instruct (transformers
dequantizes the same GGUF to float32, minillm loads it in float32), over the three local tasks of
data/lm-eval/ (multiple choice, greedy generation, rolling loglikelihood; 12 capitals), offline: the
hub variables are set, the datasets cache is a temporary folder and any network connection fails.

Tolerance: TOL = 1e-3 on each request's loglikelihood (a sum over up to ~15 tokens, or a whole
sentence for the rolling task). Both are float32 on the CPU but with different kernels and
summation orders (minillm's attention and matmuls against transformers' eager attention), so the
sums differ in the last bits: measured at most 2.3e-5. A token scored in the wrong place moves a
sum by whole nats (the planted off-by-one below: > 1). Everything discrete is held equal: the
requests, each is_greedy flag, acc and acc_norm, the generated texts and exact_match.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from support import ROOT
from minillm.weights.embedded import embedded_gguf_path

TASKS = ["minillm_capitals", "minillm_capitals_gen", "minillm_capitals_rolling"]
TOL = 1e-3  # per request's loglikelihood; see the docstring
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The hub variables set (and read, where datasets was imported before), the datasets cache in a
    temporary folder, the repository root as working directory (the tasks' data_files are relative
    to it), and every socket connection refused and recorded."""
    cache = tmp_path_factory.mktemp("datasets")
    attempts = []

    def refuse(sock, address, *args):
        attempts.append(address)
        raise OSError(f"network access during an offline evaluation: {address}")

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(cache)}.items():
            patch.setenv(name, value)
        import datasets.config
        import huggingface_hub.constants

        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket.socket, "connect_ex", refuse)
        patch.chdir(ROOT)
        yield {"cache": cache, "attempts": attempts}


@pytest.fixture(scope="module")
def lms(offline):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm.check.lm_eval import MiniLLM

    path = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return {"minillm": MiniLLM(), "hf": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)}


def evaluate(lm, tasks, limit=None) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    task_dict = TaskManager(include_path=str(ROOT / "data" / "lm-eval")).load(tasks)  # as simple_evaluate loads them
    return evaluator.evaluate(lm=lm, task_dict=task_dict, limit=limit, log_samples=True)


@pytest.fixture(scope="module")
def runs(lms, offline) -> dict:
    return {name: evaluate(lm, TASKS) for name, lm in lms.items()}


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


@pytest.mark.parametrize("task", TASKS)
def test_every_request_agrees_with_the_hf_backend(runs, task):
    ours, hf = runs["minillm"]["samples"][task], runs["hf"]["samples"][task]
    assert len(ours) == len(hf) == 12
    found, worst = disagreements(ours, hf)
    assert found == []
    print(f"{task}: max |Δ loglikelihood| = {worst:.2e}")
    assert worst <= TOL


def test_the_metrics_are_equal(runs):
    ours, hf = runs["minillm"]["results"], runs["hf"]["results"]
    for task, metric in [("minillm_capitals", "acc,none"), ("minillm_capitals", "acc_norm,none"),
                         ("minillm_capitals_gen", "exact_match,none")]:
        assert ours[task][metric] == hf[task][metric], (task, metric)
    assert 0 < ours["minillm_capitals"]["acc,none"] < 1  # the task separates right from wrong answers
    assert 0 < ours["minillm_capitals_gen"]["exact_match,none"] < 1
    for metric in ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"]:
        assert ours["minillm_capitals_rolling"][metric] == pytest.approx(hf["minillm_capitals_rolling"][metric], rel=1e-4)


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
