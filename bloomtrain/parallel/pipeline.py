"""Pipeline parallelism (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, §2.2), with BLOOM's stage partitioning
(Megatron-DeepSpeed's `--pp-partition-method 'type:transformer|embedding'`).

Read top to bottom:
1. partitioning: which blocks each (virtual) stage holds; pure functions of the layer count;
2. stages: `build_pipeline_chunks` keeps this rank's share of a full (possibly tensor-parallel)
   model, with the tied embedding copied onto the last stage;
3. schedules: GPipe, 1F1B (PipeDream-flush) and interleaved 1F1B as plain functions that list a
   rank's forward/backward ops in named warmup / steady / cooldown phases; `schedule_grid` replays
   those lists under unit costs, which is where the bubble of a schedule is counted;
4. execution: `pipeline_train_step` / `pipeline_eval_step` run a rank's op list with batched
   isend/irecv to the neighbouring stages, freeing each sent activation (Megatron's
   `deallocate_output_tensor`), with a timeout and a precise error on every wait;
5. the timeline of a step (forward, backward, send, recv wait and idle per micro-batch).

Virtual stages: with `num_virtual_stages` v > 1 the model is cut into pp·v pieces and model chunk c
on pipeline rank r is virtual stage c·pp + r, as in Megatron, so activations go round the ring of
ranks v times. The embedding is on virtual stage 0 (rank 0, chunk 0) and the LM head on the last
(rank pp-1, chunk v-1) whatever v is.

Parameter attributes set here, the contract with the optimizer and checkpoints (on every chunk
parameter, next to the tensor-parallel ones of bloomtrain.parallel.tensor):
- `p.tied_embedding`: the parameter is one of the two copies of the tied word embedding that exist
  when pp > 1 (the embedding on the first stage, the LM head weight on the last). Their grads are
  summed over `topo.embedding_group` every step (`allreduce_tied_embedding_grads`), so the copies
  get the same updates and never drift. False everywhere with pp = 1, where the LM head is the
  embedding Parameter itself.
- `p.tied_embedding_copy`: the last stage's copy. The global grad norm skips it (its grad is the
  first stage's after the all-reduce) and checkpoints store it under its logical name
  (`logical_name`), i.e. once.
"""
from __future__ import annotations

import json
import re
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.variable import Variable

from bloomtrain.model.bloom import BloomForCausalLM, BloomModel
from bloomtrain.parallel import comm
from bloomtrain.utils import UserError, atomic_output

COMM_NAME = "pp"
TIED_EMBEDDING_NAME = "transformer.word_embeddings.weight"
TIED_HEAD_NAME = "lm_head.weight"


# ---- 1. partitioning ---------------------------------------------------------------------------

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
        raise UserError(f"parallel.pp_partition_method lists {len(counts)} block counts but there "
                        f"are {num_stages} stages (pp x num_virtual_stages); give one count per "
                        f"stage")
    if any(c < 0 for c in counts):
        raise UserError(f"parallel.pp_partition_method {counts}: block counts must be >= 0")
    return counts


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
    if num_stages < 1:
        raise UserError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    counts = _parse_counts(method, num_stages)
    if counts is not None:
        if sum(counts) != num_layers:
            raise UserError(f"parallel.pp_partition_method {counts} assigns {sum(counts)} blocks "
                            f"but the model has {num_layers} (model.num_layers)")
    elif method == "uniform":
        if num_layers < num_stages:
            raise UserError(f"model.num_layers ({num_layers}) must be >= the number of stages "
                            f"(pp x num_virtual_stages = {num_stages}) with uniform partitioning")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (s < extra) for s in range(num_stages)]
    elif isinstance(method, str) and method.startswith("type:"):
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise UserError(f"parallel.pp_partition_method {method!r}: bad regex: {e}") from None
        names = [_EMBEDDING_UNIT] + [_BLOCK_UNIT] * num_layers + [_EMBEDDING_UNIT]
        weights = [1 if regex.search(n) else 0 for n in names]
        if not any(weights):
            raise UserError(f"parallel.pp_partition_method {method!r} matches no layer; the layer "
                            f"types are {_EMBEDDING_UNIT} and {_BLOCK_UNIT}")
        part_of = _split_units(weights, num_stages)
        # Unit i + 1 is block i; the embedding (first unit) and the head (last) are placed on the
        # first and last stage whatever their weight.
        counts = [0] * num_stages
        for block in range(num_layers):
            counts[part_of[block + 1]] += 1
    else:
        raise UserError(f"parallel.pp_partition_method {method!r} is unknown; use 'uniform', "
                        f"'type:REGEX' (BLOOM: 'type:transformer|embedding') or a list of block "
                        f"counts like '5,6,6,5'")
    for s, c in enumerate(counts):
        edge = s in (0, num_stages - 1) and num_stages > 1 and not interleaved
        if c == 0 and not edge:
            what = "virtual stage" if interleaved else "stage"
            raise UserError(f"pipeline {what} {s} of {num_stages} gets no transformer block "
                            f"(block counts {counts}); use fewer stages (parallel.pp, "
                            f"parallel.num_virtual_stages), more layers, or another "
                            f"parallel.pp_partition_method")
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def num_micro_batches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise UserError(f"train.global_batch_size ({global_batch_size}) must be divisible by "
                        f"train.micro_batch_size * dp ({micro_batch_size} * {dp_size} = "
                        f"{per_step})")
    return global_batch_size // per_step


