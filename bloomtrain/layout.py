"""The parallel layout of a run: its sizes and every rule that ties the config's sections
together, each in one place.

The rank grid is Megatron-LM's (arXiv 2104.04473, §3): `arange(world).view(pp, dp, tp)`. Tensor-
parallel ranks are innermost, so they are adjacent and land on one node (their all-reduces sit on
the critical path of every layer); pipeline stages are outermost and talk point to point across
nodes.

A `ParallelLayout` is a frozen value. It describes any rank of any grid without a process group
(its coordinates, its pipeline stages, its group members), which is what lets a planner or a test
build the parts of rank 0 of a 3,072-rank job on one laptop; `Topology` (topology.py) creates the
process groups from it. The rules that combine sections live here and only here: dp from the
world size, the model shape against tp, sequence sharding, pipeline schedule and partition,
micro-batches per step (and interleaving's multiple of pp), batch-size ramp-up, and the shape of
the activations a stage receives. `validate(cfg, world_size)` applies all of them, after the
config's own per-key checks, before any process group starts.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from bloomtrain.config import Config, ParallelConfig, TrainConfig
from bloomtrain.errors import UserError
from bloomtrain.model.presets import BloomShape, resolve_model_config
from bloomtrain.parallel.pipeline.partition import check_micro_batches, partition_layers


@dataclass(frozen=True)
class RankCoords:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    num_virtual_stages: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    schedule: str = "1f1b"
    partition: str = "type:transformer|embedding"

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, **kw) -> "ParallelLayout":
        """The layout of `world_size` processes: dp is what tp x pp leaves (the one place it is
        derived)."""
        per_replica = tp * pp
        if world_size % per_replica:
            raise UserError(
                f"the number of processes ({world_size}) is not divisible by parallel.tp * "
                f"parallel.pp ({tp} * {pp} = {per_replica}); change --nproc or the tp/pp sizes")
        return cls(tp=tp, pp=pp, dp=world_size // per_replica, **kw)

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelLayout":
        return cls.for_world(world_size, p.tp, p.pp, num_virtual_stages=p.num_virtual_stages,
                             sequence_parallel=p.sequence_parallel, zero_stage=p.zero_stage,
                             schedule=p.pp_schedule, partition=p.pp_partition)

    # ---- the grid ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size}")
        return RankCoords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp,
                          tp=rank % self.tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def embedding_groups(self) -> list[list[int]]:
        """The two holders of the tied embedding (first and last stage), per (dp, tp)."""
        return [[self.rank_of(0, d, t), self.rank_of(self.pp - 1, d, t)]
                for d in range(self.dp) for t in range(self.tp)]

    def model_groups(self) -> list[list[int]]:
        """tp x pp of one replica: every parameter of the model once (the global grad norm)."""
        return [[self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)]

    # ---- pipeline --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.num_virtual_stages

    def stage_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """Block ranges of every virtual stage, in virtual-stage order."""
        return partition_layers(num_layers, self.num_stages, self.partition,
                                interleaved=self.num_virtual_stages > 1)

    def virtual_stages(self, pp_rank: int) -> list[int]:
        """The virtual stages a pipeline rank runs, as its model chunks 0, 1, ...: chunk c is
        virtual stage c·pp + pp_rank (Megatron's interleaving), so activations go round the
        ring of ranks v times."""
        return [c * self.pp + pp_rank for c in range(self.num_virtual_stages)]

    # ---- batches and activations ---------------------------------------------------------------
    def num_micro_batches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per dp rank in a step of `global_batch` samples."""
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            raise UserError(f"train.global_batch_size ({global_batch}) must be divisible by "
                            f"train.micro_batch_size * dp ({micro_batch} * {self.dp} = "
                            f"{per_step})")
        num_micro = global_batch // per_step
        check_micro_batches(num_micro, self.pp, self.schedule)
        return num_micro

    def local_seq(self, seq_length: int) -> int:
        """Sequence length of the activations between tensor-parallel regions: sequence
        parallelism keeps 1/tp of it on each tp rank."""
        return seq_length // self.tp if self.sequence_parallel else seq_length

    def recv_shape(self, micro_batch: int, seq_length: int, hidden: int) -> tuple[int, int, int]:
        """The hidden states one pipeline stage sends the next: [b, s(/tp), h]."""
        return (micro_batch, self.local_seq(seq_length), hidden)

    # ---- validation ----------------------------------------------------------------------------
    def check(self, shape: BloomShape, cfg: Config) -> None:
        """Every rule that combines the layout with the model and the batch; raises UserError
        saying what to change."""
        self.check_tensor_parallel(shape, cfg.data.seq_length,
                                    cfg.model.make_vocab_size_divisible_by)
        self.check_pipeline(shape.num_layers)

    def check_tensor_parallel(self, shape: BloomShape, seq_length: int,
                               vocab_multiple: int) -> None:
        tp = self.tp
        if self.sequence_parallel and tp == 1:
            raise UserError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if vocab_multiple % tp:
            raise UserError(f"model.make_vocab_size_divisible_by ({vocab_multiple}) must be "
                            f"divisible by parallel.tp ({tp}) so the padded vocabulary splits "
                            f"evenly")
        if shape.num_heads % tp:
            raise UserError(f"model.num_heads ({shape.num_heads}) must be divisible by "
                            f"parallel.tp ({tp})")
        if shape.ffn_hidden_size % tp:
            raise UserError(f"model.ffn_hidden_size ({shape.ffn_hidden_size}) must be divisible "
                            f"by parallel.tp ({tp})")
        if shape.vocab_size % tp:
            raise UserError(f"the padded vocabulary ({shape.vocab_size}) must be divisible by "
                            f"parallel.tp ({tp}); set model.make_vocab_size_divisible_by to a "
                            f"multiple of {tp}")
        if self.sequence_parallel and seq_length % tp:
            raise UserError(f"data.seq_length ({seq_length}) must be divisible by parallel.tp "
                            f"({tp}) with parallel.sequence_parallel=true")

    def check_pipeline(self, num_layers: int) -> None:
        v = self.num_virtual_stages
        if self.schedule == "interleaved":
            if v < 2:
                raise UserError("parallel.pp_schedule=interleaved needs "
                                "parallel.num_virtual_stages >= 2; use 1f1b for one model chunk "
                                "per rank")
            if self.pp < 2:
                raise UserError("parallel.pp_schedule=interleaved needs parallel.pp >= 2")
        elif v != 1:
            raise UserError(f"parallel.num_virtual_stages ({v}) > 1 needs "
                            f"parallel.pp_schedule=interleaved (and parallel.pp >= 2)")
        self.stage_ranges(num_layers)


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size and micro-batches per step as a function of consumed samples, with
    Megatron's batch-size ramp-up (`--rampup-batch-size start increment ramp_samples`, its
    RampupBatchsizeNumMicroBatches): the batch grows from `start` by `increment` every
    `ramp_samples / num_increments` samples and is `global_batch_size` once more than
    `ramp_samples` samples are consumed."""

    global_batch_size: int
    micro_batch_size: int
    layout: ParallelLayout
    rampup: tuple[int, int, int] | None = None

    @classmethod
    def from_config(cls, t: TrainConfig, layout: ParallelLayout) -> "BatchSchedule":
        rampup = None if t.rampup_batch_size is None else tuple(t.rampup_batch_size)
        schedule = cls(t.global_batch_size, t.micro_batch_size, layout, rampup)
        schedule.check(t)
        return schedule

    def check(self, t: TrainConfig) -> None:
        num_micro = self.layout.num_micro_batches(self.global_batch_size, self.micro_batch_size)
        if num_micro < self.layout.pp:
            warnings.warn(f"{num_micro} micro-batches for {self.layout.pp} pipeline stages: most "
                          f"of each step is pipeline bubble ((p-1)/m = "
                          f"{(self.layout.pp - 1) / num_micro:.2f}); raise "
                          f"train.global_batch_size or lower train.micro_batch_size",
                          stacklevel=3)
        if self.rampup is None:
            return
        if len(self.rampup) != 3:
            raise UserError("train.rampup_batch_size must be [start, increment, ramp_samples]")
        start, increment, ramp = self.rampup
        for what, v in (("start", start), ("increment", increment), ("ramp_samples", ramp)):
            if v <= 0:
                raise UserError(f"train.rampup_batch_size {what} must be positive, got {v}")
        if start > self.global_batch_size or (self.global_batch_size - start) % increment:
            raise UserError(f"train.global_batch_size ({self.global_batch_size}) - rampup start "
                            f"({start}) must be >= 0 and divisible by the increment "
                            f"({increment})")
        for b in range(start, self.global_batch_size, increment):
            try:  # every size of the ramp splits over dp and runs under the pipeline schedule
                self.layout.num_micro_batches(b, self.micro_batch_size)
            except UserError as e:
                raise UserError(f"train.rampup_batch_size: at global batch {b}: {e}") from None
        if t.train_samples is None:
            raise UserError("train.rampup_batch_size needs train.train_samples, not train_iters")

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if self.rampup is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup
        num_increments = (self.global_batch_size - start) // increment
        if consumed_samples > ramp_samples or not num_increments:
            return self.global_batch_size
        steps = int(consumed_samples / (ramp_samples / num_increments))
        return min(start + steps * increment, self.global_batch_size)

    def smallest(self) -> int:
        return self.rampup[0] if self.rampup else self.global_batch_size


@dataclass(frozen=True)
class RunLayout:
    """What `validate` resolves: the model shape, the parallel layout and the batch schedule."""

    shape: BloomShape
    layout: ParallelLayout
    batches: BatchSchedule


def validate(cfg: Config, world_size: int, vocab_size: int | None = None) -> RunLayout:
    """Check the whole config for `world_size` processes: each key, then every combination.
    `vocab_size` is the tokenizer's, when known; without one the checks use
    `model.vocab_size` (the padded size must split over tp either way)."""
    cfg.check()
    shape = resolve_model_config(cfg.model, vocab_size or cfg.model.vocab_size or 1)
    layout = ParallelLayout.from_config(cfg.parallel, world_size)
    layout.check(shape, cfg)
    return RunLayout(shape, layout, BatchSchedule.from_config(cfg.train, layout))
