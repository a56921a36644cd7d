"""YaRN through the whole model (notebook 03's rope_inv_freq and rope_attention_factor, notebook 05's decoder,
notebook 13's fast path), held to transformers on a tiny Qwen3 checkpoint with YaRN enabled.

data/tiny-qwen3 (context 256) gets the line Qwen3's model card tells users to add, scaled down:
rope_scaling {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, so a
200-token text runs far past the original context and every pair of the ramp matters. transformers'
Qwen3ForCausalLM reads the same folder. Planted bugs: YaRN's speeds without its attention factor, and
plain RoPE, both leave transformers' tolerance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from minillm.model.decoder import from_folder
from minillm.speed.fast import FastCausalLM
from support import DATA, assert_logits_close, greedy_by_teacher_forcing, with_rope_scaling

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return with_rope_scaling(DATA / "tiny-qwen3", tmp_path_factory.mktemp("yarn") / "tiny-qwen3-yarn", YARN)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' logits over 200 seeded ids, and its 32 greedy tokens after the first 100."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, hf.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf(ids).logits[0]
        out = hf.generate(ids[:, :100], max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    assert hf.model.rotary_emb.attention_scaling > 1.1  # transformers did read YaRN from the folder
    return ids, logits, out[0, 100:]


def test_logits_and_greedy_tokens_match_transformers(folder, reference):
    ids, logits, greedy = reference
    model = from_folder(folder)
    assert model.config.rope_scaling == YARN and model.rope_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    with torch.no_grad():
        assert_logits_close(model(ids)[0], logits)
    assert greedy_by_teacher_forcing(model, ids[0, :100], greedy) == greedy.tolist()


def test_the_fast_path_matches_too(folder, reference):
    ids, logits, _ = reference
    with torch.no_grad():
        assert_logits_close(FastCausalLM(from_folder(folder))(ids)[0], logits)


@pytest.mark.parametrize("planted", ["no attention factor", "plain RoPE"])
def test_planted_bugs_leave_the_tolerance(folder, reference, planted):
    ids, logits, _ = reference
    model = from_folder(folder)
    if planted == "no attention factor":
        model.rope_scale = 1.0
    else:
        model.inv_freq = from_folder(DATA / "tiny-qwen3").inv_freq
    with torch.no_grad(), pytest.raises(AssertionError, match="beyond the tolerance"):
        assert_logits_close(model(ids)[0], logits)
