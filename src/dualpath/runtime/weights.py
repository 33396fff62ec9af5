"""A checkpoint's files: a memory-mapped ``.safetensors`` reader (zero-copy torch views,
pages shared by every engine process that maps the file) and the weights' digest that
fingerprints the KV namespace. Used by ``hf_model``; no hub access."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import torch
from torch import Tensor

# safetensors dtype names → torch dtypes (the ones a Llama / Qwen checkpoint can hold)
_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of one ``.safetensors`` file as a zero-copy view of a private (copy-on-
    write) memory map of it: pages are read from the page cache on first touch and shared by
    every process that maps the same file. ValueError (one line) for a malformed file."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = int.from_bytes(mm[:8], "little")
    if header_len > size - 8:
        raise ValueError(f"{path}: not a safetensors file (header of {header_len} bytes)")
    try:
        header = json.loads(bytes(mm[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not a safetensors file (header is not JSON)") from None
    base = 8 + header_len
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize or base + end > size:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + begin).view(shape)
    return out
