# Generated from notebooks/06_weights.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Loading weights: GGUF files (llama.cpp) and safetensors checkpoints (Hugging Face), checked.

Built in notebooks/06_weights.ipynb. Every count, offset and shape read from a file is checked
before tensor data is used; a bad file raises `WeightsError` naming the file, tensor and cause.
Loading streams tensor by tensor into a model allocated once, in its final dtype and device.

References:
- GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; the `gguf` package
  (GGUFReader, gguf.quants.dequantize).
- llama.cpp's convert_hf_to_gguf.py (tensor names, the q/k row permutation of llama models);
  transformers' modeling_gguf_pytorch_utils.py (its reverse, our reference).
- safetensors format: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import math
import mmap
import warnings
from collections.abc import Iterator
from pathlib import Path

import gguf
import torch

from minillm.model.devices import default_dtype, pick_device
from minillm.weights.gguf_file import WeightsError, check_gguf_header, read_gguf
from minillm.weights.gguf_types import _validate_gguf_layout, _validate_gguf_tensor, gguf_float
from minillm.weights.hub import REPO_ID, download
from minillm.model.decoder import CausalLM, ModelConfig, load_weights


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, interleaved pairs (2i, 2i+1) -> halves (i, i + D/2)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[parts[0]]}.{parts[1]}"
    return None


_MISSING = object()
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")  # FLOAT32 in llama.cpp's files


def _meta(reader, key: str, path: Path, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise WeightsError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    if key.endswith(_FLOAT_KEYS) and field.types[0] not in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
        raise WeightsError(f"{path}: GGUF metadata key {key!r} is a {field.types[0].name}, not a float")
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError) as exc:  # e.g. a string that is not UTF-8
        raise WeightsError(f"{path}: GGUF metadata key {key!r} is unreadable ({type(exc).__name__}: {exc})") from None


