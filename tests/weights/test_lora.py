"""LoRA adapters (notebook 20) against the reference, Hugging Face PEFT: an adapter PEFT saved gives
PEFT's logits here (attached, merged, or as one row of a multi-adapter batch), an adapter saved
here gives the same logits in PEFT, a planted scaling bug fails the comparison, and bad adapters
get errors naming the problem. The engine serves a batch mixing adapters and the base model, with
preemption, each request equal to running it alone on its merged model; the prefix cache keeps
each adapter's blocks apart."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import peft
import pytest
import torch
from support import DATA, ROOT, TINY
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minillm.weights import lora
from minillm.__main__ import lora_specs
from minillm.runtime.sequence import adapter_index
from minillm.__main__ import build_parser
from minillm.api import LLM, load
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.cache.paged import BlockManager
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import BackgroundServer, create_app
from minillm.text.tokenizer import Tokenizer


def peft_adapter(fixture: str, folder, dtype=torch.float64, seed: int = 0, rslora: bool = False):
    """A random PEFT adapter on every target module of a tiny checkpoint (B not zero), with a rank_pattern
    and an alpha_pattern; saved in `folder`. Returns PEFT's model, in `dtype`."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(DATA / fixture, dtype=dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(lora.TARGET_MODULES), init_lora_weights=False,
                             rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 3}, use_rslora=rslora)
    model = peft.get_peft_model(hf, config).eval()
    model.save_pretrained(folder)
    return model


