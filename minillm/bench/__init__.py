"""The benchmark, `python -m minillm.bench SECTION`: minillm beside transformers and llama.cpp, as ratios."""