def gguf_config(reader, path: str | Path = "GGUF", mlp_fields=None, config_class=ModelConfig) -> ModelConfig:
    """A ModelConfig from a GGUFReader's metadata (llama, qwen2, qwen3). mlp_fields(key) -> {field: value}:
    another architecture's own fields, for its config_class (notebook 23's experts)."""
    path = Path(path)
    arch = _meta(reader, "general.architecture", path)
    arch = _supported(arch, path) if mlp_fields is None else arch
    key = lambda name, default=_MISSING: _meta(reader, f"{arch}.{name}", path, default)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = key("attention.head_count")
    cfg = {
        "model_type": arch,
        "vocab_size": len(tokens.data) if tokens is not None else key("vocab_size"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id", path, None),
    }
    if key("attention.key_length", None) is not None:
        cfg["head_dim"] = key("attention.key_length")
    if mlp_fields is not None:
        cfg |= mlp_fields(key)
    cfg["rope_scaling"] = gguf_rope_scaling(key, arch, path)  # None, or the folder's YaRN (or linear) dict
    try:
        config = config_class.from_dict(cfg, source=str(path))
    except ValueError as exc:
        raise WeightsError(str(exc)) from exc
    rotary = key("rope.dimension_count", config.head_dim)
    if rotary != config.head_dim:
        raise WeightsError(f"{path}: rope.dimension_count {rotary} != head_dim {config.head_dim} (partial rotary is not supported)")
    return config


def _supported(arch, path: Path) -> str:
    """The architecture, if minillm has a model for it; else WeightsError naming the file and those it has."""
    if arch not in GGUF_ARCHITECTURES:
        raise WeightsError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_architecture(path: str | Path) -> str:
    """A GGUF file's supported `general.architecture`, from the header check alone: before any vocabulary is read."""
    arch = check_gguf_header(path).get("general.architecture")
    if not isinstance(arch, str):
        raise WeightsError(f"{path}: GGUF metadata key 'general.architecture' is missing or not a string")
    return _supported(arch, Path(path))


_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


def gguf_rope_scaling(key, arch: str, path: Path) -> dict | None:
    """The config's rope_scaling that llama.cpp's converter wrote as {arch}.rope.scaling.* keys: None, or linear's
    or YaRN's dictionary; WeightsError naming the key of a type or value minillm lacks, or of a missing one."""
    kind = key("rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise WeightsError(f"{path}: '{arch}.rope.scaling.type' {kind!r} is not supported; supported: none, linear, yarn")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": key("rope.scaling.factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        for name, field in _YARN_KEYS.items():
            if (value := key(f"rope.scaling.{name}", None)) is not None:
                scaling[field] = value
        for name, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):  # not in transformers' YaRN
            if (value := key(f"rope.scaling.{name}", neutral)) != neutral:
                raise WeightsError(f"{path}: '{arch}.rope.scaling.{name}' {value!r} is not supported (only {neutral})")
    return scaling


def hf_rows(config: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    """A GGUF tensor's rows in Hugging Face's order: llama.cpp permuted a llama model's q and k rows."""
    if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return unpermute_qk(w, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
    return w


def open_gguf(path: str | Path, read_config=None, to_hf_name=gguf_to_hf_name) -> tuple[ModelConfig, dict, list]:
    """Check a GGUF file; return its config, {HF name: shape} and [(HF name, tensor info)], no data read yet.
    read_config(reader, path), to_hf_name(name): another architecture's (notebook 23's, its header checked first)."""
    path = Path(path)
    if read_config is None:
        gguf_architecture(path)  # from the header, in milliseconds: before gguf-py decodes a vocabulary
    reader = read_gguf(path)
    config = (read_config or gguf_config)(reader, path)
    shapes, infos = {}, []
    for t in reader.tensors:
        name = to_hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        _validate_gguf_tensor(path, reader, t, name, shape, shapes, config)  # see "Plumbing" below
        shapes[name] = shape
        infos.append((name, t))
    _validate_gguf_layout(path, reader, infos)  # the tensors lie back to back, aligned, inside the file
    return config, shapes, infos


def gguf_tensors(config: ModelConfig, shapes: dict, infos: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor), one at a time: dequantized (any of GGUF_TYPES), reshaped, rows in HF order."""
    for name, t in infos:
        yield name, hf_rows(config, name, gguf_float(t, shapes[name]))


def validate_names_and_shapes(config: ModelConfig, shapes: dict, source: str, model_class=CausalLM) -> CausalLM:
    """A model on the meta device, after checking every tensor name and shape against it (no data).
    model_class: the decoder, or another model built from a config (notebook 22's hybrid)."""
    _validate_layer_count(config, shapes, source)  # before building: a bad count could mean 10**9 modules
    try:
        with torch.device("meta"):
            model = model_class(config)
    except (ValueError, RuntimeError) as exc:  # a config no model has: heads not a multiple of kv heads, 2**31 wide
        raise WeightsError(f"{source}: the config cannot build a model ({exc})") from None
    try:
        load_weights(model, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}, source=source)
    except ValueError as exc:  # missing, unexpected or wrong-shaped tensors
        raise WeightsError(str(exc)) from exc
    return model


def _build(config: ModelConfig, shapes: dict, tensors: Iterator, dtype: torch.dtype, device, source: str,
           model_class=CausalLM, place=dict.get) -> CausalLM:
    """place(params, name): where a streamed tensor lands, or None to skip it (default: the parameter
    of that name; notebook 23's experts land one expert's slice of a stacked parameter at a time)."""
    model = validate_names_and_shapes(config, shapes, source, model_class)
    model = model.to(dtype=dtype).to_empty(device=device)  # allocated once, uninitialized
    model.reset_rope()  # to_empty() left inv_freq uninitialised
    params, written = model.state_dict(), 0
    with torch.no_grad():
        for name, tensor in tensors:
            target = place(params, name)
            if target is not None:
                target.copy_(tensor)  # cast and move, one tensor at a time
                written += target.numel()
    assert written == sum(p.numel() for p in params.values()), "every parameter must have been written"
    return model.eval()


def from_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """A CausalLM from a GGUF file (llama, qwen2, qwen3), dequantized to `dtype` on `device`."""
    config, shapes, infos = open_gguf(path)
    return _build(config, shapes, gguf_tensors(config, shapes, infos), dtype, torch.device(device), str(path))


_TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
}


def stream_safetensors(path: str | Path, header: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a checked safetensors file (see read_safetensors_header), in file order, as a
    zero-copy view of the memory-mapped file.

    When the next tensor is asked for, the previous one's pages are handed back to the kernel
    (madvise DONTNEED; they are only a cache of the file and would be read again if touched), so
    the file never piles up in resident memory while the model is filled.
    """
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # closed when the last view is gone
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = (data_start + offset for offset in info["data_offsets"])
        dtype = _TORCH_DTYPES[info["dtype"]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the mapping is read-only: we only read it
            flat = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin) \
                if end > begin else torch.empty(0, dtype=dtype)
        yield name, flat.view(info["shape"])
        first_page = begin - begin % mmap.PAGESIZE
        if hasattr(mapped, "madvise") and end > first_page:
            mapped.madvise(mmap.MADV_DONTNEED, first_page, end - first_page)


def load_folder(folder: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> CausalLM:
    """A CausalLM from a Hugging Face folder (config.json + safetensors, whole or sharded).

    device defaults to pick_device(); dtype to default_dtype(device).
    """
    device = pick_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    config, shapes, tensors, source = open_folder(folder)
    return _build(config, shapes, tensors, dtype, device, source)


def open_folder(folder: str | Path, config_class=ModelConfig) -> tuple[ModelConfig, dict[str, tuple[int, ...]], Iterator, str]:
    """Check a folder's config and safetensors headers; return its config, {name: shape}, the stream of
    (name, tensor) and the source errors name (notebook 21's sharded loader reads the same stream)."""
    folder = Path(folder)
    where = checkpoint_files(folder)
    config = config_class.from_json(folder / "config.json")
    headers = {file: read_safetensors_header(file) for file in sorted(set(where.values()))}
    shapes = {name: tuple(headers[file][name]["shape"]) for name, file in where.items()}
    _validate_float_dtypes(where, headers)  # same bytes, another meaning: a float relabelled U32 would load as garbage

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file, header in headers.items():
            yield from stream_safetensors(file, header)  # views of the memory-mapped file, one at a time

    source = str(next(iter(headers))) if len(headers) == 1 else str(folder)  # errors name the file where there is one
    return config, shapes, tensors(), source


def load_model(model: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> CausalLM:
    """A CausalLM from a .gguf file, a Hugging Face model folder, or a hub id (cached or downloaded)."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        device = pick_device() if device is None else torch.device(device)
        return from_gguf(path, dtype or default_dtype(device), device)
    if path.exists():  # a folder (or a file load_folder explains, such as a pickle checkpoint)
        return load_folder(path, dtype, device)
    if isinstance(model, str) and REPO_ID.fullmatch(model):
        return load_folder(download(model), dtype, device)
    raise FileNotFoundError(f"{model}: not a .gguf file, a model folder or a hub id like Qwen/Qwen2.5-0.5B-Instruct")


SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _json_object(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return obj


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a .safetensors file, checked against the file."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise WeightsError(f"{path}: {size} bytes, too short for a safetensors file (it starts with an 8-byte header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise WeightsError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_json_object)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WeightsError(f"{path}: header is not valid JSON ({exc})") from exc
    except RecursionError:  # json's parser recurses once per level: __metadata__ nested 1,000 deep
        raise WeightsError(f"{path}: header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    _validate_safetensors_entries(path, header, size - 8 - n)
    return header


def _validate_safetensors_entries(path: Path, header: dict, data_size: int) -> None:
    """Each entry well formed, of a known dtype, shape x item size = its span; the spans tile the data exactly."""
    for name, info in header.items():
        ok = isinstance(info, dict) and isinstance(info.get("shape"), list) and isinstance(info.get("data_offsets"), list)
        ok = ok and all(type(x) is int and x >= 0 for x in info["shape"] + info["data_offsets"])
        if not ok or len(info["data_offsets"]) != 2 or info["data_offsets"][0] > info["data_offsets"][1]:
            raise WeightsError(f"{path}: tensor {name}: malformed entry {info!r}")
        if info.get("dtype") not in SAFETENSORS_DTYPES:
            raise WeightsError(f"{path}: tensor {name}: unknown dtype {info.get('dtype')!r}; known: {', '.join(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        n_bytes = math.prod(info["shape"]) * SAFETENSORS_DTYPES[info["dtype"]]
        if n_bytes != end - begin:
            raise WeightsError(
                f"{path}: tensor {name}: shape {info['shape']} x {info['dtype']} is {n_bytes} bytes "
                f"but its data_offsets [{begin}, {end}] span {end - begin}"
            )
        if end > data_size:
            raise WeightsError(f"{path}: tensor {name} ends at byte {end}, past the data section ({data_size} bytes; file truncated?)")
    position, previous = 0, None
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = info["data_offsets"]
        if begin != position:
            what = "overlaps" if begin < position else "leaves a gap after"
            raise WeightsError(f"{path}: tensor {name} at bytes [{begin}, {end}] {what} {previous or 'the start'} (ends at {position})")
        position, previous = end, name
    if position != data_size:
        raise WeightsError(f"{path}: {data_size - position} bytes after the last tensor")


def _validate_layer_count(config: ModelConfig, shapes: dict, source: str) -> None:
    """The config's layer count against the layers the tensors name (before building: 10**9 layers would be 10**9 modules)."""
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    n = config.num_hidden_layers
    if len(layers) != n or (layers and (min(layers), max(layers)) != (0, n - 1)):
        found = f"{len(layers)} (indices {min(layers)}..{max(layers)})" if layers else "none"
        raise WeightsError(f"{source}: the config says {n} layers, the weights hold {found}")


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _validate_float_dtypes(where: dict[str, Path], headers: dict[Path, dict]) -> None:
    """Weights are floating point: same bytes, another meaning, and a float relabelled U32 would load as garbage."""
    for name, file in where.items():
        if headers[file][name]["dtype"] not in FLOAT_DTYPES:
            raise WeightsError(f"{file}: tensor {name} has dtype {headers[file][name]['dtype']}; "
                               f"weights are floating point ({', '.join(FLOAT_DTYPES)})")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _refuse_pickle(path: Path) -> WeightsError:
    return WeightsError(
        f"{path}: pickle checkpoints can run arbitrary code when loaded, so minillm does not read them; "
        "use the model's .safetensors files (most hub repositories have them), or convert once in a trusted "
        "environment: safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
    )


def _shards_from_index(index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_json_object)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WeightsError(f"{index}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise WeightsError(f"{index}: JSON nested too deeply") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index}: no 'weight_map' object mapping tensor names to shard files")
    root, shards = index.parent.resolve(), {}
    for name, file in weight_map.items():
        inside = isinstance(file, str) and file and not Path(file).is_absolute() and ".." not in Path(file).parts
        if not inside or not (root / file).resolve().is_relative_to(root):
            raise WeightsError(f"{index}: tensor {name} points to {file!r}, outside the model folder {root}")
        if not (root / file).is_file():
            raise WeightsError(f"{index}: shard {file} (holding tensor {name}) not found in {root}")
        shards[name] = root / file
    return shards


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """{tensor name: .safetensors file} for a model folder: model.safetensors or an index and its shards, checked."""
    folder = Path(folder)
    if folder.suffix in PICKLE_SUFFIXES:
        raise _refuse_pickle(folder)
    if not folder.is_dir():
        raise WeightsError(f"{folder}: not a model folder (expected config.json and model.safetensors)")
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    listed = _shards_from_index(index) if index.is_file() and not single.is_file() else None
    if listed is None and not single.is_file():
        pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise _refuse_pickle(pickles[0])
        raise WeightsError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    files = sorted(set(listed.values())) if listed is not None else [single]
    where: dict[str, Path] = {}
    for file in files:
        for name in read_safetensors_header(file):
            if name in where:
                raise WeightsError(f"{folder}: tensor {name} is in two shards, {where[name].name} and {file.name}")
            where[name] = file
    for name, file in (listed or {}).items():
        if where.get(name) != file:
            raise WeightsError(f"{index}: tensor {name} is listed in {file.name} but that shard does not hold it")
    return where
