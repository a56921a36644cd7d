"""The benchmark's "user" rows (plumbing, not a lesson): the speed a user meets, not a warm loop.

Each side answers one chat (USER_PROMPT, greedy, exactly --tokens new tokens, 96 by default:
end-of-sequence does not stop it) in a Python process started for that answer alone, as `python -m
minillm generate` is: the imports, the load, the variant's build (torch.compile's too: a compiled
variant runs first on an empty compile cache, as on a new machine, then again on what that run
cached), the chat template, the prefill, the decode. The parent's clock times it from the start of
the process: time to first token and total. A warm decode loop hides all of that but
the last part; for one answer it is most of the wait.

Sides: every minillm variant asked for (`minillm.load` with its options), transformers
(`from_pretrained` on the same GGUF, its `generate` with a streamer) and, with --peers llama.cpp,
llama-cpp-python on the same GGUF. A side that fails is listed under "skipped" with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minillm.api import load
from minillm.runtime.generate import stream

USER_PROMPT = "List the planets of the solar system in order, with one fact about each."
CHILD_TIMEOUT_S = 1800  # a compiled variant on a cold cache takes minutes; more is a hang


def minillm_answer(variant: str, source: str, tokens: int) -> tuple[float, float]:
    """In the fresh process: (wall-clock time of the first token, of the last) of a minillm variant's answer."""
    quantize = "int8" if "int8" in variant else "int4" if "int4" in variant else None
    llm = load(source, quantize=quantize, fast=variant.startswith("fast"), compile=variant.endswith("-compiled"))
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": USER_PROMPT}])
    first = None
    for _ in stream(llm.model, llm.tokenizer, ids, max_new_tokens=tokens, eos_token_ids=()):
        first = first or time.time()
    return first, time.time()


# The peers' answers: scripts of their own, so that their process imports neither minillm nor (llama.cpp) torch.
TRANSFORMERS_ANSWER = """
import time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer
torch.set_num_threads(THREADS)
path = Path(SOURCE)
hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
times = []
class Clock(BaseStreamer):  # put() gets the prompt first, then each new token
    def put(self, value):
        times.append(time.time())
    def end(self):
        pass
with torch.no_grad():
    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0, streamer=Clock())
TIMES = (times[1], time.time())
"""

LLAMACPP_ANSWER = """
import time
from llama_cpp import Llama
llm = Llama(SOURCE, n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
first = None
for _ in llm.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0,
                                    stream=True, logit_bias={llm.token_eos(): -1e9}):  # end-of-sequence ignored
    first = first or time.time()
TIMES = (first, time.time())
"""

MINILLM_ANSWER = """
import torch
torch.set_num_threads(THREADS)
from minillm.bench.user import minillm_answer
TIMES = minillm_answer(VARIANT, SOURCE, TOKENS)
"""


def fresh_answer(side: str, source: Path, threads: int, tokens: int, compile_cache: str) -> tuple[float, float]:
    """(time to first token, total) in seconds of `side` answering USER_PROMPT in a new process, torch.compile's
    on-disk cache in the folder `compile_cache`."""
    script = {"transformers": TRANSFORMERS_ANSWER, "llama.cpp": LLAMACPP_ANSWER}.get(side, MINILLM_ANSWER)
    constants = (f"THREADS, TOKENS, SOURCE, VARIANT, PROMPT = {threads}, {tokens}, {str(source)!r}, {side!r}, "
                 f"{USER_PROMPT!r}\n")
    code = constants + script + "import json\nprint('USER-TIMES ' + json.dumps(TIMES))\n"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_CACHE_DIR": compile_cache}
    t0 = time.time()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in run.stdout.splitlines() if line.startswith("USER-TIMES ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"exit {run.returncode}: {run.stderr.strip()[-400:]}")
    first, end = json.loads(lines[-1].removeprefix("USER-TIMES "))
    return first - t0, end - t0


def user_rows(source: Path, variants: list[str], args, row, skipped: dict) -> None:
    """The user section: a row pair per minillm variant beside transformers, and beside llama.cpp if asked."""
    if source.suffix != ".gguf":
        skipped["user"] = f"skipped: the user rows load a .gguf file on every side; the model is {source}"
        return
    threads, tokens = args.threads or os.cpu_count(), args.tokens
    compiled = [v for v in variants if v.endswith("-compiled")]  # run twice: on an empty cache, then on its own
    sides = ["transformers", *(["llama.cpp"] if "llama.cpp" in args.peers else []), *variants,
             *(f"{v}, warm cache" for v in compiled)]
    times = {}
    with tempfile.TemporaryDirectory(prefix="minillm-user-") as cache:  # this machine's torch cache left alone
        for side in sides:
            try:
                times[side] = fresh_answer(side.removesuffix(", warm cache"), source, threads, tokens, cache)
            except Exception as e:  # reported, not hidden
                skipped[f"user: {side}"] = f"skipped: {type(e).__name__}: {e}"
    theirs, peer = times.get("transformers", (None, None)), times.get("llama.cpp")
    for side in sides[sides.index(variants[0]):] if variants else []:
        if side in times:
            (ttft, total) = times[side]
            row("user", side, "fresh: time to first token", "s", ttft, theirs[0], n=tokens)
            row("user", side, "fresh: whole answer", "s", total, theirs[1], n=tokens)
            if peer:
                row("user", side, "fresh answer vs llama.cpp", "s", total, peer[1], n=tokens)
    if peer:
        row("user", "llama.cpp (same GGUF)", "fresh: time to first token", "s", peer[0], theirs[0], n=tokens)
        row("user", "llama.cpp (same GGUF)", "fresh: whole answer", "s", peer[1], theirs[1], n=tokens)