def validate_pipeline(num_layers: int, pp_size: int, schedule: str, num_virtual_stages: int = 1,
                      partition_method="uniform", num_micro: int | None = None) -> None:
    """Check a pipeline configuration before any process starts; raise a UserError that says
    what to change. Warns when there are fewer micro-batches than stages (most of each step is
    then bubble)."""
    if pp_size < 1:
        raise UserError(f"parallel.pp must be >= 1, got {pp_size}")
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule must be one of {sorted(SCHEDULES)}, "
                        f"got {schedule!r}")
    if num_virtual_stages < 1:
        raise UserError(f"parallel.num_virtual_stages must be >= 1, got {num_virtual_stages}")
    if schedule == "interleaved":
        if num_virtual_stages < 2:
            raise UserError("parallel.pp_schedule=interleaved needs parallel.num_virtual_stages "
                            ">= 2; use 1f1b for one model chunk per rank")
        if pp_size < 2:
            raise UserError("parallel.pp_schedule=interleaved needs parallel.pp >= 2")
    elif num_virtual_stages != 1:
        raise UserError(f"parallel.num_virtual_stages ({num_virtual_stages}) > 1 needs "
                        f"parallel.pp_schedule=interleaved")
    partition_layers(num_layers, pp_size * num_virtual_stages, partition_method,
                     interleaved=num_virtual_stages > 1)
    if num_micro is not None:
        if num_micro < 1:
            raise UserError(f"the number of micro-batches must be >= 1, got {num_micro}")
        if schedule == "interleaved" and num_micro % pp_size:
            raise UserError(f"the interleaved schedule needs the number of micro-batches "
                            f"({num_micro} = global_batch / (micro_batch * dp)) to be divisible "
                            f"by parallel.pp ({pp_size}); change train.global_batch_size or "
                            f"train.micro_batch_size")
        if num_micro < pp_size:
            warnings.warn(f"{num_micro} micro-batches for {pp_size} pipeline stages: most of each "
                          f"step is pipeline bubble ((p-1)/m = {(pp_size - 1) / num_micro:.2f}); "
                          f"raise train.global_batch_size or lower train.micro_batch_size",
                          stacklevel=2)


# ---- 2. stages ---------------------------------------------------------------------------------

class StageTransformer(nn.Module):
    """This stage's share of BloomModel: the same methods (embed, attention_bias, run_blocks),
    only the modules the stage runs. Blocks are keyed by their global index so that parameter
    names stay `transformer.h.{i}.…`, the model's own names."""

    embed = BloomModel.embed
    attention_bias = BloomModel.attention_bias
    run_blocks = BloomModel.run_blocks

    def __init__(self, full: BloomModel, block_range: tuple[int, int], has_embedding: bool,
                 has_final_norm: bool):
        super().__init__()
        self.shape = full.shape
        if has_embedding:
            self.word_embeddings = full.word_embeddings
            self.word_embeddings_layernorm = full.word_embeddings_layernorm
        self.h = nn.ModuleDict({str(i): full.h[i] for i in range(*block_range)})
        if has_final_norm:
            self.ln_f = full.ln_f
        # Shared with the full model (and every chunk): tensor parallelism has already cut it to
        # the local heads.
        self.register_buffer("alibi_slopes", full.alibi_slopes, persistent=False)
        self.activation_checkpointing = full.activation_checkpointing
        self.sequence_parallel_size = full.sequence_parallel_size