def ids_for(fixture: str) -> torch.Tensor:
    vocab = json.loads((DATA / fixture / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def peft_module(reference, path: str):
    return reference.base_model.model.get_submodule(path)


def assert_modules_equal_peft(ours: torch.nn.Module, reference, adapter: lora.Adapter) -> None:
    """Every adapted linear, on the same float64 input, gives PEFT's output to rounding (1e-10)."""
    for path, (A, _, _) in adapter.weights.items():
        x = torch.randn(3, 5, A.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(ours.get_submodule(path)(x), peft_module(reference, path)(x), rtol=0, atol=1e-10,
                                       msg=path)


@pytest.mark.parametrize("fixture", TINY)
@pytest.mark.parametrize("rslora", [False, True])
def test_peft_adapter_gives_peft_outputs(fixture, rslora, tmp_path):
    """Each adapted linear equals PEFT's in float64 (1e-10), attached or merged; the multi-adapter row
    equals the attached model; whole-model logits in float32 equal PEFT's within the model-logits
    tolerance of the verification ladder (1e-4: in float32 PEFT itself is 2-3e-5 from the float64
    result on these logits of +-20, and in float64 both sides still round RoPE's angles in float32)."""
    reference = peft_adapter(fixture, tmp_path, rslora=rslora)
    adapter = lora.read_adapter(tmp_path)
    attached = lora.attach_adapter(from_folder(DATA / fixture, dtype=torch.float64), adapter)
    assert_modules_equal_peft(attached, reference, adapter)
    merged = lora.merge_adapter(from_folder(DATA / fixture, dtype=torch.float64), adapter)
    peft_merged = dict(reference.merge_and_unload().named_parameters())
    for path in adapter.weights:
        torch.testing.assert_close(merged.get_submodule(path).weight, peft_merged[f"{path}.weight"], rtol=0, atol=1e-10)
    ids = ids_for(fixture)
    multi = lora.MultiLoRA(from_folder(DATA / fixture, dtype=torch.float64), {"a": adapter, "b": adapter})
    with torch.no_grad():
        rows, one, base = multi(ids, adapter_ids=torch.tensor([2, 0])), attached(ids), multi(ids)
    assert (one - base).abs().max() > 1.0  # the adapter matters
    torch.testing.assert_close(rows[0], one[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(rows[1], base[1], rtol=0, atol=0)  # row 1 asked for no adapter
    reference32 = peft_adapter(fixture, tmp_path / "fp32", dtype=torch.float32, rslora=rslora)
    adapter32 = lora.read_adapter(tmp_path / "fp32")
    with torch.no_grad():
        expected = reference32(ids).logits
        for model in (lora.attach_adapter(from_folder(DATA / fixture), adapter32),
                      lora.merge_adapter(from_folder(DATA / fixture), adapter32)):
            torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-4)
        multi32 = lora.MultiLoRA(from_folder(DATA / fixture), {"a": adapter32})
        torch.testing.assert_close(multi32(ids, adapter_ids=torch.tensor([1, 1])), expected, rtol=0, atol=1e-4)


def our_adapter(fixture: str, folder, seed: int = 0, targets=lora.TARGET_MODULES) -> torch.nn.Module:
    """An adapter trained here (add_lora), with random B so that it changes the model; saved in `folder`."""
    torch.manual_seed(seed)
    model = from_folder(DATA / fixture, dtype=torch.float64)
    config = lora.AdapterConfig(r=4, lora_alpha=8, target_modules=targets)
    for module in lora.add_lora(model, config).values():
        torch.nn.init.normal_(module.lora_B.weight, std=0.5)
    lora.save_adapter(model, config, folder)
    return model


@pytest.mark.parametrize("fixture", TINY)
def test_adapter_saved_here_loads_in_peft(fixture, tmp_path):
    ours = our_adapter(fixture, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(DATA / fixture, dtype=torch.float64)
    reference = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    assert_modules_equal_peft(ours, reference, lora.read_adapter(tmp_path))
    ids = ids_for(fixture)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=0, atol=1e-4)


def test_planted_scaling_bug_fails_the_comparison(tmp_path, monkeypatch):
    reference = peft_adapter("tiny-llama", tmp_path)
    monkeypatch.setattr(lora.AdapterConfig, "scaling", lambda self, module: self.lora_alpha)  # alpha, not alpha / r
    adapter = lora.read_adapter(tmp_path)
    wrong = lora.attach_adapter(from_folder(DATA / "tiny-llama", dtype=torch.float64), adapter)
    with pytest.raises(AssertionError):
        assert_modules_equal_peft(wrong, reference, adapter)
    ids = ids_for("tiny-llama")
    with torch.no_grad():
        assert not torch.allclose(wrong(ids), reference(ids).logits, rtol=0, atol=1e-4)


def test_unmerge_restores_the_weights(tmp_path):
    our_adapter("tiny-qwen3", tmp_path)
    model, base = from_folder(DATA / "tiny-qwen3"), from_folder(DATA / "tiny-qwen3")
    adapter = lora.read_adapter(tmp_path)
    lora.merge_adapter(model, adapter)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    lora.merge_adapter(model, adapter, sign=-1)
    for (name, w), (_, w0) in zip(model.named_parameters(), base.named_parameters()):
        torch.testing.assert_close(w, w0, rtol=0, atol=1e-6, msg=name)


# ---- bad adapters: errors that name the problem ----

def rewrite(folder, config=None, tensors=None):
    if config is not None:
        path = folder / lora.CONFIG_FILE
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = folder / lora.WEIGHTS_FILE
        save_file(tensors(load_file(path)), path)


LAYER0_Q = "base_model.model.model.layers.0.self_attn.q_proj"
BAD_ADAPTERS = {
    "unsupported field": (dict(config=lambda c: {**c, "use_dora": True}), ValueError, "use_dora"),
    "bias": (dict(config=lambda c: {**c, "bias": "all"}), ValueError, "bias"),
    "not LoRA": (dict(config=lambda c: {**c, "peft_type": "IA3"}), ValueError, "peft_type 'IA3'"),
    "bad rank": (dict(config=lambda c: {**c, "r": 0}), ValueError, "r must be a positive integer"),
    "config rank differs": (dict(config=lambda c: {**c, "r": 8}), ValueError, r"lora_A \(4, \d+\) and .* with r = 8"),
    "missing lora_B": (dict(tensors=lambda t: {k: v for k, v in t.items() if k != f"{LAYER0_Q}.lora_B.weight"}),
                       ValueError, "model.layers.0.self_attn.q_proj has no lora_B"),
    "wrong shape": (dict(tensors=lambda t: {**t, f"{LAYER0_Q}.lora_A.weight": torch.zeros(3, 64)}), ValueError,
                    r"q_proj: lora_A \(3, 64\)"),
    "unknown layer": (dict(tensors=lambda t: {**t, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                                              "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(160, 4)}),
                      ValueError, "model.layers.9.mlp.up_proj, which is not a linear this model can adapt .*has 3 layers"),
    "embedding target": (dict(tensors=lambda t: {**t, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 64),
                                                 "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 4)}),
                         ValueError, "model.embed_tokens"),
    "not a LoRA tensor": (dict(tensors=lambda t: {**t, "base_model.model.lm_head.weight": torch.zeros(2, 2)}), ValueError,
                          "lm_head.weight is not a LoRA weight"),
    "other model's sizes": (dict(tensors=lambda t: {**t, f"{LAYER0_Q}.lora_A.weight": torch.zeros(4, 32)}), ValueError,
                            r"\(out, in\) = \(128, 64\) in the model, but the adapter's B @ A is \(128, 32\)"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapters_get_errors_naming_the_problem(case, tmp_path):
    edit, error, message = BAD_ADAPTERS[case]
    our_adapter("tiny-qwen3", tmp_path)
    rewrite(tmp_path, **edit)
    with pytest.raises(error, match=message):
        lora.attach_adapter(from_folder(DATA / "tiny-qwen3"), lora.read_adapter(tmp_path))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter config not found: .*nowhere.*no such folder"):
        lora.read_adapter(tmp_path / "nowhere")
    our_adapter("tiny-llama", tmp_path)
    (tmp_path / lora.WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="adapter weights not found"):
        lora.read_adapter(tmp_path)
    (tmp_path / lora.CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not valid JSON"):
        lora.read_adapter(tmp_path)


def test_a_truncated_weights_file_gets_the_weights_error(tmp_path):
    our_adapter("tiny-llama", tmp_path)
    path = tmp_path / lora.WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        lora.read_adapter(tmp_path)


# ---- serving many adapters ----

@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folders = {name: tmp_path_factory.mktemp(name) for name in ("a", "b")}
    our_adapter("tiny-llama", folders["a"], seed=1)
    our_adapter("tiny-llama", folders["b"], seed=2, targets=("q_proj", "v_proj", "down_proj"))
    return {name: lora.read_adapter(folder) for name, folder in folders.items()}


def alone(tok, adapter, prompt, n_new):
    model = from_folder(DATA / "tiny-llama")
    model = model if adapter is None else lora.merge_adapter(model, adapter)
    return Engine(model, tok, num_blocks=64).generate([prompt], SamplingParams(temperature=0), n_new, eos_token_ids=())[0]


@pytest.mark.parametrize("num_blocks", [64, 10])  # 10: preemption forced
def test_mixed_batch_equals_each_request_alone_on_its_merged_model(tok, adapters, num_blocks):
    served = lora.MultiLoRA(from_folder(DATA / "tiny-llama"), adapters)
    engine = Engine(served, tok, num_blocks=num_blocks, block_size=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(3, 12, (9,), generator=gen)]
    names = ["a", None, "b"] * 3
    rids = [engine.add_request(p, SamplingParams(temperature=0), 10, eos_token_ids=(), adapter=a) for p, a in zip(prompts, names)]
    tokens = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [] if out.token_id is None else [out.token_id]
    if num_blocks == 10:
        assert engine.scheduler.num_preemptions > 0
    for prompt, name, got in zip(prompts, names, [tokens[rid] for rid in rids]):
        assert got == alone(tok, None if name is None else adapters[name], prompt, 10)["token_ids"], name


def test_the_adapters_change_the_answer(tok, adapters):
    prompt = list(range(5, 15))
    answers = {name: tuple(alone(tok, None if name is None else adapters[name], prompt, 12)["token_ids"])
               for name in ("a", "b", None)}
    assert len(set(answers.values())) == 3, answers


def test_prefix_cache_keeps_each_adapters_blocks_apart(tok, adapters):
    served = lora.MultiLoRA(from_folder(DATA / "tiny-llama"), adapters)
    engine = Engine(served, tok, num_blocks=64, block_size=4)
    prompt = list(range(20, 37))  # 17 tokens: 4 full blocks

    def hits(adapter):
        before = engine.manager.hits
        engine.generate([prompt], SamplingParams(temperature=0), 2, eos_token_ids=(), adapter=adapter)
        return engine.manager.hits - before

    assert [hits("a"), hits("a"), hits("b"), hits(None), hits(None), hits("b")] == [0, 4, 0, 0, 4, 4]


def test_choices_of_an_adapter_request_share_its_prompt_and_adapter(tok, adapters):
    engine = Engine(lora.MultiLoRA(from_folder(DATA / "tiny-llama"), adapters), tok, num_blocks=64, block_size=4)
    prompt = [7, 8, 9]  # shorter than a block: the choices' first blocks fill while decoding, under the salt
    rid = engine.add_request(prompt, SamplingParams(temperature=0), 6, eos_token_ids=(), n=2, adapter="a")
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend([] if out.token_id is None else [out.token_id])
    expected = alone(tok, adapters["a"], prompt, 6)["token_ids"]
    assert tokens[rid] == expected and tokens[rid + 1] == expected
    assert engine.manager.prefix_hits(prompt + expected[:1]) == []  # registered under "a" only
    assert len(engine.manager.prefix_hits(prompt + expected[:1], adapter_index(engine.model, "a"))) == 1


def test_salted_blocks_are_found_only_with_their_salt():
    manager = BlockManager(16, block_size=4)
    manager.allocate("x", list(range(10)), salt="a")  # 2 full blocks registered under "a"
    assert manager.prefix_hits(list(range(10))) == []
    assert manager.prefix_hits(list(range(10)), "b") == []
    assert manager.prefix_hits(list(range(10)), "a") == manager.block_table("x")[:2]
    manager.allocate("y", [1, 2], salt="a")
    manager.fork("y", "z")
    for token in (3, 4, 5):  # z's first block fills while decoding: named under its parent's salt
        manager.append("z", token)
    assert manager.prefix_hits([1, 2, 3, 4]) == [] and manager.prefix_hits([1, 2, 3, 4], "a") != []
    manager.free("z")
    assert "z" not in manager.salts


def test_engine_refuses_an_unknown_adapter(tok, adapters):
    served = Engine(lora.MultiLoRA(from_folder(DATA / "tiny-llama"), adapters), tok)
    with pytest.raises(ValueError, match="no LoRA adapter named 'c'; this model serves a, b"):
        served.add_request([1, 2, 3], adapter="c")
    with pytest.raises(ValueError, match="serves none"):
        Engine(from_folder(DATA / "tiny-llama"), tok).add_request([1, 2, 3], adapter="a")
    with pytest.raises(ValueError, match=r"adapter_ids must be \(B,\) = \(1,\)"):
        served.model(torch.tensor([[1, 2]]), adapter_ids=torch.tensor([0, 1]))


def test_training_moves_only_the_adapter():
    model = from_folder(DATA / "tiny-qwen2-untied")
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = lora.add_lora(model, lora.AdapterConfig(r=2, lora_alpha=4))
    assert set(wrapped) == {f"model.layers.{i}.self_attn.{p}" for i in range(model.config.num_hidden_layers) for p in ("q_proj", "v_proj")}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, frozen[name.replace(".base_layer", "")]), name


# ---- the server, the CLI and load(lora=) on SmolLM2 ----

@pytest.fixture(scope="module")
def smol_adapter(tmp_path_factory, smollm2):
    """A rank-2 adapter on SmolLM2's q_proj and v_proj, random (std 0.05), saved in PEFT's format."""
    folder = tmp_path_factory.mktemp("smol-adapter")
    model = copy.deepcopy(smollm2[0])
    config = lora.AdapterConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"))
    torch.manual_seed(0)
    for module in lora.add_lora(model, config).values():
        torch.nn.init.normal_(module.lora_B.weight, std=0.05)
    lora.save_adapter(model, config, folder)
    return folder


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_serves_an_adapter_by_model_name(smollm2, smol_adapter):
    model, tok = smollm2
    served = LLM(lora.MultiLoRA(copy.deepcopy(model), {"a": lora.read_adapter(smol_adapter)}), tok)
    merged = lora.merge_adapter(copy.deepcopy(model), lora.read_adapter(smol_adapter))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = served.encode_chat(question)
    expected = {"smol": generate(model, tok, ids, max_new_tokens=8).text,
                "smol:a": generate(merged, tok, ids, max_new_tokens=8).text}
    assert expected["smol"] != expected["smol:a"]
    background = BackgroundServer(create_app(served, model_name="smol", num_blocks=64))
    try:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        models = client.models.list().data
        assert [m.id for m in models] == ["smol", "smol:a"] and models[1].parent == "smol"
        for name, text in expected.items():
            answer = client.chat.completions.create(model=name, messages=question, max_tokens=8, temperature=0)
            assert (answer.model, answer.choices[0].message.content) == (name, text)
        with pytest.raises(openai.NotFoundError) as error:
            client.chat.completions.create(model="smol:b", messages=question, max_tokens=8)
        assert error.value.body["code"] == "model_not_found" and "'smol:a'" in error.value.body["message"]
        stream = client.completions.create(model="smol:a", prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        plain = generate(merged, tok, tok.encode("The capital of France is"), max_new_tokens=6).text
        assert streamed == plain
        assert get_json(background.url + "/health")[1]["free_blocks"] == 64  # every block back (prefix cache: idle)
    finally:
        background.stop()


def test_load_merges_an_adapter(smollm2, smol_adapter):
    llm = load(lora=smol_adapter)
    merged = lora.merge_adapter(copy.deepcopy(smollm2[0]), lora.read_adapter(smol_adapter))
    for (name, w), (_, w0) in zip(llm.model.named_parameters(), merged.named_parameters()):
        assert torch.equal(w, w0), name
    with pytest.raises(ValueError, match="quantize='gguf' keeps the file's 4-bit blocks"):
        load(lora=smol_adapter, quantize="gguf")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_generate_with_an_adapter_answers_as_the_merged_model(smollm2, smol_adapter):
    merged = lora.merge_adapter(copy.deepcopy(smollm2[0]), lora.read_adapter(smol_adapter))
    tok = smollm2[1]
    expected = generate(merged, tok, tok.encode("The capital of France is"), max_new_tokens=8).text
    result = run_cli("generate", "The capital of France is", "--raw", "--temperature", "0", "--max-new-tokens", "8",
                     "--device", "cpu", "--lora", str(smol_adapter))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


@pytest.mark.parametrize("flags, message", [
    (["--lora", "a"], "--lora takes NAME=PATH"),
    (["--lora", "a:b=x"], "--lora takes NAME=PATH"),
    (["--lora", "a=x", "--lora", "a=y"], "the name 'a' is given twice"),
    (["--lora", "a=x", "--fast"], "drop --fast and --quantize"),
])
def test_serve_lora_flags_are_checked(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        lora_specs(build_parser().parse_args(["serve", *flags]))


def test_cli_serve_names_a_missing_adapter_before_loading():
    result = run_cli("serve", "--port", "1", "--lora", "a=/nowhere")
    assert result.returncode != 0 and "adapter config not found: /nowhere/adapter_config.json" in result.stderr
