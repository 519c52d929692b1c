"""The checks that span the config's sections, run once per run before anything starts:
`validate(cfg, world_size)` checks each key, then every rule that combines them (the layout's,
bloomtrain.layout; the batch's; the training, checkpoint, data and launch settings'; the
attention kernel's, bloomtrain.model.kernel_choice), and one UserError lists every failure.
Torch-free: the launcher runs it before any worker or torch import."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from bloomtrain.config import Config, parse_tasks
from bloomtrain.errors import UserError, each_problem, raise_all
from bloomtrain.files import unwritable
from bloomtrain.layout import BatchSchedule, ParallelLayout
from bloomtrain.model.kernel_choice import check_attention
from bloomtrain.model.presets import BloomShape, resolve_model_config


@dataclass(frozen=True)
class RunLayout:
    """What `validate` resolves: the model shape, the parallel layout and the batch schedule."""

    shape: BloomShape
    layout: ParallelLayout
    batches: BatchSchedule

    def with_vocab(self, cfg: Config, vocab_size: int) -> "RunLayout":
        """The run with the tokenizer's vocabulary (known once it is loaded): the model's rows
        follow it, padded as the config says, and must still split over tp."""
        shape = resolve_model_config(cfg.model, vocab_size)
        self.layout.check_tensor_parallel(shape, cfg.data.seq_length,
                                          cfg.model.make_vocab_size_divisible_by)
        return replace(self, shape=shape)


# How much longer than the hang timeout the rendezvous must wait for a job to re-form after a
# failure: the watchdog's poll (<= 1 s) and its grace after a raised op (10 s), and the elastic
# agent noticing and stopping its workers, with room to spare.
RESTART_MARGIN_S = 30


def check_run(cfg: Config, max_restarts: int = 0, nnodes: int = 1) -> None:
    """The rules between the training, checkpoint, data and launch settings."""
    raise_all(run_problems(cfg, max_restarts, nnodes))


def run_problems(cfg: Config, max_restarts: int = 0, nnodes: int = 1) -> list[str]:
    """What `check_run` finds wrong, one message per broken rule."""
    t, c, p, out = cfg.train, cfg.checkpoint, cfg.parallel, []
    if t.on_loss_spike == "rollback" and not c.dir:
        out.append("train.on_loss_spike=rollback needs checkpoint.dir (it reloads the last "
                   "checkpoint)")
    if why := unwritable(cfg.run_dir):  # a file there was a NotADirectoryError traceback
        out.append(f"run_dir {cfg.run_dir} cannot be written: {why}; point run_dir at a "
                   f"writable directory")
    if c.dir and (why := unwritable(c.dir)):
        # Found here, not at the first save: with on_save_error=continue a run would train to
        # its end and keep nothing.
        out.append(f"checkpoint.dir {c.dir} cannot be written: {why}; point checkpoint.dir at "
                   f"a writable filesystem")
    if c.resume not in ("none", "auto") and not os.path.exists(c.resume):
        # Said here, before run_dir and checkpoint.dir are created and locked for nothing.
        out.append(f"checkpoint.resume {c.resume} does not exist; give a checkpoint (a step "
                   f"directory, or a directory of them), auto or none")
    if parse_tasks(t.eval_harness_tasks) and not cfg.data.tokenizer:
        out.append("train.eval_harness_tasks needs data.tokenizer: the harness sends text")
    if max_restarts and (c.resume != "auto" or not c.dir):
        out.append(f"--max-restarts {max_restarts} restarts the workers, which then resume "
                   f"from checkpoint.resume={c.resume!r}"
                   f"{'' if c.dir else ' with no checkpoint.dir'}: set checkpoint.dir and "
                   f"checkpoint.resume=auto so that a restart continues from the job's last "
                   f"checkpoint")
    rdzv_s = p.rdzv_timeout_minutes * 60
    if max_restarts and nnodes > 1 and rdzv_s < p.hang_timeout_s + RESTART_MARGIN_S:
        # After a failure the first node to restart waits at the rendezvous for the others,
        # whose workers may notice only when their watchdog fires (a cut link raises nothing).
        out.append(f"--max-restarts {max_restarts} over {nnodes} nodes: the rendezvous timeout "
                   f"({rdzv_s:g} s, parallel.rdzv_timeout_minutes or --rdzv-timeout) must "
                   f"exceed the hang timeout ({p.hang_timeout_s:g} s, "
                   f"parallel.hang_timeout_minutes) by {RESTART_MARGIN_S} s or more: after a "
                   f"failure the nodes that restart first wait that long for the others, whose "
                   f"watchdogs notice it within the hang timeout; raise the rendezvous timeout "
                   f"or lower the hang timeout")
    return out


def validate(cfg: Config, world_size: int, *, max_restarts: int = 0,
             nnodes: int = 1) -> RunLayout:
    """Check the whole config for `world_size` processes, once per run and before anything
    starts: each key, then every rule that combines them, all of whose failures one UserError
    lists. The model has `model.vocab_size` rows until `RunLayout.with_vocab` gives it the
    tokenizer's; `max_restarts` and `nnodes` are the launcher's."""
    cfg.check()
    problems = run_problems(cfg, max_restarts, nnodes)
    try:
        check_attention(cfg.train.attention, cfg.model.attention_dropout)
    except UserError as e:
        problems += each_problem(e)
    try:
        shape = resolve_model_config(cfg.model, cfg.model.vocab_size or 1)
    except UserError as e:  # no shape: the layout's rules cannot be judged
        raise_all(problems + each_problem(e))
    p, batches = cfg.parallel, None
    try:
        layout = ParallelLayout.from_config(p, world_size)
    except UserError as e:
        problems += each_problem(e)
        # The other rules hold whatever the process count: judged on one replica. How the
        # batch splits over dp waits for a dp.
        layout = ParallelLayout.from_config(p, p.tp * p.pp)
    else:
        try:
            batches = BatchSchedule.from_config(cfg.train, layout)
            t = cfg.train
            if t.train_samples is not None and not batches.fits(0, t.train_samples):
                problems.append(f"train.train_samples ({t.train_samples}) is less than the "
                                f"first global batch ({batches.global_batch_size_at(0)}): "
                                f"no step would run; raise it")
        except UserError as e:
            problems += each_problem(e)
    problems += layout.problems(shape, cfg)
    if p.zero_secondary_shard and p.zero_stage == 3 and layout.world_size == world_size:
        # Judged before any process group or file: the processes per node are the launcher's
        # (LOCAL_WORLD_SIZE in a worker; --nproc here, the world over the nodes).
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or max(world_size // nnodes, 1))
        if problem := layout.secondary_shard_problem(per_node):
            problems.append(problem)
    raise_all(problems)
    return RunLayout(shape, layout, batches)