class PipelineChunk(nn.Module):
    """The blocks of one virtual stage, plus the embedding on the first and ln_f, the LM head and
    the loss on the last. `named_parameters()` gives the full model's HF names."""

    def __init__(self, model: BloomForCausalLM, block_range: tuple[int, int], virtual_stage: int,
                 num_stages: int, index: int):
        super().__init__()
        self.virtual_stage, self.num_stages, self.index = virtual_stage, num_stages, index
        self.block_range = block_range
        self.is_first = virtual_stage == 0
        self.is_last = virtual_stage == num_stages - 1
        self.transformer = StageTransformer(model.transformer, block_range, self.is_first,
                                            self.is_last)
        if self.is_last:
            self.lm_head = model.lm_head
            self.loss_fn = model.loss_fn
        if hasattr(model, "tp_rng"):
            self.tp_rng = model.tp_rng

    def forward(self, x, labels=None, loss_mask=None):
        """x: token ids [b, s] on the first virtual stage, else hidden states [b, s(/tp), h].
        Returns hidden states, or on the last virtual stage the loss (logits without labels)."""
        if self.is_first:
            x = self.transformer.embed(x)
        x, _ = self.transformer.run_blocks(x, self.transformer.h.values())
        if not self.is_last:
            return x
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits if labels is None else self.loss_fn(logits, labels, loss_mask)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.transformer.activation_checkpointing = enabled


def build_pipeline_chunks(model: BloomForCausalLM, topo, partition_method="uniform",
                          num_virtual_stages: int = 1) -> list[PipelineChunk]:
    """This rank's model chunks (one per virtual stage it runs, in chunk order) cut from `model`,
    the full model (tensor-parallel already if tp > 1) built identically on every rank.

    The chunks take the model's modules; drop every other reference to `model` afterwards so that
    the modules of other stages are freed. With pp > 1 the last stage's LM head gets its own
    Parameter, a copy of the (vocab-shard of the) embedding it was tied to, and `model.lm_head` is
    changed accordingly. See the module docstring for the parameter attributes."""
    pp, v = topo.pp_size, num_virtual_stages
    if v < 1 or (v > 1 and pp < 2):
        raise UserError(f"parallel.num_virtual_stages ({v}) must be 1, or >= 2 with "
                        f"parallel.pp >= 2")
    num_stages = pp * v
    ranges = partition_layers(model.shape.num_layers, num_stages, partition_method,
                              interleaved=v > 1)
    chunks = [PipelineChunk(model, ranges[c * pp + topo.pp_rank], c * pp + topo.pp_rank,
                            num_stages, c) for c in range(v)]
    for chunk in chunks:
        for p in chunk.parameters():
            p.tied_embedding = False
            p.tied_embedding_copy = False
    if pp > 1:
        for chunk in chunks:
            if chunk.is_first:
                chunk.transformer.word_embeddings.weight.tied_embedding = True
            if chunk.is_last:
                tied = chunk.lm_head.weight
                copy = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
                for attr in ("tp_split_dim", "tp_replicated", "grad_needs_tp_allreduce"):
                    if hasattr(tied, attr):
                        setattr(copy, attr, getattr(tied, attr))
                copy.tied_embedding = True
                copy.tied_embedding_copy = True
                chunk.lm_head.weight = copy
    return chunks


def pipeline_named_parameters(chunks) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of this rank's chunks with its HF name (unique: blocks keep their global
    index, and the embedding and the head copy live on different virtual stages)."""
    return [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]


def logical_name(name: str) -> str:
    """The checkpoint name of a parameter: the last stage's LM head copy is the embedding."""
    return TIED_EMBEDDING_NAME if name == TIED_HEAD_NAME else name


def tied_embedding_params(chunks) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in pipeline_named_parameters(chunks)
            if getattr(p, "tied_embedding", False)]


@torch.no_grad()
def allreduce_tied_embedding_grads(grads_or_params, topo) -> None:
    """Sum the tied embedding's grads over `topo.embedding_group` (first and last stage), in place,
    so that both copies take the same step. Pass the `tied_embedding` parameters (their .grad is
    reduced) or their grad tensors, e.g. views into an fp32 flat buffer, in the same order on both
    ranks. A no-op with pp = 1 and on stages that hold no copy (they pass an empty list)."""
    grads = [t.grad if isinstance(t, nn.Parameter) else t for t in grads_or_params]
    grads = [t for t in grads if t is not None]
    if topo.embedding_group is None or not grads:
        return
    flat = torch.cat([t.reshape(-1) for t in grads]) if len(grads) > 1 else grads[0]
    comm.all_reduce(flat, topo.embedding_group, "emb")
    if len(grads) > 1:
        offset = 0
        for t in grads:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


