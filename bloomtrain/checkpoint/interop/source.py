"""What every reader of another system's checkpoint hands the importer: one `Source`.

A Source names the model's parameters by their HF names (the tied head excluded) and reads each
as a full tensor of one kind, when asked, so the importer writes one parameter at a time:
- "weights": the run's own weights, in its dtype (bf16 for a bf16 run);
- "fp32", "exp_avg", "exp_avg_sq": the fp32 masters and Adam's moments (when `optimizer`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bloomtrain.checkpoint.interop.safe_load import InteropError

if TYPE_CHECKING:  # the importer's parser (bloomtrain import-deepspeed --help) imports this
    import torch

WEIGHTS, MASTER_KINDS = "weights", ("fp32", "exp_avg", "exp_avg_sq")


@dataclass
class Source:
    label: str                                   # what was found, for the report
    path: Path
    shape: object                                # BloomShape
    shapes: dict[str, tuple[int, ...]]           # HF name -> full shape, in writing order
    weight_dtype: torch.dtype
    read: Callable[[str, str], torch.Tensor]     # (HF name, kind) -> full tensor
    optimizer: bool                              # fp32 masters and Adam moments imported
    optimizer_found: bool = False                # the source has them (--weights-only or not)
    adam_step: int | None = None
    train_state: dict | None = None              # step, consumed_samples, skipped_steps
    layout: dict = field(default_factory=dict)   # the run's tp, pp, dp, zero_stage, precision
    args: dict = field(default_factory=dict)     # Megatron-style args (the config's source)
    arg_labels: dict = field(default_factory=dict)  # dest -> where it came from, if not a flag
    ds_config: dict | None = None
    param_groups: list[dict] = field(default_factory=list)
    scaler: dict | None = None                   # fp16 loss scaler state
    notes: list[str] = field(default_factory=list)
    # Data checks run before anything is written; they return lines for the report.
    checks: list[Callable[[], list[str]]] = field(default_factory=list)


def check_decay_groups(groups: list[dict], where) -> list[str]:
    """bloomtrain decays every weight matrix and the embedding, and no bias or LayerNorm
    (Megatron's and HF Trainer's grouping). Say which weight decay the run used, and refuse a
    run whose groups decayed otherwise: resuming would silently change its optimizer."""
    from bloomtrain.model.params import base_spec

    decays = set()
    for g in groups:
        wd = float(g.get("weight_decay", 0.0) or 0.0)
        for name in g.get("names", []):
            try:
                wants = base_spec(name).weight_decay
            except KeyError:
                continue  # a name the reader maps later; checked there
            if wants != (wd > 0) and wd > 0:
                raise InteropError(f"{where}: the run applied weight decay {wd} to {name}, which "
                                   f"bloomtrain never decays (biases and LayerNorms); resuming "
                                   f"would change the optimizer. Import with --weights-only to "
                                   f"start a new optimizer")
            if wants and wd > 0:
                decays.add(wd)
            if wants and wd == 0 and any(float(h.get("weight_decay", 0) or 0) > 0 for h in groups):
                raise InteropError(f"{where}: the run left {name} without weight decay, where "
                                   f"bloomtrain decays every weight matrix; import with "
                                   f"--weights-only to start a new optimizer")
    if len(decays) > 1:
        raise InteropError(f"{where}: the run used several weight decays {sorted(decays)}; "
                           f"bloomtrain has one (optim.weight_decay)")
    return [f"weight decay {decays.pop() if decays else 0.0} on weight matrices and the "
            f"embedding, none on biases and LayerNorms (as bloomtrain)"]


def tied_head_equal(a: torch.Tensor, b: torch.Tensor, where, what: str) -> None:
    import torch

    if a.shape != b.shape or not torch.equal(a, b):
        raise InteropError(f"{where}: {what} differs from the word embedding; bloomtrain's LM head "
                           f"is always the embedding (untied heads are not supported)")
