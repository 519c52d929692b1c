"""Writing safetensors files one tensor at a time (https://github.com/huggingface/safetensors):
a u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} padded
with spaces to 8 bytes, then the tensors' little-endian bytes back to back.

`safetensors.torch.save` builds the whole file in memory first; for checkpoints and exports of
large models that doubles the memory and costs a full extra copy. Here each tensor is written
(and hashed) straight from its own storage."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Callable, Iterable

from typing import TYPE_CHECKING

from bloomtrain.errors import UserError

if TYPE_CHECKING:  # the table below is read without torch (checkpoint.format)
    import torch

# The dtypes a BLOOM checkpoint can hold, by torch's name: safetensors' tag and bytes per element.
DTYPES = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2),
    "bfloat16": ("BF16", 2), "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "bool": ("BOOL", 1),
}


def write_safetensors_streaming(path: str | os.PathLike,
                                entries: Iterable[tuple[str, str, tuple[int, ...],
                                                        Callable[[], torch.Tensor]]],
                                metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write `entries` — (name, torch dtype name, shape, load) — to `path`, calling each `load()`
    once, in order, right before its bytes are written, so at most one tensor need be in
    memory. Returns (sha256 hex digest, size in bytes) of what was written."""
    import torch

    entries = list(entries)
    header: dict = {}
    offset = 0
    for name, dtype, shape, _ in entries:
        if dtype not in DTYPES:
            raise UserError(f"cannot write {name}: dtype {dtype} has no safetensors tag")
        tag, num_bytes = DTYPES[dtype]
        for d in shape:
            num_bytes *= d
        header[name] = {"dtype": tag, "shape": list(shape),
                        "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        for name, dtype, shape, load in entries:
            t = load()
            if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{name} changed between header and data")
            data = memoryview(t.detach().to("cpu").contiguous().reshape(-1)
                              .view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
            size += len(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), size
