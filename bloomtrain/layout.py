"""The parallel layout of a run and the rules that tie it to the model and the batch, each
stated here once and applied by bloomtrain.validate once per run, before any process group
starts.

The rank grid is Megatron-LM's (arXiv 2104.04473, §3), `arange(world).view(pp, dp, tp)`: tp ranks
innermost, on one node, pipeline stages outermost. Stages hold blocks by Megatron-DeepSpeed's
`--pp-partition-method` (BLOOM's `type:transformer|embedding`).
"""
from __future__ import annotations

import functools

import re
import warnings
from dataclasses import dataclass

from bloomtrain.config import Config, ParallelConfig, TrainConfig
from bloomtrain.errors import UserError, each_problem, raise_all
from bloomtrain.model.presets import BloomShape


@dataclass(frozen=True)
class RankCoords:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of a grid and what they imply. A value without process groups: it describes any
    rank of any grid (a planner or a test builds rank 0 of a 3,072-rank job on a laptop), and
    `Topology` creates the groups from it."""

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

    def label(self) -> str:
        """The layout as a run's records and the planner print it: `tp=4 pp=12 dp=8 zero=1
        schedule=1f1b` (then `v=N` when interleaved, `sp` with sequence parallelism)."""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} zero={self.zero_stage}"
                + (f" schedule={self.schedule}" if self.pp > 1 else "")
                + (f" v={self.num_virtual_stages}" if self.num_virtual_stages > 1 else "")
                + (" sp" if self.sequence_parallel else ""))

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

    def dp_groups_by_node(self, per_node: int) -> list[list[list[int]]]:
        """Each dp group's ranks split by node (nodes of `per_node` ranks, numbered as the
        launcher numbers them: global rank // per_node)."""
        out = []
        for ranks in self.dp_groups():
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(r // per_node, []).append(r)
            out.append(list(by_node.values()))
        return out

    def secondary_shard_problem(self, per_node: int) -> str | None:
        """hpZ (parallel.zero_secondary_shard) keeps a copy of the weights within each node's
        part of a dp group: every dp group needs the same number of ranks, two or more, on
        each node."""
        sizes = {len(n) for groups in self.dp_groups_by_node(per_node) for n in groups}
        if len(sizes) == 1 and min(sizes) >= 2:
            return None
        return (f"parallel.zero_secondary_shard needs at least 2 ranks of every dp group on "
                f"each node, as many on every node: with {per_node} processes per node and "
                f"tp={self.tp}, pp={self.pp}, dp={self.dp}, the dp groups have {sorted(sizes)} "
                f"ranks per node; raise dp within a node or turn it off")

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
    # Each rule is checked whatever the others found: one UserError lists every broken rule
    # (errors.raise_all), so a layout is fixed in one attempt, not one rule per attempt.
    def check(self, shape: BloomShape, cfg: Config) -> None:
        """Every rule that combines the layout with the model and the batch; raises UserError
        saying what to change."""
        raise_all(self.problems(shape, cfg))

    def problems(self, shape: BloomShape, cfg: Config) -> list[str]:
        """What `check` finds wrong, one message per broken rule."""
        out = self.tensor_parallel_problems(shape, cfg.data.seq_length,
                                            cfg.model.make_vocab_size_divisible_by)
        out += self.pipeline_problems(shape.num_layers)
        p = cfg.parallel
        return out + self.training_problems(p.grad_reduce_dtype, p.weight_gather_dtype,
                                            cfg.train.compile)

    def training_problems(self, grad_reduce: str, weight_gather: str,
                          compile_: bool) -> list[str]:
        """The rules between the layout and the training settings (which the planner's search
        applies to its candidates too)."""
        out = []
        if self.dp == 1 and (grad_reduce != "fp32" or weight_gather != "auto"):
            # Accepted, they would change nothing and say nothing.
            out.append("parallel.grad_reduce_dtype / weight_gather_dtype compress the data-"
                       "parallel traffic, and at dp 1 there is none: leave them at their "
                       "defaults, or run with more data-parallel ranks")
        if self.schedule == "zb-h1" and compile_:
            out.append("parallel.pp_schedule=zb-h1 with train.compile=true would defer "
                       "nothing: the compiled blocks compute their weight gradients inside "
                       "the input-gradient pass (Dynamo does not trace zb-h1's deferring "
                       "linear), so set one of them to its default")
        return out

    def check_tensor_parallel(self, shape: BloomShape, seq_length: int,
                               vocab_multiple: int) -> None:
        raise_all(self.tensor_parallel_problems(shape, seq_length, vocab_multiple))

    def tensor_parallel_problems(self, shape: BloomShape, seq_length: int,
                                 vocab_multiple: int) -> list[str]:
        tp, out = self.tp, []
        if self.sequence_parallel and tp == 1:
            out.append("parallel.sequence_parallel=true needs parallel.tp > 1")
        if vocab_multiple % tp:
            out.append(f"model.make_vocab_size_divisible_by ({vocab_multiple}) must be "
                       f"divisible by parallel.tp ({tp}) so the padded vocabulary splits evenly")
        if shape.num_heads % tp:
            out.append(f"model.num_heads ({shape.num_heads}) must be divisible by parallel.tp "
                       f"({tp})")
        if shape.ffn_hidden_size % tp:
            out.append(f"model.ffn_hidden_size ({shape.ffn_hidden_size}) must be divisible by "
                       f"parallel.tp ({tp})")
        # Not said twice: the padding rule above, once followed, makes the padded size split.
        if shape.vocab_size % tp and not vocab_multiple % tp:
            out.append(f"the padded vocabulary ({shape.vocab_size}) must be divisible by "
                       f"parallel.tp ({tp}); set model.make_vocab_size_divisible_by to a "
                       f"multiple of {tp}")
        if self.sequence_parallel and seq_length % tp:
            out.append(f"data.seq_length ({seq_length}) must be divisible by parallel.tp ({tp}) "
                       f"with parallel.sequence_parallel=true")
        return out

    def check_pipeline(self, num_layers: int) -> None:
        raise_all(self.pipeline_problems(num_layers))

    def pipeline_problems(self, num_layers: int) -> list[str]:
        v, out = self.num_virtual_stages, []
        if self.schedule == "interleaved":
            if v < 2:
                out.append("parallel.pp_schedule=interleaved needs parallel.num_virtual_stages "
                           ">= 2; use 1f1b for one model chunk per rank")
            if self.pp < 2:
                out.append("parallel.pp_schedule=interleaved needs parallel.pp >= 2")
        elif v != 1:
            out.append(f"parallel.num_virtual_stages ({v}) > 1 needs "
                       f"parallel.pp_schedule=interleaved (and parallel.pp >= 2)"
                       + ("; zb-h1 runs one model chunk per rank (ZB-H1 is 1F1B's layout, "
                          "not the interleaved one)" if self.schedule == "zb-h1" else ""))
        if self.schedule == "zb-h1" and self.zero_stage == 3:
            out.append("parallel.pp_schedule=zb-h1 does not compose with "
                       "parallel.zero_stage=3: ZeRO-3 gathers a block's weights for its "
                       "backward and frees them when that backward pass ends, while zb-h1 "
                       "splits each backward into two passes (input gradients, then the "
                       "weight gradients much later); use zero_stage <= 2 or pp_schedule=1f1b")
        try:
            self.stage_ranges(num_layers)
        except UserError as e:
            out += each_problem(e)
        return out


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
        if problem := self.ramp_problem():
            raise UserError(problem)
        if t.train_samples is None:
            raise UserError("train.rampup_batch_size needs train.train_samples, not train_iters")

    def ramp_problem(self) -> str | None:
        """Why a batch size of the (well-formed) ramp-up cannot run on the layout: every one
        must split over dp and run under the pipeline schedule."""
        start, increment, ramp = self.rampup or (self.global_batch_size, 1, 0)
        for b in range(start, self.global_batch_size, increment):
            try:
                self.layout.num_micro_batches(b, self.micro_batch_size)
            except UserError as e:  # it names the ramp's size, which the user did not set
                text = str(e).replace(f"train.global_batch_size ({b})", f"its batch {b}")
                return (f"train.rampup_batch_size [{start}, {increment}, {ramp}]: {text}; "
                        f"change the ramp's start or increment")
        return None

    def global_batch_size_at(self, consumed_samples: int) -> int:
        return rampup_batch_size_at(consumed_samples, self.global_batch_size, self.rampup)

    def smallest(self) -> int:
        return self.rampup[0] if self.rampup else self.global_batch_size

    def fits(self, consumed_samples: int, train_samples: int) -> bool:
        """Whether the next step's whole batch lies within `train_samples`. Megatron's
        train_iters (training.py update_train_iters) throws away a partial last batch: 41
        samples at a batch of 8 are 5 steps, and a sixth read samples the datasets were never
        built for."""
        return consumed_samples + self.global_batch_size_at(consumed_samples) <= train_samples

    def steps_until(self, train_samples: int, consumed_samples: int = 0) -> int:
        """The steps from `consumed_samples` while `fits` holds: Megatron's train_iters for a
        run of `train_samples` (the ramp's batches one by one, then the constant phase's whole
        batches)."""
        return self._walk(train_samples, consumed_samples)[0]

    def trained_samples(self, train_samples: int) -> int:
        """The samples those steps consume: train_samples less a partial last batch."""
        return self._walk(train_samples, 0)[1]

    def last_step_start(self, train_samples: int) -> int | None:
        """The samples consumed before the last step of a run of `train_samples` (None: it has
        no step): where that step's learning rate is read, the highest a warmup reaches."""
        consumed, last = 0, None
        while True:
            b = self.global_batch_size_at(consumed)
            if b == self.global_batch_size:
                more = max(train_samples - consumed, 0) // b
                return consumed + (more - 1) * b if more else last
            if b <= 0 or consumed + b > train_samples:
                return last
            last, consumed = consumed, consumed + b

    def _walk(self, train_samples: int, consumed: int) -> tuple[int, int]:
        steps = 0
        while True:
            b = self.global_batch_size_at(consumed)
            if b <= 0:
                raise UserError(f"the batch size at {consumed} samples is {b}; "
                                f"train.rampup_batch_size must start above 0")
            if b == self.global_batch_size:  # past the ramp: the rest is one division
                more = max(train_samples - consumed, 0) // b
                return steps + more, consumed + more * b
            if consumed + b > train_samples:
                return steps, consumed
            consumed, steps = consumed + b, steps + 1


def rampup_batch_size_at(consumed_samples: int, global_batch_size: int,
                         rampup: tuple[int, int, int] | None) -> int:
    """Megatron's RampupBatchsizeNumMicroBatches.update: the global batch after
    `consumed_samples` under `--rampup-batch-size start increment ramp_samples`."""
    if rampup is None:
        return global_batch_size
    start, increment, ramp_samples = rampup
    num_increments = (global_batch_size - start) // increment
    if consumed_samples > ramp_samples or not num_increments:
        return global_batch_size
    steps = int(consumed_samples / (ramp_samples / num_increments))
    return min(start + steps * increment, global_batch_size)


# ---- pipeline partitions and micro-batches ----------------------------------------------------

# Layer class names as DeepSpeed's PipelineModule sees BLOOM in Megatron-DeepSpeed, so that a
# `type:REGEX` method selects what it selected there. The tied LM head is an EmbeddingPipe too;
# ln_f travels with it.
_EMBEDDING_UNIT = "EmbeddingPipe"
_BLOCK_UNIT = "ParallelTransformerLayerPipe"


def _split_units(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` for the 0/1 weights of the type: method: the weighted
    units are split as evenly as possible (the first total % num_parts parts get one more, so
    the largest part is ceil(total / num_parts), the least any split can achieve), and each
    zero-weight unit joins the part of the unit before it. Returns each unit's part."""
    base, extra = divmod(sum(weights), num_parts)
    quota = [base + (p < extra) for p in range(num_parts)]
    part_of, part, taken = [], 0, 0
    for w in weights:
        if w:
            while part < num_parts - 1 and taken >= quota[part]:
                part, taken = part + 1, 0
            taken += 1
        part_of.append(part)
    return part_of


