"""The training loop: build the pieces from a validated Config, then a short readable loop.

    bloomtrain train --config FILE [section.key=value ...] [--nproc N]

Under torchrun (or srun with the torchrun variables) every process joins the job from the
environment; with `--nproc N` bloomtrain starts N local workers itself through torch's elastic
launcher, the machinery behind torchrun.
"""
from __future__ import annotations

import base64
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bloomtrain import checkpoint as ckpt
from bloomtrain.config import Config, parse_data_paths
from bloomtrain.model import build_model, resolve_model_config
from bloomtrain.optim import LRSchedule, megatron_tflops
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline import (Timeline, build_pipeline_chunks, pipeline_eval_step,
                                          pipeline_train_step)
from bloomtrain.parallel.tensor import apply_tensor_parallel, tp_split_dim_of
from bloomtrain.parallel.zero import MixedPrecisionOptimizer
from bloomtrain.topology import Topology
from bloomtrain.utils import UserError, atomic_output


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    checkpoint: str | None = None
    run_dir: str = ""
    exit_reason: str = "finished"


# ---- process setup -----------------------------------------------------------------------------

def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def env_from_slurm(env=os.environ) -> None:
    """Under a plain `srun` (one task per GPU, no torchrun), translate SLURM's task variables into
    torchrun's. MASTER_ADDR/MASTER_PORT must come from the job script (see the README)."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UserError(f"running under srun with {env['SLURM_NTASKS']} tasks but {missing} "
                        f"unset: export MASTER_ADDR (the first node's hostname) and MASTER_PORT "
                        f"in the job script, or launch through torchrun")
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def init_distributed(cfg: Config, device: torch.device) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=cfg.parallel.timeout_minutes))


class Logger:
    """Progress lines on stdout and records in run_dir/metrics.jsonl, from rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            with atomic_output(self.path, "w"):
                pass
        elif self.path.exists():
            # Steps after the checkpoint are about to run again: drop their old records so the
            # file reads as one uninterrupted run.
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with atomic_output(self.path, "w") as f:
                f.write("".join(line + "\n" for line in keep))

    def print(self, *args) -> None:
        if self.enabled:
            print(*args, flush=True)

    def record(self, rec: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


# ---- RNG state (JSON-safe) ---------------------------------------------------------------------

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


# ---- the trainer -------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: Config, log=print):
        env_from_slurm()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate(world_size=world)
        self.cfg = cfg
        self.device = resolve_device(cfg)
        init_distributed(cfg, self.device)
        self.topo = Topology.build(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.timeout_minutes)
        if cfg.parallel.comm_stats:
            comm.STATS.enable()
        self.is_logger = self.topo.rank == 0
        self._log = log

        from bloomtrain.data.loader import BatchSizeSchedule, build_train_valid_test_datasets
        from bloomtrain.data.tokenizer import load_tokenizer

        t = cfg.train
        self.tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
        self.shape = resolve_model_config(
            cfg.model, self.tokenizer.vocab_size if self.tokenizer else None)
        torch.manual_seed(t.seed)
        # Every rank builds the same full model from the same seed and keeps its own pieces, so
        # the initial weights do not depend on the layout.
        model = build_model(self.shape, seed=t.seed, device=self.device)
        model.set_activation_checkpointing(t.activation_checkpointing == "full")
        apply_tensor_parallel(model, self.topo, cfg.parallel.sequence_parallel, seed=t.seed,
                              seq_length=cfg.data.seq_length)
        p = cfg.parallel
        if p.pp > 1:
            # This rank keeps only its stages' modules (model chunks); the rest is dropped.
            self.chunks = build_pipeline_chunks(model, self.topo, p.pp_partition,
                                                p.num_virtual_stages)
            self.model = None
            del model
            modules = self.chunks
            for chunk in self.chunks:
                chunk.set_activation_checkpointing(t.activation_checkpointing == "full")
            seq = cfg.data.seq_length // (p.tp if p.sequence_parallel else 1)
            self.recv_shape = (t.micro_batch_size, seq, self.shape.hidden_size)
        else:
            self.chunks, self.model, modules = None, model, [model]
        self.modules = modules
        self.optimizer = MixedPrecisionOptimizer(modules if p.pp > 1 else model, cfg.optim,
                                                 t.precision, self.topo,
                                                 zero_stage=p.zero_stage,
                                                 bucket_size_mb=p.bucket_size_mb)
        self.timeline = None

        self.batches = BatchSizeSchedule(t.global_batch_size, t.micro_batch_size,
                                         self.topo.dp_size, t.rampup_batch_size)
        self.train_samples = (t.train_samples if t.train_samples is not None
                              else t.train_iters * t.global_batch_size)
        o = cfg.optim
        self.lr_schedule = LRSchedule(o.lr, o.min_lr, o.warmup_samples,
                                      o.decay_samples or self.train_samples, o.decay_style)
        if not cfg.data.paths:
            raise UserError("data.paths is empty: preprocess a dataset with `bloomtrain "
                            "preprocess` and set data.paths=[PREFIX_text_document]")
        for _, prefix in parse_data_paths(cfg.data.paths):
            if not Path(prefix + ".idx").is_file():
                raise UserError(f"dataset {prefix}.idx/.bin not found (data.paths); give the "
                                f"prefix that `bloomtrain preprocess` printed")
        eval_runs = (self._num_steps_upper_bound() // t.eval_interval + 1) if t.eval_interval else 1
        valid_samples = t.eval_iters * t.global_batch_size * eval_runs
        self.train_ds, self.valid_ds, _ = build_train_valid_test_datasets(
            cfg.data, self.tokenizer, [self.train_samples, valid_samples, 0], cfg.data.seq_length)
        self.eod_id = self.tokenizer.eod_id if self.tokenizer else None

        self.state = TrainState()
        self.run_dir = Path(cfg.run_dir)
        self.writer = (ckpt.CheckpointWriter(cfg.checkpoint.dir, cfg.checkpoint.async_save,
                                             log=self.print) if cfg.checkpoint.dir else None)
        resume_step = self._maybe_resume()
        self.resumed = resume_step is not None
        self.logger = Logger(self.run_dir, self.is_logger, resume_step)
        if self.is_logger:
            with atomic_output(self.run_dir / "config.yaml", "w") as f:
                f.write(cfg.to_yaml())
        self._stop_signal = None

    def _num_steps_upper_bound(self) -> int:
        t = self.cfg.train
        if t.train_iters is not None:
            return t.train_iters
        smallest = t.rampup_batch_size[0] if t.rampup_batch_size else t.global_batch_size
        return math.ceil(self.train_samples / smallest)

    # ---- checkpoints ---------------------------------------------------------------------
    def _maybe_resume(self) -> int | None:
        c = self.cfg.checkpoint
        if c.resume == "none":
            return None
        if c.resume == "auto":
            if not c.dir:
                return None
            path = ckpt.find_latest_valid(c.dir, log=self.print)
            if path is None:
                return None
        else:
            path = ckpt.resolve(c.resume)
        reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
        manifest = reader.manifest
        if reader.shape != self.shape:
            raise UserError(f"checkpoint {path} has model shape {reader.shape}, but the config "
                            f"gives {self.shape}; resume with the same model settings")
        topo = self.topo

        def local(kind):
            # Full parameter from whatever layout wrote it -> this rank's tensor-parallel shard.
            def load(name):
                dim = tp_split_dim_of(name) if topo.tp_size > 1 else None
                return reader.load_tp_shard(name, kind, topo.tp_rank, topo.tp_size,
                                            dim).to(torch.float32)
            return load
        names = [n for m in self.modules for n, _ in m.named_parameters()]
        master = ckpt.LazyState(names, local("model"))
        optim = None
        if reader.has("exp_avg"):
            loads = {k: local(k) for k in ckpt.OPTIM_KINDS}
            optim = ckpt.LazyState([f"{k}.{n}" for k in ckpt.OPTIM_KINDS for n in names],
                                   lambda key: loads[key.split(".", 1)[0]](key.split(".", 1)[1]))
        self.optimizer.load_state(master, optim, manifest.get("optimizer"))
        reader.close()
        tr = manifest.get("train_state")
        if tr:  # a training checkpoint; an imported HF one starts training from step 0
            self.state = TrainState(**tr)
            ranks = manifest.get("ranks", {})
            # Each rank's own RNG when the rank grid is the same (dropout streams continue
            # exactly); otherwise rank 0's, for every rank.
            grid = ("tp", "pp", "dp")
            saved = manifest.get("topology") or {}
            same = all(saved.get(k) == self._topology_meta()[k] for k in grid)
            own = ranks.get(str(topo.rank) if same else "0", {})
            if "rng" in own:
                set_rng_state(own["rng"])
        self.print(f"[checkpoint] resumed from {path} at step {self.state.step}, "
                   f"{self.state.consumed_samples} samples consumed"
                   f"{'' if manifest.get('topology') in (None, self._topology_meta()) else ' (resharded from ' + json.dumps(manifest.get('topology')) + ')'}")
        return self.state.step

    def _topology_meta(self) -> dict:
        p = self.cfg.parallel
        return {"tp": self.topo.tp_size, "pp": self.topo.pp_size, "dp": self.topo.dp_size,
                "zero_stage": p.zero_stage, "sequence_parallel": p.sequence_parallel,
                "pp_schedule": p.pp_schedule if p.pp > 1 else None,
                "num_virtual_stages": p.num_virtual_stages}

    def _fragments(self) -> list[ckpt.Fragment]:
        """This rank's unique pieces of the fp32 master weights and Adam moments, in logical
        (full-parameter) coordinates; nothing is gathered."""
        topo, frags = self.topo, []
        for name, fr in self.optimizer.sharded_state().items():
            if fr["duplicate"]:
                continue  # another rank writes it (tp-replicated, or the tied copy)
            dim = tp_split_dim_of(name) if topo.tp_size > 1 else None
            full_shape = list(fr["shape"])
            if dim is not None:
                full_shape[dim] *= topo.tp_size
            frags.append(ckpt.Fragment(
                name=name, shape=tuple(full_shape), tp_dim=dim,
                tp_rank=topo.tp_rank if dim is not None else 0,
                tp_size=topo.tp_size if dim is not None else 1,
                offset=fr["offset"], numel=fr["numel"],
                tensors={"model": fr["master"], "exp_avg": fr["exp_avg"],
                         "exp_avg_sq": fr["exp_avg_sq"]}))
        return frags

    def save(self) -> Path | None:
        c = self.cfg.checkpoint
        if not c.dir:
            return None
        meta = {
            "train_state": asdict(self.state),
            "optimizer": self.optimizer.scalar_state(),
            "config": self.cfg.to_dict(),
            "topology": self._topology_meta(),
        }
        return self.writer.save(self.state.step, self._fragments(), self.shape, meta,
                                rank_meta={"rng": rng_state()}, tokenizer=self.tokenizer,
                                keep_last=c.keep_last, owned=True)

    # ---- steps ---------------------------------------------------------------------------
    def print(self, *args) -> None:
        if self.is_logger:
            self._log(*args)

    def _micro_batches(self, dataset, start: int, gbs: int):
        from bloomtrain.data.loader import get_micro_batches
        mbs = get_micro_batches(dataset, start, gbs, self.cfg.train.micro_batch_size,
                                self.topo.dp_rank, self.topo.dp_size, eod_id=self.eod_id,
                                eod_mask_loss=self.cfg.data.eod_mask_loss)
        return [{k: v.to(self.device) for k, v in mb.items()} for mb in mbs]

    def _set_mode(self, train: bool) -> None:
        for m in self.modules:
            m.train(train)

    def _pipeline_kwargs(self) -> dict:
        return dict(recv_shape=self.recv_shape, dtype=self.optimizer.compute_dtype,
                    timeout=self.cfg.parallel.timeout_minutes * 60)

    def train_step(self, micro_batches) -> tuple[float, object]:
        self._set_mode(True)
        n = len(micro_batches)
        if self.chunks is not None:
            loss = pipeline_train_step(self.cfg.parallel.pp_schedule, self.chunks, micro_batches,
                                       self.topo, scale_loss=self.optimizer.scale_loss,
                                       timeline=self.timeline, **self._pipeline_kwargs())
            loss = torch.tensor(loss, dtype=torch.float32, device=self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for mb in micro_batches:
                mb_loss = self.model(mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"])
                # Each micro-batch contributes 1/n: the step's loss is the mean over
                # micro-batches, exactly as one process running the whole batch averages it.
                self.optimizer.scale_loss(mb_loss / n).backward()
                loss += mb_loss.detach()
            loss /= n
        lr = self.lr_schedule(self.state.consumed_samples)
        result = self.optimizer.step(lr)
        if self.topo.dp_group is not None:
            dist.all_reduce(loss, group=self.topo.dp_group)
            loss /= self.topo.dp_size
        return float(loss), result, lr

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_ds is None or len(self.valid_ds) == 0:
            return None
        self._set_mode(False)
        t = self.cfg.train
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        for i in range(t.eval_iters):
            start = i * t.global_batch_size
            if start + t.global_batch_size > len(self.valid_ds):
                break
            mbs = self._micro_batches(self.valid_ds, start, t.global_batch_size)
            if self.chunks is not None:
                total += pipeline_eval_step(self.cfg.parallel.pp_schedule, self.chunks, mbs,
                                            self.topo, **self._pipeline_kwargs()) * len(mbs)
                count += len(mbs)
                continue
            for mb in mbs:
                total += self.model(mb["tokens"], labels=mb["labels"], loss_mask=mb["loss_mask"])
                count += 1
        if count == 0:
            return None
        if self.topo.dp_group is not None:
            dist.all_reduce(total, group=self.topo.dp_group)
            total /= self.topo.dp_size
        return float(total / count)

    def _install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self._stop_signal = signum
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass

    def _should_stop(self, start_time: float) -> str | None:
        """Operator and scheduler controls, agreed across ranks so every rank saves together."""
        t = self.cfg.train
        reason = 0
        if self._stop_signal is not None:
            reason = 1
        elif t.kill_switch_path and os.path.exists(t.kill_switch_path):
            reason = 2
        elif t.exit_duration_minutes and (time.time() - start_time) / 60 >= t.exit_duration_minutes:
            reason = 3
        if dist.is_initialized():
            r = torch.tensor([reason], dtype=torch.int32)
            dist.all_reduce(r, op=dist.ReduceOp.MAX)
            reason = int(r)
        return {0: None, 1: "signal", 2: "kill switch", 3: "exit_duration_minutes"}[reason]

    def _time_to_save(self, last_save: float) -> bool:
        c = self.cfg.checkpoint
        due = bool(c.save_interval and self.state.step % c.save_interval == 0)
        if c.save_interval_minutes and not due:
            flag = torch.tensor([int(time.time() - last_save >= 60 * c.save_interval_minutes)])
            if dist.is_initialized():  # rank clocks differ; rank 0 decides
                dist.broadcast(flag, src=0)
            due = bool(flag)
        return due

    def run(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        result = TrainResult(state=self.state, run_dir=str(self.run_dir))
        self._install_signal_handlers()
        layout = (f"tp={self.topo.tp_size} pp={self.topo.pp_size} dp={self.topo.dp_size} "
                  f"zero={cfg.parallel.zero_stage}"
                  f"{' schedule=' + cfg.parallel.pp_schedule if self.topo.pp_size > 1 else ''}"
                  f"{' sp' if cfg.parallel.sequence_parallel else ''} precision={t.precision}")
        self.print(f"[train] model {self.shape.num_parameters():,} parameters "
                   f"(L={self.shape.num_layers}, h={self.shape.hidden_size}, "
                   f"heads={self.shape.num_heads}, vocab={self.shape.vocab_size}); {layout}; "
                   f"{self.train_samples:,} samples, run dir {self.run_dir}")
        start_time = last_save = time.time()
        # A run resumed from a checkpoint of this very step has nothing new to save.
        saved_step = self.state.step if self.resumed else None
        # Accumulated since the last record: loss over applied steps, time and tokens over all.
        interval_loss, interval_steps, interval_count = 0.0, 0, 0
        interval_time, interval_tokens = 0.0, 0
        while self.state.consumed_samples < self.train_samples:
            gbs = self.batches.global_batch_size_at(self.state.consumed_samples)
            t0 = time.time()
            micro_batches = self._micro_batches(self.train_ds, self.state.consumed_samples, gbs)
            want_timeline = (self.chunks is not None and cfg.parallel.pp_timeline
                             and (self.state.step + 1) % t.log_interval == 0)
            self.timeline = Timeline() if want_timeline else None
            loss, res, lr = self.train_step(micro_batches)
            if self.timeline is not None:
                self.timeline.save(self.run_dir, self.state.step + 1)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.time() - t0
            self.state.step += 1
            self.state.consumed_samples += gbs
            result.losses.append(loss)
            if res.skipped:
                self.state.skipped_steps += 1
                scale = (f"; loss scale {res.loss_scale:g} -> {self.optimizer.loss_scale:g}"
                         if res.loss_scale is not None else "")
                self.print(f"[train] WARNING step {self.state.step}: non-finite gradient norm "
                           f"({res.grad_norm}), step skipped{scale} "
                           f"({self.state.skipped_steps} skipped so far)")
            else:
                interval_loss += loss
                interval_steps += 1
            interval_time += dt
            interval_count += 1
            interval_tokens += gbs * cfg.data.seq_length
            rec = None
            if self.state.step % t.log_interval == 0 or res.skipped:
                steps = max(interval_steps, 1)
                step_time = interval_time / interval_count
                tflops = megatron_tflops(gbs, cfg.data.seq_length, self.shape.num_layers,
                                         self.shape.hidden_size, self.shape.vocab_size, step_time,
                                         self.topo.world_size, t.activation_checkpointing == "full")
                rec = {
                    "step": self.state.step,
                    "consumed_samples": self.state.consumed_samples,
                    "loss": interval_loss / steps if interval_steps else loss,
                    "lr": lr,
                    "grad_norm": res.grad_norm,
                    "global_batch_size": gbs,
                    "step_time_s": step_time,
                    "tokens_per_s": interval_tokens / interval_time if interval_time else 0.0,
                    "tflops_per_device": tflops,
                    "skipped_steps": self.state.skipped_steps,
                    "layout": layout,
                }
                if res.loss_scale is not None:
                    rec["loss_scale"] = self.optimizer.loss_scale
                if comm.STATS.enabled:
                    # This rank's collective traffic since the last record, per kind and group.
                    rec["comm"] = {f"{k}/{g}": v for (k, g), v in comm.STATS.snapshot().items()}
                    comm.STATS.reset()
                if res.skipped:
                    rec["skipped"] = True
                self.logger.record(rec)
                self.print(f"step {self.state.step:6d} | samples {self.state.consumed_samples:9d}"
                           f" | loss {rec['loss']:.4f} | lr {lr:.3e} | grad_norm "
                           f"{res.grad_norm:.3f} | {step_time:.3f} s/step | "
                           f"{rec['tokens_per_s']:.0f} tok/s | {tflops:.3f} TFLOP/s/dev")
                interval_loss, interval_steps, interval_count = 0.0, 0, 0
                interval_time, interval_tokens = 0.0, 0
            if t.eval_interval and self.state.step % t.eval_interval == 0:
                self._eval_and_log(result)
            stop = self._should_stop(start_time)
            if self._time_to_save(last_save) and not stop:
                result.checkpoint = str(self.save())
                last_save, saved_step = time.time(), self.state.step
            if stop:
                self.print(f"[train] stopping at step {self.state.step}: {stop}; saving")
                result.checkpoint = str(self.save())
                result.exit_reason = stop
                return result
        if not (t.eval_interval and self.state.step % t.eval_interval == 0):
            self._eval_and_log(result)
        if cfg.checkpoint.dir and saved_step != self.state.step:
            result.checkpoint = str(self.save())
        return result

    def _eval_and_log(self, result: TrainResult) -> None:
        eval_loss = self.evaluate()
        if eval_loss is None:
            return
        result.eval_loss = eval_loss
        ppl = math.exp(min(eval_loss, 50.0))
        self.logger.record({"step": self.state.step,
                            "consumed_samples": self.state.consumed_samples,
                            "eval_loss": eval_loss, "eval_ppl": ppl})
        self.print(f"[eval] step {self.state.step} | loss {eval_loss:.4f} | ppl {ppl:.2f}")


def train(cfg: Config, log=print) -> TrainResult:
    trainer = Trainer(cfg, log=log)
    try:
        return trainer.run()
    finally:
        if trainer.writer is not None:
            trainer.writer.wait()  # an async save must be committed before the process ends
        if dist.is_initialized():
            dist.barrier()


# ---- CLI ---------------------------------------------------------------------------------------

def _worker_entry(config_path, overrides):
    cfg = Config.load(config_path, overrides)
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(nproc: int, config_path, overrides) -> None:
    """Start `nproc` workers on this machine with torch's elastic launcher (what torchrun uses),
    on a free localhost port."""
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                      run_id=f"bloomtrain-{os.getpid()}", rdzv_backend="c10d",
                      rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, monitor_interval=0.2,
                      start_method="spawn")
    try:
        elastic_launch(lc, _worker_entry)(config_path, overrides)
    except ChildFailedError as e:
        first = min(e.failures)
        raise UserError(f"worker rank {first} failed (of {len(e.failures)} failed): "
                        f"{e.failures[first].message}") from None


def cmd_train(args) -> int:
    cfg = Config.load(args.config, args.overrides)
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        cfg.validate(world_size=args.nproc)  # fail before starting any worker
        launch_local(args.nproc, args.config, args.overrides)
        return 0
    train(cfg)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a BLOOM model",
                       description="Train a BLOOM model from a YAML config plus overrides.")
    p.add_argument("--config", help="YAML config file (sections model, parallel, data, optim, "
                                    "train, checkpoint, run_dir)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch N local worker processes (not needed under torchrun/srun)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.train_iters=100 parallel.tp=2")
    p.set_defaults(func=cmd_train)
