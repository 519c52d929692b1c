"""The trainer's side of checkpoints: what a training checkpoint holds besides the engine's
fragments (train state, optimizer scalars, the layout that wrote it, each rank's RNG), and how a
run resumes from one written by any layout (a loss-spike rollback loads the run's last
checkpoint through the same path).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.checkpoint.writer import CheckpointSaveError
from bloomtrain.config import Config, OptimConfig
from bloomtrain.errors import UserError
from bloomtrain.parallel import comm
from bloomtrain.parallel.tensor.rng import stage_seed
from bloomtrain.checkpoint.load import job_check


# The model settings a checkpoint's weights fix: their shapes, and the LayerNorm epsilon their
# function was trained with. Dropout and the init std are the resuming run's own (a fine-tune
# of real BLOOM weights may add dropout; the bloom-* presets say init std 0.0048 where HF's
# configs say 0.02), so a checkpoint that differs in them only still resumes.
WEIGHTS_FUNCTION = ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                    "layer_norm_epsilon")


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    # The samples of the steps whose update was applied: where the learning-rate schedule is.
    # Megatron steps its scheduler by the batch only when the update was applied (training.py
    # train_step; DeepSpeed's engine the same on an overflow), so skipped steps (an fp16
    # overflow, a non-finite norm, a vetoed loss spike) and samples a rollback skipped do not
    # move the LR.
    lr_samples: int = 0
    # The sample ranges loss-spike rollbacks took out of the data order, one dict per rollback:
    # `start`, `end` (the samples [start, end) are never trained on), `step` (the spike's),
    # `checkpoint_step` (the one rolled back to), `loss`, `zscore`. Also in
    # run_dir/skipped_samples.json, so that a resume from an older checkpoint skips them too.
    skipped_samples: list[dict] = field(default_factory=list)
    # The loss-spike monitor's window: the last train.loss_spike_window losses, oldest first.
    loss_window: list[float] = field(default_factory=list)
    # What the data order was over the samples consumed, as the run that saved this state read
    # it (TrainData.order_digest): a resume on another order is refused (check_data_order).
    data_order: dict | None = None

    def manifest(self) -> dict:
        """The manifest's entries: `train_state` (without an empty `skipped_samples`, so the
        manifest of a run that never rolled back reads as it always did) and `loss_window`.
        Copies, taken now: an async save writes them after training has gone on appending."""
        state = {"step": self.step, "consumed_samples": self.consumed_samples,
                 "skipped_steps": self.skipped_steps, "lr_samples": self.lr_samples}
        if self.skipped_samples:
            state["skipped_samples"] = [dict(r) for r in self.skipped_samples]
        if self.data_order is not None:
            state["data_order"] = dict(self.data_order)
        return {"train_state": state, "loss_window": list(self.loss_window)}

    @classmethod
    def from_manifest(cls, manifest: dict) -> "TrainState":
        state = dict(manifest["train_state"])
        # A checkpoint from before lr_samples was saved: its LR followed consumed_samples.
        state.setdefault("lr_samples", state["consumed_samples"])
        return cls(**state, loss_window=list(manifest.get("loss_window", [])))

    def skipped_ranges(self) -> list[tuple[int, int]]:
        return [(r["start"], r["end"]) for r in self.skipped_samples]


def learning_rate_schedule(optim: dict, train: dict) -> dict:
    """The schedule a config's sections (as saved in a manifest) give: the keys that set the LR
    at a sample, the decay's length resolved (an unset decay_samples is the run's length)."""
    default = OptimConfig()

    def get(key):
        return optim.get(key, getattr(default, key))
    length = train.get("train_samples") or \
        (train.get("train_iters") or 0) * (train.get("global_batch_size") or 0)
    return {"optim.lr": get("lr"), "optim.min_lr": get("min_lr"),
            "optim.warmup_samples": get("warmup_samples"),
            # None: unknown (an imported checkpoint's config may say no run length)
            "optim.decay_samples": get("decay_samples") or length or None,
            "optim.decay_style": get("decay_style")}


def check_schedule(path, manifest: dict, cfg) -> None:
    """Refuse a resume whose learning-rate schedule is not the checkpoint's, as Megatron's
    AnnealingLR.load_state_dict does (unless optim.override_schedule, its
    --override-lr-scheduler): the LR would jump (with decay_samples unset, lengthening the run
    to continue it stretched the decay: 1.9e-4 at the last step, 6.1e-4 at the next)."""
    saved = manifest.get("config")
    if not manifest.get("train_state") or not isinstance(saved, dict) or \
            cfg.optim.override_schedule:
        return
    was = learning_rate_schedule(saved.get("optim") or {}, saved.get("train") or {})
    now = learning_rate_schedule(dataclasses.asdict(cfg.optim), dataclasses.asdict(cfg.train))
    changed = [k for k in now if was[k] != now[k] and None not in (was[k], now[k])]
    if not changed:
        return
    unset = "optim.decay_samples" in changed and cfg.optim.decay_samples is None
    raise UserError(
        f"the learning-rate schedule differs from checkpoint {path}'s: "
        + ", ".join(f"{k} {was[k]} -> {now[k]}" for k in changed)
        + (" (optim.decay_samples is unset: the decay follows the run's length)" if unset
           else "")
        + "; the LR would jump. Keep the checkpoint's ("
        + " ".join(f"{k}={was[k]}" for k in changed)
        + "), or set optim.override_schedule=true to take the new one")


def rng_state() -> dict:
    s = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        s["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return s


def set_rng_state(s: dict) -> None:
    def dec(v):
        return torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8)
    torch.set_rng_state(dec(s["torch"]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(dec(s["cuda"]))


def check_train_manifest(path, manifest: dict) -> None:
    """Structure and types of the manifest's trainer keys (`train_state`, `loss_window`,
    `optimizer`, `topology`, `ranks`), which the checkpoint reader does not follow. Raises
    CheckpointError naming the manifest and the key, so that a damaged or hand-edited manifest
    stops a resume before any state is loaded, not with a TypeError half-way through it."""
    for check in (_train_state_problem, _optimizer_problem, _topology_problem, _ranks_problem):
        problem = check(manifest)
        if problem:
            raise ckpt.CheckpointError(
                f"{Path(path) / 'manifest.json'}: {problem}; training cannot resume from it (its "
                f"weights alone still load: `bloomtrain export-hf`, `bloomtrain generate`)")


def _is_int(v, lo=0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _train_state_problem(manifest: dict) -> str | None:
    state = manifest.get("train_state")
    if not state:  # absent or empty: an imported HF checkpoint, which starts from step 0
        return None
    if not isinstance(state, dict):
        return "train_state must be an object"
    known = {"step", "consumed_samples", "skipped_steps", "skipped_samples", "lr_samples",
             "data_order"}
    unknown = sorted(map(str, set(state) - known))
    if unknown:
        return f"train_state has unknown keys {unknown}"
    for key in ("step", "consumed_samples", "skipped_steps"):
        if not _is_int(state.get(key)):
            return f"train_state.{key} must be a non-negative integer, got {state.get(key)!r}"
    if "lr_samples" in state and not _is_int(state["lr_samples"]):
        return f"train_state.lr_samples must be a non-negative integer, got " \
               f"{state['lr_samples']!r}"
    ranges = state.get("skipped_samples", [])
    if not isinstance(ranges, list) or not all(
            isinstance(r, dict) and _is_int(r.get("start")) and _is_int(r.get("end"))
            and r["start"] <= r["end"] for r in ranges):
        return ("train_state.skipped_samples must be a list of {start, end, ...} with integers "
                "0 <= start <= end")
    order = state.get("data_order")
    if order is not None and not (
            isinstance(order, dict) and _is_int(order.get("samples"), lo=1)
            and _is_int(order.get("train_samples")) and isinstance(order.get("sha256"), str)
            and isinstance(order.get("index", ""), str) and _is_epochs(order.get("epochs", []))):
        return ("train_state.data_order must be {samples: integer >= 1, train_samples: "
                "integer, sha256: string, index: string, epochs: [[integer >= 1, boolean]]}")
    window = manifest.get("loss_window", [])
    if not isinstance(window, list) or not all(_is_number(v) for v in window):
        return "loss_window must be a list of finite numbers"
    return None


def _is_epochs(epochs) -> bool:
    return isinstance(epochs, list) and all(
        isinstance(e, list) and len(e) == 2 and _is_int(e[0], lo=1) and isinstance(e[1], bool)
        for e in epochs)


def _optimizer_problem(manifest: dict) -> str | None:
    scalars = manifest.get("optimizer")
    if scalars is None:
        return None
    if not isinstance(scalars, dict) or not _is_int(scalars.get("step_count", 0)):
        return "optimizer must be an object with step_count a non-negative integer"
    scaler = scalars.get("scaler")
    if scaler is not None and not (
            isinstance(scaler, dict) and _is_number(scaler.get("scale"))
            and scaler["scale"] > 0 and _is_int(scaler.get("growth_tracker"))
            and _is_int(scaler.get("hysteresis_tracker"), lo=-(2 ** 31))):
        return ("optimizer.scaler must be {scale: number > 0, growth_tracker: integer, "
                "hysteresis_tracker: integer}")
    return None


def _topology_problem(manifest: dict) -> str | None:
    topology = manifest.get("topology")
    if topology is not None and not (isinstance(topology, dict) and all(
            _is_int(topology.get(k), lo=1) for k in ("tp", "pp", "dp"))):
        return "topology must be an object with tp, pp and dp positive integers"
    return None


def _ranks_problem(manifest: dict) -> str | None:
    ranks = manifest.get("ranks", {})
    if not isinstance(ranks, dict):
        return "ranks must be an object of rank -> {rng}"
    size = torch.get_rng_state().numel()
    for rank, meta in ranks.items():
        if not isinstance(meta, dict):
            return f"ranks[{rank!r}] must be an object"
        if "rng" not in meta:  # a rank without one keeps the generator it has
            continue
        rng = meta["rng"]
        if not isinstance(rng, dict) or not isinstance(rng.get("torch"), str):
            return f"ranks[{rank!r}].rng must be an object with `torch`, a base64 string"
        for device in ("torch", "cuda"):
            if device not in rng:
                continue
            try:
                raw = base64.b64decode(rng[device], validate=True) \
                    if isinstance(rng[device], str) else None
            except (binascii.Error, ValueError):
                raw = None
            if raw is None or (device == "torch" and len(raw) != size):
                return (f"ranks[{rank!r}].rng.{device} is not a saved generator state (base64 "
                        f"of {size} bytes)" if device == "torch" else
                        f"ranks[{rank!r}].rng.cuda is not base64")
    return None


def topology_meta(layout, p) -> dict:
    """The layout a checkpoint records as the one that wrote it (`p`: the parallel config)."""
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero_stage": p.zero_stage,
            "sequence_parallel": p.sequence_parallel,
            "pp_schedule": p.pp_schedule if p.pp > 1 else None,
            "num_virtual_stages": p.num_virtual_stages}


class TrainCheckpoints:
    def __init__(self, cfg: Config, parts, tokenizer, log=print, order_digest=None):
        self.cfg, self.parts, self.tokenizer, self.log = cfg, parts, tokenizer, log
        # consumed samples -> the data order's digest a save records (TrainData.order_digest)
        self.order_digest = order_digest
        c = cfg.checkpoint
        self.writer = ckpt.CheckpointWriter(c.dir, c.async_save, log=log) if c.dir else None
        # (step, path) of the newest committed training checkpoint of this run: the one it
        # resumed from or last saved.
        self.committed: tuple[int, Path] | None = None
        # An async save in flight: (step, path, whether it is the run's last save).
        self._pending: tuple[int, Path, bool] | None = None

    @property
    def last(self) -> tuple[int, Path] | None:
        """(step, path) of the newest checkpoint of this run, an async save in flight included
        (if it fails, this goes back to the one before). What a loss-spike rollback goes back
        to."""
        return self._pending[:2] if self._pending is not None else self.committed

    def topology_meta(self) -> dict:
        return topology_meta(self.parts.layout, self.cfg.parallel)

    def save(self, state: TrainState) -> Path | None:
        """Save `state` (collective) at a save interval; its checkpoint's path, or None when the
        save failed and training goes on (checkpoint.on_save_error=continue: the next interval
        tries again; `stop` ends the run with the error). The writer has made every rank agree
        on a failure and left nothing behind. An async save's failure is known only when the
        next save, a rollback or the end of the run waits for it; `last` moves to a save only
        once it has committed."""
        return self._save(state, final=False)

    def save_final(self, state: TrainState) -> Path | None:
        """Save `state` (collective) as the run's last save: at its end or on a stop signal,
        committed before it returns (an async one too: the stop's signal handlers are still
        there while it is written, so a second Ctrl-C can cut it short). A failure raises
        whatever checkpoint.on_save_error says: there is no next interval, and a run never exits
        0 without its final state on disk."""
        path = self._save(state, final=True)
        self._settle()
        return path

    def _save(self, state: TrainState, final: bool) -> Path | None:
        if self.writer is None:
            return None
        self._settle()  # the previous async save: committed, or its failure handled
        if self.order_digest is not None:
            state.data_order = self.order_digest(state.consumed_samples)
        engine, scalars = self.parts.engine, self.parts.optimizer.state_dict()
        meta = {**state.manifest(), "optimizer": {"step_count": scalars["step_count"],
                                                  "zero_stage": engine.stage,
                                                  "scaler": scalars["scaler"]},
                "config": self.cfg.to_dict(), "topology": self.topology_meta()}
        try:
            path = self.writer.save(state.step, engine.fragments(), self.parts.shape, meta,
                                    rank_meta={"rng": rng_state()}, tokenizer=self.tokenizer,
                                    keep_last=self.cfg.checkpoint.keep_last)
        except CheckpointSaveError as e:
            self._failed(e, final)
            return None
        self._pending = (state.step, path, final)
        if not self.cfg.checkpoint.async_save:
            self._settle()  # written and committed already
        return path

    def saved_step(self) -> int | None:
        """The step of the newest committed checkpoint of this run, once any save in flight has
        committed or failed."""
        self._settle()
        return self.committed[0] if self.committed is not None else None

    def wait(self) -> None:
        """An async save must be committed before the process ends."""
        self._settle()

    def _settle(self) -> None:
        if self.writer is None:
            return
        pending, self._pending = self._pending, None
        try:
            self.writer.wait()
        except CheckpointSaveError as e:
            self._failed(e, pending is not None and pending[2])
            return
        if pending is not None:
            self.committed = pending[:2]

    def _failed(self, err: CheckpointSaveError, final: bool) -> None:
        """Every rank gets here alike (the writer broadcast the verdict), so every rank goes on
        or stops together."""
        if final:
            raise CheckpointSaveError(f"{err}. It was the run's last save, so the run ends with "
                                      f"this error: its final state is not saved") from err
        if self.cfg.checkpoint.on_save_error == "stop":
            raise CheckpointSaveError(f"{err}. Stopping (checkpoint.on_save_error=stop; with "
                                      f"continue, training goes on and retries at the next "
                                      f"save)") from err
        self.log(f"[checkpoint] WARNING {err}. Training goes on and tries again at the next "
                 f"save (checkpoint.on_save_error=continue)")

    def _find(self) -> Path | None:
        """The checkpoint to resume from, its checksums verified (`auto` verifies each
        candidate, to skip a corrupt one), or None."""
        c = self.cfg.checkpoint
        if c.resume == "none":
            return None
        shared = job_check()
        if c.resume == "auto":
            if not c.dir:
                return None
            found = ckpt.find_latest_valid(c.dir, log=self.log, shared=shared,
                                           skipped=getattr(self.writer, "unusable", None))
            if found is None:
                names = [p.name for _, p in ckpt.list_checkpoints(c.dir)]
                names = shared.common(names) if shared is not None else names
                if names:  # starting over would overwrite them, and metrics.jsonl with them
                    raise UserError(
                        f"checkpoint.resume=auto: {c.dir} holds {_listed(names)}, and none "
                        f"passed its checks (the lines above say why). Nothing was trained or "
                        f"written. Repair or move them away to start over, or name one with "
                        f"checkpoint.resume=PATH")
            return found
        path = ckpt.resolve(c.resume)
        ckpt.verify_shared(path, shared)
        return path

    def _check_history(self, path: Path | None) -> None:
        """A run writes into checkpoint.dir steps after the one it starts from. Checkpoints
        there of higher steps are another history: a fresh run (resume=none) is refused, since
        its saves would be mixed with them; a run resumed from a path (going back to an older
        step, as BLOOM's operators did after a divergence) is told which they are. Under auto
        the higher ones are those it skipped as damaged, and its saves replace them."""
        c = self.cfg.checkpoint
        if not c.dir or c.resume == "auto":
            return
        start = 0
        if path is not None:
            start = (ckpt.read_manifest(path).get("train_state") or {}).get("step", 0)
            start = start if isinstance(start, int) else 0  # check_train_manifest names it
        names = [p.name for s, p in ckpt.list_checkpoints(c.dir) if s > start]
        shared = job_check()
        names = shared.common(names) if shared is not None else names
        if not names:
            return
        if path is None:
            raise UserError(
                f"checkpoint.dir {c.dir} already holds {_listed(names)} of an earlier run, and "
                f"checkpoint.resume=none starts from step 0: its saves would be mixed with them "
                f"(and keep_last would count them). Continue that run with "
                f"checkpoint.resume=auto, or choose another checkpoint.dir, or move them away")
        self.log(f"[checkpoint] WARNING {c.dir} holds {_listed(names)}, after step {start} "
                 f"that this run resumes from: another history. This run's saves replace them "
                 f"as it reaches their steps; until then checkpoint.resume=auto would take the "
                 f"newest of them. Move them away to keep them")

    def resume(self) -> TrainState | None:
        """Load the checkpoint `checkpoint.resume` names into the engine; the train state it
        continues from, or None when the run starts fresh. For every local parameter this
        rank's tp shard of the full parameter is read (only that shard's fragments when the
        checkpoint has the same tp split) and handed to the engine whole, one at a time; the
        engine keeps its own ranges."""
        path = self._find()
        self._check_history(path)
        if path is None:
            return None
        state, manifest = self._load(path)
        check_schedule(path, manifest, self.cfg)
        saved = manifest.get("topology")
        moved = "" if saved in (None, self.topology_meta()) else \
            f" (resharded from {json.dumps(saved)})"
        self.log(f"[checkpoint] resumed from {path} at step {state.step}, "
                 f"{state.consumed_samples} samples consumed{moved}")
        return state

    def rollback(self) -> tuple[TrainState, Path] | None:
        """Load the run's last checkpoint (every rank, as a resume does: weights, optimizer
        moments and scalars, loss scale, RNG); its train state and path, or None when the run
        has none yet. An async save in flight is committed first: it may be the last one."""
        self.wait()
        if self.last is None:
            return None
        with comm.INFLIGHT.long_phase("checkpoint read"):  # inside a step: as long as it takes
            ckpt.verify_shared(self.last[1], job_check())
            return self._load(self.last[1])[0], self.last[1]

    def _load(self, path: Path) -> tuple[TrainState, dict]:
        """Load the checkpoint at `path`, which the job has just verified (verify_shared: each
        file hashed by one rank; at BLOOM-176B the whole is 2.1 TB), into the engine; the train
        state it holds (step 0 for an imported HF checkpoint) and its manifest. The reader
        checks sizes only."""
        reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS,
                                       check_sums=False)
        differ = [f"{k} {getattr(reader.shape, k)} (config: {getattr(self.parts.shape, k)})"
                  for k in WEIGHTS_FUNCTION if getattr(reader.shape, k) !=
                  getattr(self.parts.shape, k)]
        if differ:
            have, want = reader.shape.vocab_size, self.parts.shape.vocab_size
            hint = ""
            if have != want:
                # The config's rows are model.vocab_size (or the tokenizer's) padded up to a
                # multiple: an imported HF model's 320 rows came back as 384, whatever one set.
                multiple = math.gcd(have, self.cfg.model.make_vocab_size_divisible_by)
                hint = (f" (the config's vocabulary is padded to a multiple of "
                        f"model.make_vocab_size_divisible_by, "
                        f"{self.cfg.model.make_vocab_size_divisible_by}: for {have} rows set "
                        f"model.vocab_size={have} model.make_vocab_size_divisible_by="
                        f"{multiple})")
            raise UserError(f"checkpoint {path} has {', '.join(differ)}; resume with the model "
                            f"settings it was saved with{hint}")
        manifest = reader.manifest
        check_train_manifest(path, manifest)
        master, optim = self._local_state(reader)
        self.parts.engine.load_state(master, optim)
        self.parts.optimizer.load_state_dict(manifest.get("optimizer"))
        reader.close()
        state = TrainState()
        if manifest.get("train_state"):  # an imported HF checkpoint starts from step 0
            state = TrainState.from_manifest(manifest)
            restore_rng(manifest, self.topology_meta(), self.parts.topo)
            self.committed = (state.step, Path(path))
        return state, manifest

    def _local_state(self, reader):
        """Lazy maps from local parameter name (and `exp_avg.NAME` / `exp_avg_sq.NAME`) to this
        rank's tp shard of the full tensor, read when the engine asks for it; or, by `range`,
        a flat part of that shard alone (the part a ZeRO rank keeps)."""
        specs, topo = self.parts.specs, self.parts.topo
        # With the error-feedback residuals of every saving dp rank (zero/state.py's rule).
        kinds = ckpt.OPTIM_KINDS + tuple(ckpt.residual_kinds(reader.manifest))

        def where(key: str) -> tuple:  # "NAME" (a master) or "KIND.NAME" (exp_avg, ...)
            kind, _, name = key.partition(".")
            if kind not in kinds:
                kind, name = "model", key
            spec = specs[name]
            return (spec.name, kind, topo.tp_rank, topo.tp_size,
                    spec.tp_dim if topo.tp_size > 1 else None)

        def whole(key: str) -> torch.Tensor:
            return reader.load_tp_shard(*where(key)).to(torch.float32)

        def part(key: str, start: int, stop: int) -> torch.Tensor:
            return reader.load_tp_range(*where(key), start, stop).to(torch.float32)

        names = list(specs)
        master = ckpt.LazyState(names, whole, part)
        if not reader.has("exp_avg"):
            return master, None
        keys = [f"{k}.{n}" for k in kinds for n in names]
        return master, ckpt.LazyState(keys, whole, part)


def restore_rng(manifest: dict, here: dict, topo) -> None:
    """Each rank's default generators (which tensor parallelism's dropout streams fork from),
    when the rank grid (`here`: this job's topology meta) is unchanged, so dropout continues
    exactly. Else rank 0's, from which each stage then seeds its own (rng.stage_seed of one
    draw, the same on every rank): with rank 0's state on every stage, they would all drop the
    same elements."""
    ranks = manifest.get("ranks", {})
    saved = manifest.get("topology") or {}
    same = all(saved.get(k) == here[k] for k in ("tp", "pp", "dp"))
    own = ranks.get(str(topo.rank) if same else "0", {})
    if "rng" in own:
        set_rng_state(own["rng"])
        if not same:
            draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
            torch.manual_seed(stage_seed(draw, topo.pp_rank))


def _listed(names: list[str], most: int = 4) -> str:
    """`names` for a message: all of them up to `most`, else the first and last few."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{len(names)} checkpoints ({', '.join(names[:2])}, ..., {names[-1]})"