def _parse_counts(method, num_stages: int) -> list[int] | None:
    if isinstance(method, (list, tuple)):
        items = list(method)
    elif isinstance(method, str) and re.fullmatch(r"\[?\s*\d+(\s*,\s*\d+)*\s*\]?", method.strip()):
        items = method.strip().strip("[]").split(",")
    else:
        return None
    try:
        counts = [int(x) for x in items]
    except (TypeError, ValueError):
        return None
    if len(counts) != num_stages:
        raise UserError(f"parallel.pp_partition lists {len(counts)} block counts but there "
                        f"are {num_stages} stages (pp x num_virtual_stages); give one count per "
                        f"stage")
    if any(c < 0 for c in counts):
        raise UserError(f"parallel.pp_partition {counts}: block counts must be >= 0")
    return counts


def _type_counts(method: str, num_layers: int, num_stages: int) -> list[int]:
    """Blocks per stage of DeepSpeed's `type:REGEX` method."""
    try:
        regex = re.compile(method[len("type:"):], re.IGNORECASE)
    except re.error as e:
        raise UserError(f"parallel.pp_partition {method!r}: bad regex: {e}") from None
    names = [_EMBEDDING_UNIT] + [_BLOCK_UNIT] * num_layers + [_EMBEDDING_UNIT]
    weights = [1 if regex.search(n) else 0 for n in names]
    if not any(weights):
        raise UserError(f"parallel.pp_partition {method!r} matches no layer; the layer "
                        f"types are {_EMBEDDING_UNIT} and {_BLOCK_UNIT}")
    part_of = _split_units(weights, num_stages)
    # Unit i + 1 is block i; the embedding (first unit) and the head (last) are placed on the
    # first and last stage whatever their weight.
    counts = [0] * num_stages
    for block in range(num_layers):
        counts[part_of[block + 1]] += 1
    return counts


