"""lm-evaluation-harness over minillm, in-process (plumbing, not a lesson): an lm-eval `LM` whose
loglikelihoods come from one prefill per request (LLM.prompt_logprobs, notebook 10) and whose
answers are minillm's own generation loop, greedy unless a task asks to sample.

lm-eval (`pip install lm-eval==0.4.13`, pinned in requirements-dev.txt) is a test-only dependency:
it is imported here alone, and nothing in the package imports this module.

From the command line (lm-eval's own CLI, with the model name `minillm` registered), in the
repository root, on the local tasks of data/lm-eval/ (no hub access):

    python -m minillm.check.lm_eval --model minillm --model_args model=PATH_OR_HUB_ID \\
        --include_path data/lm-eval --tasks minillm_capitals,minillm_capitals_gen

From Python:

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from minillm.check.lm_eval import MiniLLM
    simple_evaluate(MiniLLM(), tasks=["minillm_capitals"], task_manager=TaskManager(include_path="data/lm-eval"))

Requests are tokenized by lm-eval's TemplateLM, as its `hf` backend is: context + continuation
encoded together and split at the encoded context's length, the context's trailing spaces moved
into the continuation, an empty context replaced by the BOS (else EOS) token. Long inputs keep their
last max_length + 1 tokens, as `hf` does. The model runs one request at a time (batch_size is accepted
for the CLI and ignored).

Against `python -m minillm serve`, lm-eval's own `local-completions` model needs nothing from here
(`--model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,model=NAME`;
it tokenizes through the server's /tokenizer_info, /tokenize and /detokenize): docs/eval.md.
"""

from __future__ import annotations

import logging
import sys

import torch

from minillm.api import LLM, load
from minillm.runtime.generate import collect, stream
from minillm.runtime.sampling import SamplingParams

try:  # lm-eval, the field's harness: installed for tests only (requirements-dev.txt)
    import lm_eval  # noqa: F401  (the check alone; the names come below)
except ImportError as error:
    raise ImportError("minillm.check.lm_eval needs lm-evaluation-harness: pip install lm-eval==0.4.13 "
                      "(pinned in requirements-dev.txt; the runtime package does not need it)") from error
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

log = logging.getLogger(__name__)
SAMPLING_KWARGS = {"do_sample", "temperature", "top_p", "top_k", "seed"}  # the gen_kwargs a task may set


@register_model("minillm")
class MiniLLM(TemplateLM):
    """An lm-eval LM over `minillm.load(model, dtype, device, **load_options)`, or over an LLM given as `model`.

    max_length: the context scored (default: the model's max_position_embeddings, as `hf` reads it);
    max_gen_toks: generate_until's default when a task sets none (lm-eval's 256);
    add_bos_token: as `hf`'s (None: the tokenizer's own post-processor decides)."""

    def __init__(self, model: str | LLM | None = None, dtype: str | None = None, device: str | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, **load_options):
        super().__init__()
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("MiniLLM: %s asked (lm-eval's default device) but CUDA is not available; "
                        "minillm picks the device", device)  # as lm-eval's hf backend falls back
            device = None
        self.llm = model if isinstance(model, LLM) else load(model, dtype=dtype, device=device, **load_options)
        self.tokenizer = self.llm.tokenizer  # TemplateLM.chat_template reads it
        self._max_length = max_length or self.llm.model.config.max_position_embeddings
        self._max_gen_toks, self.add_bos_token = max_gen_toks, add_bos_token

    # ---------------------------------------------------------------- tokens, as lm-eval's hf backend
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token
        return self.tokenizer.token_to_id(eos) if eos is not None else self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by: the BOS token, else the EOS token (as `hf`)."""
        bos = self.tokenizer.bos_token
        return self.tokenizer.token_to_id(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.source).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """`hf`'s rule: the flag given, else add_bos_token, else the tokenizer's default (its post-processor
        runs), but never a second BOS in front of a string that starts with one."""
        add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add is None:
            add = not has_bos_prefix(string, self.tokenizer.decode([self.prefix_token_id]))
        ids = self.tokenizer.encode(string, add_special_tokens=add)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([tokens] if isinstance(tokens, int) else tokens, skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.chat_text(chat_history, add_generation_prompt)

    # ---------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is the argmax) per
        (request strings, context ids, continuation ids): one prefill of context + continuation."""
        answers = []
        for request, context, continuation in requests:
            answer = self._score(context, continuation)
            if request is not None:  # rolling windows have no request of their own
                self.cache_hook.add_partial("loglikelihood", request, answer)
            answers.append(answer)
        return answers

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        if not continuation:
            return 0.0, True
        ids = (context + continuation)[-(self.max_length + 1):]  # the last max_length + 1 tokens, as `hf`
        scored = self.llm.prompt_logprobs(ids, top_logprobs=1)
        n = len(continuation)
        logprob = sum(scored.logprobs[-n:])
        greedy = all(top[0][0] == token for top, token in zip(scored.top_logprobs[-n:], continuation))
        return float(logprob), bool(greedy)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's whole loglikelihood after the prefix token, in windows of max_length (lm-eval's
        get_rolling_token_windows, as `hf`: every token predicted once, with the most context it can have)."""
        totals = []
        for (string,) in [request.args for request in requests]:
            windows = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            scored = self._loglikelihood_tokens([(None, *make_disjoint_window(w)) for w in windows])
            total = sum(logprob for logprob, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            totals.append(total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued until a stop string of the task's `until` or the EOS token, at most
        max_gen_toks tokens; the text cut at the first stop string, as `hf` cuts it."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        answers = []
        for context, gen_kwargs in [request.args for request in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            steps = stream(self.llm.model, self.tokenizer, ids, params=sampling_params(kwargs),
                           max_new_tokens=max_gen_toks, stop=[s for s in until if s])
            text = postprocess_generated_text(collect(steps).text, stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            answers.append(text)
        return answers


def sampling_params(kwargs: dict) -> SamplingParams:
    """A task's normalized gen_kwargs as SamplingParams: greedy unless do_sample; others refused by name."""
    unknown = sorted(set(kwargs) - SAMPLING_KWARGS)
    if unknown:
        raise ValueError(f"generate_until: gen_kwargs {', '.join(unknown)} not supported by minillm; "
                         f"supported: until, max_gen_toks, {', '.join(sorted(SAMPLING_KWARGS))}")
    if not kwargs.get("do_sample"):
        return SamplingParams(temperature=0)
    return SamplingParams(temperature=float(kwargs.get("temperature", 1.0)), top_p=float(kwargs.get("top_p", 1.0)),
                          top_k=int(kwargs.get("top_k", 0)), seed=kwargs.get("seed"))


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI (`lm_eval ...`) with `--model minillm` registered: the same arguments."""
    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