# ---- 3. schedules ------------------------------------------------------------------------------

class Op(NamedTuple):
    kind: str  # "F" (forward) or "B" (backward)
    chunk: int  # model chunk on this rank; virtual stage = chunk * pp + pp_rank
    micro_batch: int
    phase: str  # "warmup", "steady" or "cooldown"


def gpipe_schedule(pp_size: int, pp_rank: int, num_micro: int, num_chunks: int = 1) -> list[Op]:
    """GPipe (Huang et al. 2019): every forward, then every backward. There is no steady phase;
    every rank stashes the activations of all m micro-batches."""
    warmup = [Op("F", 0, i, "warmup") for i in range(num_micro)]
    cooldown = [Op("B", 0, i, "cooldown") for i in range(num_micro)]
    return warmup + cooldown


def one_f_one_b_schedule(pp_size: int, pp_rank: int, num_micro: int,
                         num_chunks: int = 1) -> list[Op]:
    """PipeDream-flush (1F1B): rank r runs pp - r - 1 forwards to fill the pipeline, then
    alternates one forward and one backward, then drains the outstanding backwards. The bubble
    is GPipe's, but a rank stashes at most pp - r micro-batches of activations, not m."""
    num_warmup = min(pp_size - pp_rank - 1, num_micro)
    warmup = [Op("F", 0, i, "warmup") for i in range(num_warmup)]
    steady = []
    for i in range(num_micro - num_warmup):
        steady += [Op("F", 0, num_warmup + i, "steady"), Op("B", 0, i, "steady")]
    cooldown = [Op("B", 0, i, "cooldown") for i in range(num_micro - num_warmup, num_micro)]
    return warmup + steady + cooldown


