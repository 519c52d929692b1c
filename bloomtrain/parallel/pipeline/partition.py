"""Pipeline stage partitioning (Narayanan et al., arXiv 2104.04473): which transformer blocks each
(virtual) stage holds, with BLOOM's method from Megatron-DeepSpeed
(`--pp-partition-method 'type:transformer|embedding'`), and the checks of a pipeline
configuration. Pure functions of the layer count, so validation (bloomtrain.layout) can run them
before any process starts.
"""
from __future__ import annotations

import re

from bloomtrain.errors import UserError


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
            raise UserError(f"parallel.pp_partition {counts} assigns {sum(counts)} blocks "
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
    else:
        raise UserError(f"parallel.pp_partition {method!r} is unknown; use 'uniform', "
                        f"'type:REGEX' (BLOOM: 'type:transformer|embedding') or a list of block "
                        f"counts like '5,6,6,5'")
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
