"""What training, serving and evaluation share about the device a process computes on: the names
of the compute dtypes, the device itself, and the process group's backend for it.

Importing this module loads no torch: the CLI parsers take `DTYPE_NAMES` from here."""
from __future__ import annotations

import os
import typing
from typing import TYPE_CHECKING

from bloomtrain.config import Precision
from bloomtrain.errors import UserError

if TYPE_CHECKING:
    import torch

# The compute dtypes, by the names config keys and flags use (train.precision, --dtype), and
# torch's name of each. torch's own names, and "half", are accepted wherever a dtype is named.
DTYPE_NAMES = typing.get_args(Precision)
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ALIASES = {**{torch_name: short for short, torch_name in _TORCH_NAMES.items()}, "half": "fp16"}


def torch_dtype(name: "str | torch.dtype") -> "torch.dtype":
    """The torch dtype of `name` (fp32, bf16, fp16, or torch's float32, bfloat16, float16,
    half); a torch dtype is returned as it is."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    short = _ALIASES.get(name, name)
    if short not in _TORCH_NAMES:
        raise UserError(f"unknown dtype {name!r}; give one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, _TORCH_NAMES[short])


def dtype_name(dtype: "torch.dtype") -> str:
    """fp32, bf16 or fp16 for a torch dtype."""
    for short, torch_name in _TORCH_NAMES.items():
        if str(dtype) == f"torch.{torch_name}":
            return short
    raise UserError(f"{dtype} is not a compute dtype; use one of {', '.join(DTYPE_NAMES)}")


def resolve_device(requested: str | None = "auto") -> "torch.device":
    """The device this process computes on: `auto` (or None) is this rank's GPU when CUDA is
    visible (LOCAL_RANK picks it), else the CPU; `cuda` is this rank's GPU; anything else is a
    torch device string taken as it is (cpu, cuda:1, mps). A CUDA device becomes the current
    one, so that NCCL communicators are created on it."""
    import torch

    want = requested or "auto"
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("cuda was asked for but no CUDA device is visible; use cpu")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if want == "auto":
        return torch.device("cpu")
    try:
        device = torch.device(want)
    except RuntimeError as e:
        raise UserError(f"unknown device {want!r} ({e}); give auto, cpu, cuda or cuda:N") \
            from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{want} was asked for but no CUDA device is visible; use cpu")
        torch.cuda.set_device(device)
    return device


def process_group_backend(setting: str, device: "torch.device") -> str:
    """The backend string for `parallel.backend` on `device`. On CUDA it is per-device,
    `cpu:gloo,cuda:nccl`: training collectives run on NCCL, and a collective on a CPU tensor
    (object collectives, a control value computed on the host) is served by gloo instead of
    failing, so the control plane is NCCL-safe by construction rather than by care at every call
    site (bloomtrain.parallel.comm checks each tensor's device against this)."""
    if setting == "gloo":
        if device.type == "cuda":
            raise UserError("parallel.backend=gloo cannot carry the CUDA training tensors; use "
                            "parallel.backend=auto (NCCL for CUDA tensors, gloo for CPU ones) or "
                            "train.device=cpu")
        return "gloo"
    if device.type == "cuda":  # auto or nccl
        return "cpu:gloo,cuda:nccl"
    if setting == "nccl":
        raise UserError("parallel.backend=nccl needs CUDA devices (train.device=cuda); use "
                        "parallel.backend=auto on CPU")
    return "gloo"
