"""Downstream evaluation during training: every `train.eval_harness_interval` steps, and once
more at the end, the harness's `train.eval_harness_tasks` run on the live model. Every rank
takes part with the shards it trains (no checkpoint round trip, the same ZeRO-3 gathers as an
evaluation step); rank 0 runs the harness (bloomtrain.eval.protocol). The record, `{"step",
"consumed_samples", "eval/<task>/<metric>": value, ..., "eval_harness_s"}`, goes to
metrics.jsonl and its sinks.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from bloomtrain.config import Config, parse_tasks
from bloomtrain.errors import UserError
from bloomtrain.eval.model import EvalModel
from bloomtrain.eval.protocol import Executor, worker_loop
from bloomtrain.parallel import comm
from bloomtrain.parallel.tensor.rng import kept_rng


class HarnessHook:
    """Built by every rank before the process groups start (so a missing package stops the run
    at once); `run` is collective."""

    def __init__(self, cfg: Config, tokenizer, log):
        t = cfg.train
        self.tasks = parse_tasks(t.eval_harness_tasks)
        self.interval, self.limit = t.eval_harness_interval, t.eval_harness_limit
        self.include = [t.eval_harness_include_path] if t.eval_harness_include_path else []
        self.tokenizer, self.log = tokenizer, log
        self.micro_rows = t.micro_batch_size
        self.global_batch = t.global_batch_size
        # The harness's task index and the tasks it lacks, found at the first evaluation.
        self.manager, self.unknown = None, {}

    @classmethod
    def from_config(cls, cfg: Config, tokenizer, log) -> "HarnessHook | None":
        t = cfg.train
        if not parse_tasks(t.eval_harness_tasks):
            if t.eval_harness_interval or t.eval_harness_include_path or t.eval_harness_limit:
                raise UserError("train.eval_harness_interval, _include_path and _limit need "
                                "train.eval_harness_tasks (the harness tasks to run)")
            return None
        import importlib.util
        if importlib.util.find_spec("lm_eval") is None:
            raise UserError("train.eval_harness_tasks needs EleutherAI's lm-evaluation-harness: "
                            "pip install 'bloomtrain[eval]'")
        return cls(cfg, tokenizer, log)

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def run(self, parts, dtype: torch.dtype, device, state, metrics) -> None:
        """Evaluate the live model (every rank); rank 0 records and logs the results. A long
        phase for the hang watchdog (comm.INFLIGHT.long_phase), as a checkpoint's write is:
        rank 0 alone imports the harness and reads its tasks' datasets (a download, perhaps)
        while the others wait in the command channel's broadcast, bounded by the collective
        timeout. (Its first evaluation took 12 s on a tiny model; at a 2.4 s hang timeout
        both ranks were ended as hung.)"""
        with comm.INFLIGHT.long_phase("eval harness"):
            self._run(parts, dtype, device, state, metrics)

    def _run(self, parts, dtype: torch.dtype, device, state, metrics) -> None:
        model = EvalModel.from_parts(parts, dtype, device)
        started = time.time()
        # Every rank's generators are put back, not only rank 0's: a tensor-parallel
        # attention draws one number from the default generator per call even in eval
        # (bloomtrain.parallel.tensor.rng), and a rank that kept the draws would drop other
        # elements of the replicated activations than its peers from then on.
        with kept_rng():
            try:
                if parts.topo.rank != 0:
                    worker_loop(model, self.micro_rows)
                    return
                executor = Executor(model, self.micro_rows)
                try:
                    with _quiet_harness():
                        values, alerts = self._tasks(executor, model)
                finally:
                    executor.close()
            finally:
                parts.train(True)
        record = {"step": state.step, "consumed_samples": state.consumed_samples, **values,
                  "eval_harness_s": time.time() - started}
        if alerts:
            record["alerts"] = alerts
        metrics.record(record)
        shown = "; ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in values.items())
        self.log(f"[eval-harness] step {state.step} | {shown or 'no results'} | "
                 f"{record['eval_harness_s']:.1f} s")

    def _tasks(self, executor: Executor, model: EvalModel) -> tuple[dict, list[str]]:
        """Each task on its own, so one that fails (a malformed YAML, a dataset it cannot
        read) is logged, named in the record's `alerts`, and the others and training go on. A
        failure inside a batch the ranks run together is not a task's: the ranks are then out
        of step, and the error ends the run as any collective's would. Stderrs are not computed
        (the harness's bootstrap starts a process pool, which has no place in a training job)."""
        from bloomtrain.eval.lm import BloomtrainLM, default_max_length
        from bloomtrain.eval.run import evaluate, find_tasks, metric_values

        topo = model.topo
        per_replica = max(1, self.global_batch // topo.dp_size)
        lm = BloomtrainLM(executor, self.tokenizer, max_length=default_max_length(self.tokenizer),
                          batch_size=per_replica * (1 if model.dp_lockstep else topo.dp_size),
                          progress=False)
        values, alerts = {}, []
        for task in self.tasks:
            try:
                if self.manager is None:
                    self.manager, self.unknown = find_tasks(self.tasks, self.include)
                if task in self.unknown:
                    raise LookupError(self.unknown[task])
                results = evaluate(lm, [task], self.manager, limit=self.limit, bootstrap_iters=0)
                values.update(metric_values(results))
            except Exception as e:  # noqa: BLE001 - a task's failure must not end the run
                if executor.busy:
                    raise
                text = f"eval harness: task {task} failed: {type(e).__name__}: {e}"
                self.log(f"[eval-harness] {text}")
                alerts.append(text)
        return values, alerts


@contextlib.contextmanager
def _quiet_harness():
    """The harness's info and warnings (one per truncated request) would flood the training
    log; its errors still show."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
