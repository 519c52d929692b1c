"""Viewers' copies of metrics.jsonl: TensorBoard event files under run_dir/tensorboard and a W&B
run (offline by default, under run_dir/wandb). Each one mirrors every record, train and eval,
with its numeric fields as scalars at the record's step.

Their packages are optional and imported here only when the run enables them (`run.tensorboard`,
`run.wandb`); metrics.jsonl stays the one record that every run has."""
from __future__ import annotations

import os
from pathlib import Path

from bloomtrain.config import Config
from bloomtrain.errors import UserError


def scalars(rec: dict, prefix: str = "") -> dict[str, float]:
    """A record's numeric fields under '/'-joined names: nested dicts are flattened
    (comm/all_reduce/tp/bytes) and lists indexed (name/0, name/1, ...). Strings are skipped, and so
    are booleans: the `skipped` flag is already counted by skipped_steps. The top-level `step` is
    the x axis, not a series."""
    out = {}
    items = rec.items() if isinstance(rec, dict) else enumerate(rec)
    for key, val in items:
        name = f"{prefix}{key}"
        if isinstance(val, (dict, list, tuple)):
            out.update(scalars(val, name + "/"))
        elif isinstance(val, (int, float)) and not isinstance(val, bool) and name != "step":
            out[name] = float(val)
    return out


def _import_tensorboard(required: bool):
    """torch's SummaryWriter, or None when the package is missing and the run did not insist."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if required:
            raise UserError("run.tensorboard=true, but the tensorboard package is not installed: "
                            "pip install bloomtrain[tensorboard] (or set run.tensorboard=false)"
                            ) from None
        return None
    return SummaryWriter


def _import_wandb(project: str):
    try:
        import wandb
    except ImportError:
        raise UserError(f"run.wandb={project!r}, but wandb is not installed: pip install wandb "
                        f"(or set run.wandb=null)") from None
    return wandb


class TensorBoardSink:
    def __init__(self, summary_writer, log_dir: Path, resume_step: int | None, config_yaml: str,
                 history: list[dict]):
        self.log_dir = log_dir
        old = sorted(log_dir.glob("events.out.tfevents.*"))
        first_step = (resume_step or 0) + 1
        self.writer = summary_writer(str(log_dir))
        if resume_step is not None:
            # A resumed run's event files are written again from metrics.jsonl, which mirrors
            # it exactly: TensorBoard's loaders do not honour purge_step (its Rust data server
            # never purges; the Python one ignores a run's first START), so the steps the
            # resume runs again showed twice, and a tag logged less often (eval_loss) kept
            # points metrics.jsonl had dropped. Steps trained with TensorBoard off come over
            # too. The configs logged before the checkpoint's step are kept from the old files.
            for step, text in _configs_before(old, first_step):
                self.writer.add_text("config", text, global_step=step)
            for rec in history:
                self._add(rec)
        for path in old:  # a fresh start's earlier curves belong to no run any more
            path.unlink()
        # The config in force from first_step on (markdown: indented to keep the YAML layout).
        self.writer.add_text("config", "".join(f"    {line}\n" for line in
                                               config_yaml.splitlines()), global_step=first_step)
        self.writer.flush()

    def _add(self, rec: dict) -> None:
        for name, value in scalars(rec).items():
            self.writer.add_scalar(name, value, global_step=rec["step"])

    def write(self, rec: dict) -> None:
        self._add(rec)
        # Flushed per record, as metrics.jsonl is written: a crash loses no record.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def where(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.log_dir}"


def _configs_before(files: list[Path], step: int) -> list[tuple[int, str]]:
    """(step, text) of the configs logged in event `files` before `step`. Best effort: an
    unreadable file (cut by a kill) keeps what was read of it."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    out = []
    for path in files:
        try:
            for event in EventFileLoader(str(path)).Load():
                for v in event.summary.value:
                    if v.tag == "config/text_summary" and event.step < step and \
                            v.tensor.string_val:
                        out.append((event.step, v.tensor.string_val[0].decode("utf-8")))
        except Exception:  # noqa: BLE001 - a damaged viewer file must not stop the run
            continue
    return sorted(set(out))


class WandbSink:
    def __init__(self, wandb, project: str, run_dir: Path, resume_step: int | None,
                 config: dict):
        self.project, self.run_dir = project, run_dir
        # W&B puts its files in `dir`/wandb. Offline unless WANDB_MODE says otherwise: training
        # nodes often have no internet, and `wandb sync` uploads later. W&B can neither resume
        # an offline run nor take back steps, so each start of this run_dir is one W&B run of
        # the run_dir's group, beginning after the checkpoint it resumed from.
        self.mode = os.environ.get("WANDB_MODE", "offline")
        name = run_dir.name if resume_step is None else f"{run_dir.name}@{resume_step}"
        self.run = wandb.init(project=project, dir=str(run_dir), mode=self.mode, name=name,
                              group=run_dir.name, config=config)

    def write(self, rec: dict) -> None:
        self.run.log(scalars(rec), step=rec["step"])

    def close(self) -> None:
        self.run.finish()

    def where(self) -> str:
        if self.mode == "offline":
            return (f"W&B: offline run in {self.run_dir / 'wandb'} "
                    f"(upload: wandb sync {self.run_dir / 'wandb'}/offline-run-*)")
        return f"W&B: project {self.project} ({self.mode})"


def open_sinks(cfg: Config, run_dir: Path, enabled: bool, resume_step: int | None,
               history: list[dict]) -> tuple[list, list[str]]:
    """The sinks `cfg.run` enables, opened on the logging rank, and the notes to print about any
    left off. A sink the config insists on but whose package is missing is a UserError on every
    rank (all ranks share the environment), so that no rank trains on without the others."""
    r = cfg.run
    summary_writer = (_import_tensorboard(required=True) if r.tensorboard else
                      _import_tensorboard(required=False) if r.tensorboard is None and enabled
                      else None)
    wandb = _import_wandb(r.wandb) if r.wandb else None
    if not enabled:
        return [], []
    sinks, notes = [], []
    if summary_writer is not None:
        sinks.append(TensorBoardSink(summary_writer, run_dir / "tensorboard", resume_step,
                                     cfg.to_yaml(), history))
    elif r.tensorboard is None:
        notes.append("TensorBoard: off, the package is not installed "
                     "(pip install bloomtrain[tensorboard])")
    if wandb is not None:
        sinks.append(WandbSink(wandb, r.wandb, run_dir, resume_step, cfg.to_dict()))
    return sinks, notes
