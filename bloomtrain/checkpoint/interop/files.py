"""Where a DeepSpeed checkpoint's files are, and which rank wrote each.

`engine.save_checkpoint(root)` writes `root/latest` (the tag) and `root/TAG/` with:
- `mp_rank_{mp:02d}_model_states.pt`, one per model-parallel rank (`mp` = pp stage x tp + tp
  rank under pipeline parallelism): the module's weights (none for a pipeline: see layer files),
  `param_shapes`, the step counters, the LR scheduler, `ds_config` and the client's state
  (Megatron's `args`, `iteration`, ...);
- `[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`, one per dp rank of each: the
  optimizer shards (zero.py);
- under ZeRO-3, `zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt` instead of mp_rank_*;
- under pipeline parallelism, `layer_{ii:02d}-model_{tp:02d}-model_states.pt`: each pipeline
  layer's weights per tp rank, written by its stage's first dp rank.

HF's Trainer puts `config.json` (and the tokenizer) beside `TAG/` in `checkpoint-N/`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from bloomtrain.checkpoint.interop.safe_load import InteropError

_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass
class CheckpointFiles:
    root: Path                      # the directory given (a save root, checkpoint-N/, or TAG/)
    tag_dir: Path                   # TAG/: the step's files
    model: dict[int, Path] = field(default_factory=dict)                 # mp -> file
    zero3_model: dict[tuple[int, int], Path] = field(default_factory=dict)  # (mp, dp) -> file
    optim: dict[tuple[int, int], Path] = field(default_factory=dict)     # (mp, dp) -> file
    optim_prefix: str = ""          # "bf16_" for the BF16_Optimizer's shards
    layers: dict[tuple[int, int], Path] = field(default_factory=dict)    # (layer, tp) -> file

    @property
    def num_mp(self) -> int:
        ranks = set(self.model) | {mp for mp, _ in self.zero3_model}
        return max(ranks) + 1 if ranks else 0

    def dp_files(self, mp: int) -> list[Path]:
        """This model-parallel rank's optimizer shards in dp order; a gap is an error."""
        found = sorted(dp for m, dp in self.optim if m == mp)
        return [self.optim[(mp, dp)] for dp in found]

    def model_file(self, mp: int) -> Path:
        if mp in self.model:
            return self.model[mp]
        if (mp, 0) in self.zero3_model:
            return self.zero3_model[(mp, 0)]
        raise InteropError(f"{self.tag_dir}: mp_rank_{mp:02d}_model_states.pt is missing")

    def check_complete(self, dp_world_size: int | None, num_mp: int) -> None:
        """Every rank's files, or an error naming the first that is missing."""
        for mp in range(num_mp):
            if mp not in self.model and (mp, 0) not in self.zero3_model:
                raise InteropError(f"{self.tag_dir}: mp_rank_{mp:02d}_model_states.pt is "
                                   f"missing (the checkpoint has {num_mp} model-parallel ranks)")
        if not self.optim:
            return
        dp = dp_world_size or 1 + max(d for _, d in self.optim)
        for mp in range(num_mp):
            for d in range(dp):
                if (mp, d) not in self.optim:
                    raise InteropError(
                        f"{self.tag_dir}: {self.optim_prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}"
                        f"_optim_states.pt is missing (the run had {dp} data-parallel ranks); "
                        f"copy it from where the run saved, or import with --weights-only")
        extra = sorted({d for _, d in self.optim if d >= dp})
        if extra:
            raise InteropError(f"{self.tag_dir}: optimizer shards for dp ranks {extra}, but the "
                               f"run had {dp} data-parallel ranks (dp_world_size): the directory "
                               f"mixes files of different runs")


def find_tag_dir(path: Path) -> Path:
    """The directory holding a step's files: `path` itself, the tag `path/latest` names, or the
    only `global_step*` directory under `path`."""
    if not path.is_dir():
        raise InteropError(f"{path} is not a directory")
    if any(path.glob("*_model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise InteropError(f"{latest} names {tag!r}, not a step directory")
        if not (path / tag).is_dir():
            raise InteropError(f"{latest} names {tag}, but {path / tag} does not exist")
        return path / tag
    steps = sorted(p for p in path.iterdir() if p.is_dir() and p.name.startswith("global_step"))
    if len(steps) == 1:
        return steps[0]
    if steps:
        raise InteropError(f"{path} holds {len(steps)} steps ({', '.join(s.name for s in steps)}) "
                           f"and no `latest` file; give the one to import")
    raise InteropError(f"{path} is not a DeepSpeed checkpoint: no *_model_states.pt, no `latest` "
                       f"and no global_step* directory in it")


def scan(path: str | Path) -> CheckpointFiles:
    path = Path(path)
    tag_dir = find_tag_dir(path)
    files = CheckpointFiles(root=path, tag_dir=tag_dir)
    prefixes = set()
    for f in sorted(tag_dir.iterdir()):
        if m := _MODEL.match(f.name):
            files.model[int(m.group(1))] = f
        elif m := _ZERO3_MODEL.match(f.name):
            files.zero3_model[(int(m.group(2)), int(m.group(1)))] = f
        elif m := _OPTIM.match(f.name):
            prefixes.add(m.group(1) or "")
            files.optim[(int(m.group(3)), int(m.group(2)))] = f
        elif m := _LAYER.match(f.name):
            files.layers[(int(m.group(1)), int(m.group(2)))] = f
    if len(prefixes) > 1:
        raise InteropError(f"{tag_dir} mixes optimizer shards of different kinds "
                           f"({sorted(p or 'zero_' for p in prefixes)}); it holds files of "
                           f"different runs")
    files.optim_prefix = prefixes.pop() if prefixes else ""
    if not files.model and not files.zero3_model:
        raise InteropError(f"{tag_dir} has no mp_rank_*_model_states.pt; not a DeepSpeed "
                           f"checkpoint step")
    return files


def find_config_json(files: CheckpointFiles) -> Path | None:
    """HF's config.json for a model trained under DeepSpeed: beside the step directory (HF
    Trainer's checkpoint-N/), in it, or in the directory given."""
    for d in (files.tag_dir, files.tag_dir.parent, files.root):
        if (d / "config.json").is_file():
            return d / "config.json"
    return None


def deepspeed_position(meta: dict) -> dict:
    """The run's step, consumed samples and skipped steps by DeepSpeed's own counters (a
    model-states file's global_steps, global_samples, skipped_steps), and where its learning
    rate schedule stands: DeepSpeed steps the scheduler only for an update it applied
    (`_take_model_step`, not on an fp16 overflow), so the schedule is behind the samples by the
    skipped steps' batches."""
    steps = int(meta.get("global_steps") or 0)
    samples = int(meta.get("global_samples") or 0)
    skipped = int(meta.get("skipped_steps") or 0)
    out = {"step": steps, "consumed_samples": samples, "skipped_steps": skipped}
    if skipped and steps:
        out["lr_samples"] = max(samples - skipped * (samples // steps), 0)
    return out
