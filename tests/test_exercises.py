"""The classroom exercises: exercise notebooks are current, every stub raises NotImplementedError,
the reference package passes every check, and planted mistakes fail with the expected hint."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from minillm import attention, check, check_model, kv_cache, layers, model, paged_cache, quant, rope, sampling, tensor

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
                 "11_paged_cache", "13_quantization"]:
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
        "top_k_filter": lambda f: f(torch.randn(1, 5), 2),
        "top_p_filter": lambda f: f(torch.randn(1, 5), 0.5),
        "min_p_filter": lambda f: f(torch.randn(1, 5), 0.1),
        "quantize_int4": lambda f: f(torch.randn(2, 32), 32),
        "dequantize_q4_1": lambda f: f(torch.zeros(20, dtype=torch.uint8), (1, 32)),
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


# ---------------------------------------------------------------- the reference passes

REFERENCE = {
    "contiguous_strides": tensor.contiguous_strides, "transpose": tensor.transpose, "expand": tensor.expand,
    "matmul": tensor.matmul, "causal_mask": attention.causal_mask, "attention_weights": attention.attention_weights,
    "scaled_dot_product_attention": attention.scaled_dot_product_attention, "rotate_half": rope.rotate_half,
    "rope_cos_sin": rope.rope_cos_sin, "apply_rope": rope.apply_rope, "rms_norm": layers.rms_norm,
    "MLP.forward": layers.MLP, "Attention.forward": model.Attention, "DecoderLayer.forward": model.DecoderLayer,
    "KVCache.update": kv_cache.KVCache, "gather_reference": paged_cache.gather_reference,
    "batch_layout": paged_cache.batch_layout, "top_k_filter": sampling.top_k_filter,
    "top_p_filter": sampling.top_p_filter, "min_p_filter": sampling.min_p_filter,
    "quantize_int4": quant.quantize_int4, "dequantize_q4_1": quant.dequantize_q4_1,
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
    ("top_k_filter", top_k_zero_fill, "-inf, not 0"),
    ("top_p_filter", top_p_drops_crossing, "did you keep the token that crosses the threshold?"),
    ("min_p_filter", min_p_absolute, "p times the top token's probability"),
    ("quantize_int4", int4_zeros_at_lo, "lo + 8 * scale"),
    ("quantize_int4", int4_sixteen_steps, "divide by 15, not 16"),
    ("dequantize_q4_1", q4_1_adjacent_nibbles, "not q_{2j} and q_{2j+1}"),
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
    assert '        raise NotImplementedError("exercise: implement Cache.update; see the hint above")' in out
    assert '    raise NotImplementedError("exercise: implement f; see the hint above")' in out
    assert '"""Doc."""' in out and 'raise ValueError("pos")' in out and "return pos + 1" not in out
    with pytest.raises(make_exercises.ExerciseError):
        make_exercises.stub_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "test")


def test_check_names():
    assert make_exercises.check_name("KVCache.update") == "kv_cache_update"
    assert make_exercises.check_name("MLP.forward") == "mlp_forward"
    assert make_exercises.check_name("DecoderLayer.forward") == "decoder_layer_forward"
    assert make_exercises.check_name("top_p_filter") == "top_p_filter"


def _write_reference(root: Path, body: str, doc: str = "Doc.") -> Path:
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Doubling\n", "Twice x: `2 * x`."]},
        {"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": [], "source": ["#| default_exp double"]},
        {"cell_type": "code", "execution_count": 2, "metadata": {},
         "outputs": [{"output_type": "stream", "name": "stdout", "text": ["6\n"]}],
         "source": ["#| export\n", "def rms_norm(x):\n", f'    """{doc}"""\n', "    ### BEGIN SOLUTION\n",
                    f"    {body}\n", "    ### END SOLUTION\n"]},
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
