# Generated from notebooks/A1_untrusted_files.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""GGUF tensors into torch: every tensor type gguf-py decodes, each tensor checked against the file.

Built in notebooks/A1_untrusted_files.ipynb. `GGUF_TYPES` is what `gguf.quants.dequantize` decodes (26 of
ggml's 34 types in gguf 0.19.0: the floats, Q4_0 to Q8_0, the K-quants, the IQ and TQ types, MXFP4
and NVFP4), and `gguf_float` turns one tensor into float32 with it. A tensor of any other type
(Q8_1, Q8_K, I8 to I64, F64, Q1_0) is refused with a WeightsError naming the tensor and the type,
before any data is read. Notebook 12 keeps Q4_0/Q4_1/Q8_0 blocks quantized with minillm's own
decoders (bit-exact against gguf-py); every other type is dequantized by `gguf_float`.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import torch
from gguf.quants import dequantize

from minillm.model.decoder import ModelConfig
from minillm.weights.gguf_file import WeightsError


GGUF_TYPES = (  # every type gguf.quants.dequantize decodes (gguf 0.19.0): what the loaders accept
    "F32", "F16", "BF16",  # floats
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",  # blocks of 32: a float16 scale (and minimum) each
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",  # K-quants: super-blocks of 256, quantized sub-block scales
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",  # codebooks
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",  # ternary; 4-bit floats with a shared exponent or scale
)


def gguf_float(t: gguf.ReaderTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """One GGUF tensor (any of GGUF_TYPES) as float32 of torch `shape`, decoded by gguf-py."""
    values = dequantize(t.data, t.tensor_type)  # float32, (rows, row length)
    return torch.from_numpy(values if values.flags.writeable else values.copy()).reshape(shape)


def _validate_gguf_tensor(path: Path, reader: gguf.GGUFReader, t: gguf.ReaderTensor, name: str | None,
                       shape: tuple[int, ...], seen: dict, config: ModelConfig) -> None:
    """One tensor info against the file: a known name, once; a type gguf-py decodes; whole blocks; its bytes in the file."""
    qtype = t.tensor_type.name
    if name is None:
        raise WeightsError(f"{path}: tensor {t.name} has no counterpart in minillm's {config.model_type} model")
    if name in seen:
        raise WeightsError(f"{path}: tensor {t.name} appears twice")
    if qtype not in GGUF_TYPES:
        raise WeightsError(f"{path}: tensor {t.name} has type {qtype}, which gguf-py cannot dequantize; "
                           f"minillm loads {', '.join(GGUF_TYPES)}")
    block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    if not shape or min(shape) < 1 or shape[-1] % block:
        raise WeightsError(f"{path}: tensor {t.name} has dims {shape}; rows must be whole {qtype} blocks of {block}")
    n_bytes, size = math.prod(shape) // block * block_bytes, path.stat().st_size
    if int(t.n_bytes) != n_bytes or t.data_offset % reader.alignment or t.data_offset + n_bytes > size:
        raise WeightsError(
            f"{path}: tensor {t.name} ({qtype} {shape}) needs {n_bytes} bytes at offset {t.data_offset}, "
            f"aligned to {reader.alignment}, inside the file's {size} bytes"
        )


def _validate_gguf_layout(path: Path, reader: gguf.GGUFReader, infos: list) -> None:
    """The tensors' data lies back to back, each padded to the alignment, and nothing follows the last one."""
    size = path.stat().st_size
    end, previous, align = int(reader.data_offset), "the start of the data", int(reader.alignment)  # not uint32
    for begin, n_bytes, name in sorted((t.data_offset, int(t.n_bytes), t.name) for _, t in infos):
        if begin != end:
            raise WeightsError(f"{path}: tensor {name} starts at byte {begin}, but {previous} ends at {end} "
                               f"({'overlap' if begin < end else 'a gap'}: an edited type or offset?)")
        end, previous = -(-(begin + n_bytes) // align) * align, name  # the next one starts aligned
    if size - end >= align:  # the last tensor shrank (say F32 relabelled F16): bytes nobody reads
        raise WeightsError(f"{path}: {size - end} bytes after the last tensor, {previous} (an edited type?)")