def interleaved_schedule(pp_size: int, pp_rank: int, num_micro: int,
                         num_chunks: int = 2) -> list[Op]:
    """Megatron's interleaved 1F1B: each rank holds v model chunks and works through the
    micro-batches in groups of pp, running a group through chunk 0, then chunk 1, ... (and
    backwards through the chunks in reverse). A forward or backward costs 1/v of a
    non-interleaved one, so the fill and drain shrink v-fold: bubble (p-1)/(v·m), for v times
    the point-to-point traffic. Needs m % pp == 0 so that every group is full."""
    if num_micro % pp_size:
        raise UserError(f"the interleaved schedule needs the number of micro-batches "
                        f"({num_micro}) to be divisible by parallel.pp ({pp_size})")
    group = pp_size * num_chunks
    total = num_micro * num_chunks

    def forward(k: int, phase: str) -> Op:
        chunk = (k % group) // pp_size
        return Op("F", chunk, (k // group) * pp_size + k % pp_size, phase)

    def backward(k: int, phase: str) -> Op:
        chunk = num_chunks - 1 - (k % group) // pp_size
        return Op("B", chunk, (k // group) * pp_size + k % pp_size, phase)

    # Enough forwards that the first backward's gradient can arrive: the v-1 chunk rounds ahead
    # of the last chunk, plus twice the distance to the last rank (there and back).
    num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    warmup = [forward(k, "warmup") for k in range(num_warmup)]
    steady = []
    for k in range(total - num_warmup):
        steady += [forward(num_warmup + k, "steady"), backward(k, "steady")]
    cooldown = [backward(k, "cooldown") for k in range(total - num_warmup, total)]
    return warmup + steady + cooldown


SCHEDULES: dict[str, Callable[..., list[Op]]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_schedule,
}


def theoretical_bubble(schedule: str, pp_size: int, num_micro: int,
                       num_virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time (arXiv 2104.04473 §2.2): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved."""
    v = num_virtual_stages if schedule == "interleaved" else 1
    return (pp_size - 1) / (v * num_micro)


def op_p2p(op: Op, pp_size: int, pp_rank: int, num_chunks: int):
    """The messages of `op`: (recv, send), each None or (peer pp rank, "activation"|"gradient",
    receiving virtual stage). A forward receives its input from the previous virtual stage and
    sends its output to the next; a backward receives the output's gradient from the next and
    sends the input's gradient to the previous."""
    vs = op.chunk * pp_size + pp_rank
    last = pp_size * num_chunks - 1
    prev_rank, next_rank = (pp_rank - 1) % pp_size, (pp_rank + 1) % pp_size
    if op.kind == "F":
        recv = (prev_rank, "activation", vs) if vs > 0 else None
        send = (next_rank, "activation", vs + 1) if vs < last else None
    else:
        recv = (next_rank, "gradient", vs) if vs < last else None
        send = (prev_rank, "gradient", vs - 1) if vs > 0 else None
    return recv, send


def schedule_grid(schedule: str, pp_size: int, num_micro: int, num_virtual_stages: int = 1,
                  forward_cost: int = 1, backward_cost: int = 2) -> list[list[tuple[int, Op]]]:
    """Replay every rank's op list under unit costs (a forward of one model chunk costs
    `forward_cost`, a backward `backward_cost`: the usual 2x, since a backward computes the grads
    of both the input and the weights) and free communication. Returns, per stage, the
    (start slot, op) pairs. An op starts when its rank is free and its input is there: the
    previous virtual stage's forward of the micro-batch, or the next one's backward. Raises if
    the op lists deadlock."""
    v = num_virtual_stages
    orders = [SCHEDULES[schedule](pp_size, r, num_micro, v) for r in range(pp_size)]
    last = pp_size * v - 1
    done: dict[tuple[str, int, int], int] = {}
    grid: list[list[tuple[int, Op]]] = [[] for _ in range(pp_size)]
    pos, free = [0] * pp_size, [0] * pp_size
    while any(pos[r] < len(orders[r]) for r in range(pp_size)):
        progressed = False
        for r in range(pp_size):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                vs = op.chunk * pp_size + r
                if op.kind == "F":
                    deps = [("F", vs - 1, op.micro_batch)] if vs > 0 else []
                else:
                    deps = [("F", vs, op.micro_batch)]
                    deps += [("B", vs + 1, op.micro_batch)] if vs < last else []
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + (forward_cost if op.kind == "F" else backward_cost)
                done[(op.kind, vs, op.micro_batch)] = free[r]
                grid[r].append((start, op))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp_size) if pos[r] < len(orders[r])}
            raise RuntimeError(f"schedule {schedule} (pp={pp_size}, m={num_micro}, v={v}) "
                               f"deadlocks; next ops: {stuck}")
    return grid


def grid_bubble(grid: list[list[tuple[int, Op]]], forward_cost: int = 1,
                backward_cost: int = 2) -> float:
    """Bubble time over compute time of the busiest stage, counted from the grid's slots."""
    cost = {"F": forward_cost, "B": backward_cost}
    makespan = max(start + cost[op.kind] for row in grid for start, op in row)
    busy = max(sum(cost[op.kind] for _, op in row) for row in grid)
    return (makespan - busy) / busy


# ---- 4. execution ------------------------------------------------------------------------------

class PipelineCommError(RuntimeError):
    """A pipeline point-to-point or collective operation timed out or failed. The message names
    the stage, the operation, the peer and the micro-batch."""


def _wait(work, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        elapsed = time.monotonic() - t0
        text = str(e)
        if elapsed >= 0.9 * timeout or "timed out" in text.lower() or "timeout" in text.lower():
            raise PipelineCommError(f"{what} timed out after {timeout:g}s") from e
        raise PipelineCommError(f"{what} failed after {elapsed:.1f}s: {text}") from e


def _deallocate(out: torch.Tensor) -> None:
    """Megatron's deallocate_output_tensor: once sent, a stage output is needed only for its
    grad_fn (the add of the last residual does not keep its result), so its storage is dropped.
    The send itself holds an alias of the storage until it completes."""
    out.data = torch.empty((0,), device=out.device, dtype=out.dtype)


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """torch.autograd.backward(out, grad) for an output whose storage was released: the Python
    front end checks grad against out's current (empty) shape, the C++ engine checks it against
    the shape recorded in out's grad_fn, which is the right one (Megatron's custom_backward)."""
    if grad is None:
        grad = torch.ones_like(out, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _P2P:
    """The point-to-point traffic of one rank in one step. Receives are posted one op ahead in the
    same batch as the sends of the op just computed (Megatron's send_forward_recv_backward
    pattern: with NCCL a batch is one group, so a pair's crossing sends cannot block each other),
    and waited for only when the op needs them. Sends are never waited for until the end of the
    step, so no rank ever blocks on a peer that is itself waiting: the op lists (checked by
    schedule_grid) are then enough to exclude deadlock. Tags tell messages apart on gloo; the
    order of the op lists makes them match on NCCL, which ignores tags."""

    def __init__(self, topo, num_chunks: int, num_micro: int, recv_shape, dtype, device,
                 timeout: float, timeline):
        self.topo, self.num_chunks, self.num_micro = topo, num_chunks, num_micro
        self.recv_shape, self.dtype, self.device = tuple(recv_shape), dtype, device
        self.timeout, self.timeline = timeout, timeline
        self.pending_sends: list[tuple[object, torch.Tensor, str]] = []
        self.posted: dict[tuple[str, int, int], tuple[object, torch.Tensor, str]] = {}

    def global_rank(self, pp_rank: int) -> int:
        return int(self.topo.grid[pp_rank, self.topo.dp_rank, self.topo.tp_rank])

    def where(self, chunk: int | None = None) -> str:
        t = self.topo
        where = f"pipeline stage {t.pp_rank}/{t.pp_size}"
        return where + (f" (model chunk {chunk})" if chunk is not None and self.num_chunks > 1
                        else "")

    def tag(self, kind: str, receiving_stage: int, micro_batch: int) -> int:
        # Not a function of the number of micro-batches: if ranks disagree on it, the first
        # micro-batch that one of them lacks is what times out and gets named.
        num_stages = self.topo.pp_size * self.num_chunks
        return (micro_batch * num_stages + receiving_stage) * 2 + (kind == "gradient")

    def post(self, sends: list[tuple[Op, torch.Tensor]], next_op: Op | None) -> None:
        p2p_ops, records = [], []
        t0 = time.perf_counter()
        for op, tensor in sends:
            _, send = op_p2p(op, self.topo.pp_size, self.topo.pp_rank, self.num_chunks)
            peer_pp, kind, stage = send
            peer = self.global_rank(peer_pp)
            what = (f"{self.where(op.chunk)}: send {kind} for micro-batch {op.micro_batch} "
                    f"to rank {peer}")
            alias = tensor.detach()
            p2p_ops.append(dist.P2POp(dist.isend, alias, peer,
                                      tag=self.tag(kind, stage, op.micro_batch)))
            records.append(("send", alias, what))
            if op.kind == "F":
                _deallocate(tensor)
        if next_op is not None:
            recv, _ = op_p2p(next_op, self.topo.pp_size, self.topo.pp_rank, self.num_chunks)
            if recv is not None:
                peer_pp, kind, stage = recv
                peer = self.global_rank(peer_pp)
                buf = torch.empty(self.recv_shape, dtype=self.dtype, device=self.device)
                what = (f"{self.where(next_op.chunk)}: recv {kind} for micro-batch "
                        f"{next_op.micro_batch} from rank {peer}")
                p2p_ops.append(dist.P2POp(dist.irecv, buf, peer,
                                          tag=self.tag(kind, stage, next_op.micro_batch)))
                records.append((next_op, buf, what))
        if not p2p_ops:
            return
        works = comm.batch_isend_irecv(p2p_ops, COMM_NAME)
        if len(works) != len(p2p_ops):  # NCCL coalesces a batch into one work
            works = [works[0]] * len(p2p_ops)
        for work, (key, tensor, what) in zip(works, records):
            if key == "send":
                self.pending_sends.append((work, tensor, what))
            else:
                self.posted[(key.kind, key.chunk, key.micro_batch)] = (work, tensor, what)
        if self.timeline is not None and sends:
            self.timeline.record("send", t0, time.perf_counter(), sends[0][0].chunk,
                                 sends[0][0].micro_batch)
        # Drop the aliases of completed sends, so that their storage goes right away.
        self.pending_sends = [s for s in self.pending_sends if not s[0].is_completed()]

    def wait_recv(self, op: Op) -> torch.Tensor:
        work, buf, what = self.posted.pop((op.kind, op.chunk, op.micro_batch))
        t0 = time.perf_counter()
        _wait(work, self.timeout, what)
        if self.timeline is not None:
            self.timeline.record("recv", t0, time.perf_counter(), op.chunk, op.micro_batch)
        return buf

    def finish(self) -> None:
        t0 = time.perf_counter()
        for work, _, what in self.pending_sends:
            _wait(work, self.timeout, what)
        self.pending_sends = []
        if self.timeline is not None:
            self.timeline.record("send_wait", t0, time.perf_counter())


def _check_step_args(schedule: str, chunks, micro_batches, topo) -> tuple[int, int]:
    num_chunks, num_micro = len(chunks), len(micro_batches)
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule must be one of {sorted(SCHEDULES)}, "
                        f"got {schedule!r}")
    if num_micro < 1:
        raise UserError("a pipeline step needs at least one micro-batch")
    if schedule == "interleaved":
        if num_chunks < 2:
            raise UserError("parallel.pp_schedule=interleaved needs parallel.num_virtual_stages "
                            ">= 2 model chunks per rank")
        if num_micro % topo.pp_size:
            raise UserError(f"the interleaved schedule needs the number of micro-batches "
                            f"({num_micro}) to be divisible by parallel.pp ({topo.pp_size}); "
                            f"change train.global_batch_size or train.micro_batch_size")
    elif num_chunks != 1:
        raise UserError(f"{num_chunks} model chunks per rank need parallel.pp_schedule="
                        f"interleaved")
    return num_chunks, num_micro


def _run_step(schedule: str, chunks, micro_batches, topo, *, train: bool, scale_loss,
              recv_shape, dtype, timeline, timeout: float) -> float:
    num_chunks, num_micro = _check_step_args(schedule, chunks, micro_batches, topo)
    ops = SCHEDULES[schedule](topo.pp_size, topo.pp_rank, num_micro, num_chunks)
    if not train:
        # Forward only: the schedule's forwards in its order (which keeps the p2p order).
        ops = [op for op in ops if op.kind == "F"]
    device = next(chunks[0].parameters()).device
    if timeline is not None:
        timeline.begin(topo, schedule, num_micro, num_chunks)
    p2p = _P2P(topo, num_chunks, num_micro, recv_shape, dtype, device, timeout, timeline)
    # (chunk, micro-batch) -> (received input or None, output or loss) until the backward.
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def forward(op: Op):
        nonlocal loss_sum
        chunk, batch = chunks[op.chunk], micro_batches[op.micro_batch]
        inp = None
        if not chunk.is_first:
            inp = p2p.wait_recv(op)
            inp.requires_grad_(train)
        t0 = time.perf_counter()
        if chunk.is_last:
            out = chunk(batch["tokens"] if chunk.is_first else inp, batch["labels"],
                        batch.get("loss_mask"))
            loss_sum += out.detach().double()
        else:
            out = chunk(batch["tokens"] if chunk.is_first else inp)
        if timeline is not None:
            timeline.record("F", t0, time.perf_counter(), op.chunk, op.micro_batch)
        if train:
            stash[(op.chunk, op.micro_batch)] = (inp, out)
        return [] if chunk.is_last else [(op, out)]

    def backward(op: Op):
        chunk = chunks[op.chunk]
        inp, out = stash.pop((op.chunk, op.micro_batch))
        grad = None if chunk.is_last else p2p.wait_recv(op)
        t0 = time.perf_counter()
        if chunk.is_last:
            # The step's gradient is the mean over micro-batches, as one process averaging the
            # micro-batch losses gets it.
            _backward(scale_loss(out / num_micro), None)
        else:
            _backward(out, grad)
        if timeline is not None:
            timeline.record("B", t0, time.perf_counter(), op.chunk, op.micro_batch)
        return [] if chunk.is_first else [(op, inp.grad)]

    grad_context = torch.enable_grad() if train else torch.no_grad()
    with grad_context:
        p2p.post([], ops[0])
        for k, op in enumerate(ops):
            sends = forward(op) if op.kind == "F" else backward(op)
            p2p.post(sends, ops[k + 1] if k + 1 < len(ops) else None)
        p2p.finish()
    mean_loss = _broadcast_loss(float(loss_sum) / num_micro, topo, device, timeout, p2p)
    if timeline is not None:
        timeline.end()
    return mean_loss


def _broadcast_loss(value: float, topo, device, timeout: float, p2p: _P2P) -> float:
    if topo.pp_group is None:
        return value
    src = p2p.global_rank(topo.pp_size - 1)
    t = torch.tensor([value if topo.is_last_stage else 0.0], dtype=torch.float64, device=device)
    work = comm.broadcast(t, src=src, group=topo.pp_group, name=COMM_NAME, async_op=True)
    _wait(work, timeout, f"{p2p.where()}: broadcast of the step loss from rank {src}")
    return float(t.item())


def pipeline_train_step(schedule: str, chunks, micro_batches: list[dict], topo, *,
                        scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
                        recv_shape, dtype=torch.float32, timeline: "Timeline | None" = None,
                        timeout: float = 600.0) -> float:
    """Run one training step's forwards and backwards over `micro_batches` with `schedule`
    ("gpipe", "1f1b" or "interleaved") and leave the gradients in the parameters' .grad
    (accumulated: zero them before). Returns the mean micro-batch loss on every pipeline rank.

    `micro_batches`: dicts with "tokens" [b, s], "labels" [b, s] and optionally "loss_mask"; every
    rank passes the same list (the first stage reads tokens, the last labels and loss_mask).
    The last stage runs backward on scale_loss(loss / num_micro_batches) (scale_loss: the fp16
    loss scale). `recv_shape`: the hidden states between stages, [micro_batch, seq, h], with
    seq / tp under sequence parallelism, in `dtype` (the compute dtype). `timeout`: seconds any
    single wait may take before a PipelineCommError names what was being waited for.
    `timeline`: a Timeline to record this step into. The tied embedding's grads are not reduced
    here: the optimizer sums them over the embedding group with its other grad reductions.
    """
    return _run_step(schedule, chunks, micro_batches, topo, train=True, scale_loss=scale_loss,
                     recv_shape=recv_shape, dtype=dtype, timeline=timeline, timeout=timeout)


def pipeline_eval_step(schedule: str, chunks, micro_batches: list[dict], topo, *, recv_shape,
                       dtype=torch.float32, timeline: "Timeline | None" = None,
                       timeout: float = 600.0) -> float:
    """Forwards only, without autograd; returns the mean micro-batch loss on every pipeline rank.
    Arguments as for pipeline_train_step; set the chunks to eval() first for no dropout."""
    return _run_step(schedule, chunks, micro_batches, topo, train=False, scale_loss=None,
                     recv_shape=recv_shape, dtype=dtype, timeline=timeline, timeout=timeout)


# ---- 5. timeline -------------------------------------------------------------------------------

TIMELINE_DIR = "pipeline_timeline"


class Timeline:
    """Wall-clock events of one pipeline step on one rank, relative to the step's start: "F" and
    "B" (compute of a micro-batch on a model chunk), "recv" (waiting for a message), "send"
    (posting messages) and "send_wait" (the end-of-step wait for outstanding sends). Idle time is
    everything that is not F or B. A Timeline passed to a step is reset by it."""

    def __init__(self):
        self.events: list[dict] = []
        self.meta: dict = {}
        self._t0 = 0.0

    def begin(self, topo, schedule: str, num_micro: int, num_chunks: int) -> None:
        self.events = []
        self.meta = dict(rank=topo.rank, pp_rank=topo.pp_rank, pp_size=topo.pp_size,
                         dp_rank=topo.dp_rank, tp_rank=topo.tp_rank, schedule=schedule,
                         num_micro_batches=num_micro, num_virtual_stages=num_chunks,
                         wall_start=time.time())
        self._t0 = time.perf_counter()

    def record(self, kind: str, start: float, end: float, chunk: int | None = None,
               micro_batch: int | None = None) -> None:
        self.events.append(dict(kind=kind, chunk=chunk, micro_batch=micro_batch,
                                start=start - self._t0, end=end - self._t0))

    def end(self) -> None:
        self.meta["step_time"] = time.perf_counter() - self._t0

    def summary(self) -> dict:
        return summarize(self.to_dict())

    def to_dict(self) -> dict:
        return dict(self.meta, events=list(self.events))

    def save(self, run_dir, step: int) -> Path:
        path = Path(run_dir) / TIMELINE_DIR / f"step_{step}_rank_{self.meta['rank']}.json"
        data = dict(self.to_dict(), step=step)
        with atomic_output(path, "w") as f:
            json.dump(data, f)
        return path


def summarize(data: dict) -> dict:
    """Compute, idle and bubble of one saved timeline. The bubble is idle over compute time, the
    paper's definition, next to the schedule's theoretical value."""
    compute = sum(e["end"] - e["start"] for e in data["events"] if e["kind"] in ("F", "B"))
    recv = sum(e["end"] - e["start"] for e in data["events"] if e["kind"] == "recv")
    step_time = data["step_time"]
    idle = max(step_time - compute, 0.0)
    return dict(step_time=step_time, compute=compute, idle=idle, recv_wait=recv,
                idle_fraction=idle / step_time if step_time else 0.0,
                bubble=idle / compute if compute else 0.0,
                theory=theoretical_bubble(data["schedule"], data["pp_size"],
                                          data["num_micro_batches"], data["num_virtual_stages"]))
