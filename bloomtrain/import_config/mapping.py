"""Megatron-DeepSpeed's arguments (and DeepSpeed's ds_config) as a bloomtrain config.

`megatron_to_config(args, ds_config, world_size=)` takes the arguments as argparse leaves them
(dest names: `{"tensor_model_parallel_size": 4, ...}`, as a Megatron-DeepSpeed checkpoint's
`args` Namespace holds them, or as bloomtrain.import_config.megatron_args.parse_argv reads a
command line) and returns the config dict and an ImportReport: every argument mapped and to
which key, every one ignored and why, every one unsupported, and what could not be checked. It
reads no file and prints nothing.

Megatron's defaults apply to what is not given (dropout 0.1, weight decay 0.01, Adam β2 0.999,
linear LR decay, absolute position embeddings, ...): bloomtrain's own defaults differ, so each one
that matters is written into the config and reported as Megatron's default.
"""
from __future__ import annotations

from typing import Any, Mapping

import bloomtrain.import_config.deepspeed as deepspeed
import bloomtrain.import_config.sections as sections
from bloomtrain.import_config.conversion import Conversion, ImportReport
from bloomtrain.import_config.megatron_args import BY_DEST, REASONS, SET_BY_MEGATRON


def megatron_to_config(args: Mapping[str, Any], ds_config: Mapping[str, Any] | None = None, *,
                       world_size: int | None = None, saved: bool = False,
                       labels: Mapping[str, str] | None = None,
                       ) -> tuple[dict[str, Any], ImportReport]:
    """The bloomtrain config (a dict of sections, for Config.from_dict) of a Megatron-DeepSpeed
    run and the report of the conversion. `args`: dest -> value; `ds_config`: the parsed
    ds_config.json, when the run used one; `world_size`: the run's process count (else
    `args["world_size"]` when a checkpoint's Namespace holds it), which the batch rules are
    checked against; `saved`: `args` is a checkpoint's Namespace, as Megatron saved it after
    deriving what it derives (train_iters from train_samples, the fields of SET_BY_MEGATRON),
    not a launch's arguments; `labels`: dest -> where that value came from, for arguments that
    are not a launch's flags (an HF model's config.json fields). Raises UserError for arguments that contradict each other (a batch rule
    broken, a value that is not a number, an unresolved variable). The caller validates the
    result (Config.from_dict, bloomtrain.validate)."""
    c = Conversion(args, ds_config, world_size, saved, labels)
    sections.parallel(c)
    sections.model(c)
    sections.data(c)
    sections.batch(c)
    sections.schedule(c)
    sections.optimizer(c)
    sections.train(c)
    sections.checkpoint(c)
    deepspeed.apply(c)
    _leftovers(c)
    c.report.world_size = c.world
    return c.config, c.report


def _is_default(value: Any, default: Any) -> bool:
    if value == default or str(value) == str(default):
        return True
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return False


def _leftovers(c: Conversion) -> None:
    """Every given argument the sections did not take: ignored or unsupported by the table, or
    unknown (unsupported: it may change training)."""
    for dest, value in c.given.items():
        if dest in c.accounted or dest in SET_BY_MEGATRON:
            continue
        option = BY_DEST.get(dest)
        if option is None:
            if value is not False:  # an unset switch of another fork's Namespace does nothing
                c.unsupported(dest, "not an argument import-config knows; find out what it "
                                    "does before training without it")
            continue
        kind, _, reason = option.action.partition(":")
        if kind == "map":
            # A section leaves an argument untouched where it has no effect: a switch that is
            # off, an option the other arguments make unused.
            if not _is_default(value, option.default):
                c.ignore(dest, "no effect with the other arguments given")
            continue
        if kind == "ignore":
            c.ignore(dest, REASONS[reason])
        elif _is_default(value, option.default):
            c.ignore(dest, "Megatron's default, which changes nothing")
        else:
            c.unsupported(dest, REASONS[reason])
