"""Reading DeepSpeed's and Megatron's `torch.save` pickles without running their code.

Their checkpoints are pickles, and a pickle can name any callable. Everything here goes through
`torch.load(weights_only=True)`, whose unpickler builds only tensors, containers and primitive
values, plus an allow-list of stand-ins for the few classes these files name, registered under the
names the files use (so deepspeed and megatron are never imported):

- `deepspeed.utils.tensor_fragment.fragment_address` (param_slice_mappings: numel, start);
- `deepspeed.runtime.zero.config.ZeroStageEnum` (the ZeRO stage of an optimizer shard);
- `deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler` (their attributes only);
- `argparse.Namespace` (Megatron's `args`) and the `megatron.enums` it holds
  (`PositionEmbeddingType`, `AttnMaskType`, `AttnType`, `LayerType`);
- numpy's array reconstruction (`np_rng_state`, Megatron's saved numpy RNG state).

A file that names any other class is refused with that class's name; a truncated or damaged one
is refused as such. Neither is ever partly used.
"""
from __future__ import annotations

import argparse
import enum
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bloomtrain.errors import UserError


class InteropError(UserError):
    """A checkpoint of another system that cannot be imported: the message names the file."""


@dataclass
class FragmentAddress:
    """DeepSpeed's `fragment_address`: a parameter's `numel` elements at `start` of a rank's
    flat partition."""
    numel: int = 0
    start: int = 0


class ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScalerState:
    """DeepSpeed's (Dynamic)LossScaler, reduced to its attributes (`cur_scale`, `dynamic`,
    `cur_iter`, `last_overflow_iter`, `scale_window`, `cur_hysteresis`, ...)."""

    def get(self, name: str, default=None):
        return self.__dict__.get(name, default)


class PositionEmbeddingType(enum.Enum):
    rotary = 1
    absolute = 2
    alibi = 3


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    prefix = 3
    custom = 4


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


def _allowed() -> list:
    import numpy as np

    out = [(FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
           (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
           (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
           (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
           (argparse.Namespace, "argparse.Namespace")]
    for cls in (PositionEmbeddingType, AttnMaskType, AttnType, LayerType):
        out.append((cls, f"megatron.enums.{cls.__name__}"))
    # numpy arrays (a saved numpy RNG state): the array rebuild and plain numeric dtypes. numpy
    # 1.x pickles name numpy.core, 2.x numpy._core.
    core = getattr(np, "_core", None) or np.core
    for prefix in ("numpy.core", "numpy._core"):
        out.append((core.multiarray._reconstruct, f"{prefix}.multiarray._reconstruct"))
        out.append((core.multiarray.scalar, f"{prefix}.multiarray.scalar"))
    out += [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    for name in ("UInt8DType", "UInt16DType", "UInt32DType", "UInt64DType", "Int8DType",
                 "Int16DType", "Int32DType", "Int64DType", "Float16DType", "Float32DType",
                 "Float64DType", "BoolDType"):
        dtype_cls = getattr(getattr(np, "dtypes", None), name, None)
        if dtype_cls is not None:
            out.append((dtype_cls, f"numpy.dtypes.{name}"))
    return out


ALLOWED_NAMES = ("fragment_address", "ZeroStageEnum", "LossScaler", "argparse.Namespace",
                 "megatron.enums", "numpy arrays")
_GLOBAL = re.compile(r"GLOBAL (\S+)")


def load(path: str | os.PathLike, mmap: bool = False):
    """The object `torch.save` wrote to `path`, through the allow-list above. Raises InteropError
    naming the file: missing, truncated or damaged, or naming a class outside the allow-list."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise InteropError(f"{path} is missing")
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    # The weights-only unpickler's refusal (pickle.UnpicklingError, taken from torch so this
    # package never imports pickle: tests/robustness/test_untrusted.py).
    except torch.serialization.pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        if found:
            raise InteropError(
                f"{path} names the class {found.group(1)}, which bloomtrain does not unpickle "
                f"(only tensors, containers, numbers and the stand-ins for "
                f"{', '.join(ALLOWED_NAMES)}); refusing to load it. If this file really comes "
                f"from DeepSpeed or Megatron-DeepSpeed, report the class name") from None
        raise InteropError(f"{path} cannot be read safely: {_first_line(e)}") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError,
            AttributeError, TypeError, IndexError) as e:
        # torch reports a cut-off zip archive ("failed finding central directory"), a missing
        # record or a short read with one of these.
        size = path.stat().st_size if path.exists() else 0
        raise InteropError(f"{path} is truncated or damaged ({size} bytes; torch.load: "
                           f"{_first_line(e)}); copy it again from where the run saved "
                           f"it") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