def _stage_counts(num_layers: int, num_stages: int, method) -> list[int]:
    counts = _parse_counts(method, num_stages)
    if counts is not None:
        if sum(counts) != num_layers:
            raise UserError(f"parallel.pp_partition {counts} assigns {sum(counts)} blocks "
                            f"but the model has {num_layers} (model.num_layers)")
        return counts
    if method == "uniform":
        if num_layers < num_stages:
            raise UserError(f"model.num_layers ({num_layers}) must be >= the number of stages "
                            f"(pp x num_virtual_stages = {num_stages}) with uniform partitioning")
        base, extra = divmod(num_layers, num_stages)
        return [base + (s < extra) for s in range(num_stages)]
    if isinstance(method, str) and method.startswith("type:"):
        return _type_counts(method, num_layers, num_stages)
    raise UserError(f"parallel.pp_partition {method!r} is unknown; use 'uniform', "
                    f"'type:REGEX' (BLOOM: 'type:transformer|embedding') or a list of block "
                    f"counts like '5,6,6,5'")


def partition_layers(num_layers: int, num_stages: int, method="uniform",
                     interleaved: bool = False) -> list[tuple[int, int]]:
    """Block ranges [start, end) of each of `num_stages` (virtual) stages, in virtual-stage order.

    Methods:
    - "uniform": the blocks split as evenly as possible; the first num_layers % num_stages stages
      get one block more.
    - "type:REGEX" (DeepSpeed): units are the embedding, each block and the tied LM head (class
      names EmbeddingPipe, ParallelTransformerLayerPipe, EmbeddingPipe); a unit weighs 1 when
      REGEX matches its class name (case-insensitive) and 0 otherwise, and the weights are split
      as evenly as possible (DeepSpeed's `partition_balanced`). BLOOM's
      "type:transformer|embedding" counts the embedding and the head as a block each: bloom-176b
      on 12 stages gives [embed + 5], 10 x [6], [5 + head].
    - a list of block counts, or a string like "5,6,6,5" / "[5,6,6,5]", one per stage.

    The embedding is always on the first stage and the LM head on the last. Every stage must hold
    at least one block, except that without interleaving the first and the last stage may hold
    only the embedding / only the head (the type: method gives such stages when the embedding
    weighs like a block and blocks are few). A middle stage without blocks would only forward
    its input, and with interleaving every virtual stage is a model chunk that must compute.
    """
    if isinstance(method, str):  # the planner asks for the same few partitions thousands of times
        return list(_partition_cached(num_layers, num_stages, method, interleaved))
    return _partition(num_layers, num_stages, method, interleaved)


@functools.lru_cache(maxsize=4096)
def _partition_cached(num_layers: int, num_stages: int, method: str,
                      interleaved: bool) -> tuple[tuple[int, int], ...]:
    return tuple(_partition(num_layers, num_stages, method, interleaved))


def _partition(num_layers: int, num_stages: int, method, interleaved: bool
               ) -> list[tuple[int, int]]:
    if num_stages < 1:
        raise UserError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    counts = _stage_counts(num_layers, num_stages, method)
    for s, c in enumerate(counts):
        edge = s in (0, num_stages - 1) and num_stages > 1 and not interleaved
        if c == 0 and not edge:
            what = "virtual stage" if interleaved else "stage"
            raise UserError(f"pipeline {what} {s} of {num_stages} gets no transformer block "
                            f"(block counts {counts}); use fewer stages (parallel.pp, "
                            f"parallel.num_virtual_stages), more layers, or another "
                            f"parallel.pp_partition")
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def check_micro_batches(num_micro: int, pp_size: int, schedule: str) -> None:
    """The micro-batch count a schedule can run: at least one, and for the interleaved schedule
    a multiple of pp, so that every group of pp micro-batches goes round the ring whole."""
    if num_micro < 1:
        raise UserError(f"the number of micro-batches must be >= 1, got {num_micro}")
    if schedule == "interleaved" and num_micro % pp_size:
        raise UserError(f"the interleaved schedule needs the number of micro-batches "
                        f"({num_micro} = global_batch / (micro_batch * dp)) to be divisible by "
                        f"parallel.pp ({pp_size}); change train.global_batch_size or "
                        f"train.micro_batch_size")
