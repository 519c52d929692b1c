"""Memory of one pipeline rank, from the model shape and the layout alone (no tensors, no
process group), itemized the way the engine allocates it.

Model states: the parameters a rank holds, per module (group) as the ZeRO engine groups them,
sized by the engine's own layout function (bloomtrain.parallel.zero.segments.flat_sizes): the
exact sizes of its flat buffers. The megatron-deepspeed system keeps DeepSpeed's buffers instead
(BF16_Optimizer, or its fp16 ZeRO stages 0-1; docs/bloom_facts.md §6).

Activations per micro-batch follow Korthikanti et al. ("Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, §4): per layer sbh(34 + 5as/h) bytes at 16 bits
without tensor parallelism, sbh(10 + 24/t + 5as/(ht)) with it, and /t of all of it with sequence
parallelism; full recompute keeps 2sbh (the layer's input). Selective recompute is not the
paper's (which drops only the a·s² terms, and so nothing next to a fused kernel, issue 38): it
keeps the layer's input, the outputs of its four matmuls and a fused attention kernel's output
and logsumexp (bloomtrain.model.recompute), 2sbh(11/t + ...) at 16 bits, nothing of an unfused
core. Each term of these sums is an item below, sized for the kernels that run:
- a fused attention kernel (FlexAttention, SDPA's flash/efficient kernels) stores its output and
  a float32 logsumexp, never the a·s² scores; an unfused one (Megatron's fused softmax, which BLOOM
  ran) stores the softmax output, the dropout mask and the dropout output (5as²b at 16 bits);
  the eager kernel (HF's math, train.attention=eager) the float32 softmax output, its 16-bit
  cast and the dropout mask;
- SDPA and the eager kernel take ALiBi as an additive bias [1, a/t, s, s] made once per forward of a chunk;
- the inputs of the QKV and h->4h matmuls are whole-sequence tensors under sequence parallelism
  (our column-parallel layers keep the all-gathered input for their weight gradient);
- dropout masks take `mask_bytes` per element (1: CUDA's bool mask; torch's CPU dropout keeps a
  mask in the activation dtype).
Outside the blocks: the embedding LayerNorm's input (first stage), ln_f's and the head's inputs
and the cross-entropy's float32 softmax over the local vocabulary (last stage), and the stage's
output, held by the pipeline runtime until its backward (every stage but the last).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.pipeline.schedules import SCHEDULES, zb_h1_schedule
from bloomtrain.parallel.zero.memory import staging_chunk, state_bytes
from bloomtrain.parallel.zero.segments import bucket_elements, flat_sizes, segment_sizes
from bloomtrain.parallel.zero.stages import stage_rules

# The engine keeps at most this many reduce-scatters in flight, each with its fp32 staging bucket,
# plus the one being filled (bloomtrain.parallel.zero.reduce.MAX_IN_FLIGHT + 1).
STAGING_BUCKETS = 3


@dataclass(frozen=True)
class Group:
    """The parameters one module owns on this rank (tp-local), as the engine groups them."""

    name: str
    numel: int
    largest: int          # its largest parameter
    tied: bool = False    # a copy of the tied embedding (pp > 1): a run of its own
    shared: bool = False  # pp = 1: the embedding, used again by the LM head
    params: int = 1       # parameter tensors


def block_numel(shape: BloomShape, tp: int) -> tuple[int, int]:
    """(parameters of one block on a tp rank, its largest parameter)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    qkv = 3 * h // tp * h + 3 * h // tp
    dense = h * (h // tp) + h
    h4h = f // tp * h + f // tp
    fourh = h * (f // tp) + h
    return qkv + dense + h4h + fourh + 4 * h, max(3 * h // tp * h, f // tp * h)


def chunk_groups(shape: BloomShape, layout: ParallelLayout, virtual_stage: int) -> list[Group]:
    """The groups of one virtual stage, in forward (module) order."""
    h, tp = shape.hidden_size, layout.tp
    start, end = layout.stage_ranges(shape.num_layers)[virtual_stage]
    first, last = virtual_stage == 0, virtual_stage == layout.num_stages - 1
    emb = shape.vocab_size // tp * h
    tied = layout.pp > 1
    blk, blk_largest = block_numel(shape, tp)
    groups = []
    if first:
        groups += [Group("embedding", emb, emb, tied=tied, shared=not tied),
                   Group("embedding_ln", 2 * h, h, params=2)]
    groups += [Group(f"block{i}", blk, blk_largest, params=12) for i in range(start, end)]
    if last:
        groups.append(Group("ln_f", 2 * h, h, params=2))
        if tied:
            groups.append(Group("lm_head", emb, emb, tied=True))
    return groups


def rank_groups(shape: BloomShape, layout: ParallelLayout, pp_rank: int) -> list[Group]:
    return [g for vs in layout.virtual_stages(pp_rank) for g in chunk_groups(shape, layout, vs)]


def flat_numel(groups: list[Group], dp: int, per_group: bool, bucket: int = 1 << 62) -> int:
    """Elements of the full-size flat buffers, as the engine lays them out."""
    return flat_sizes([[(g.numel, g.tied)] for g in groups], dp, bucket, per_group)


def padded(numel: int, dp: int) -> int:
    return flat_sizes([[(numel, False)]], dp, 1 << 62, True)


def model_states(groups: list[Group], zero_stage: int, dp: int, compute_bytes: int,
                 offload: bool, bucket_size_mb: float = 25.0) -> dict:
    """Bytes of the engine's flat buffers by category, as `ZeroEngine.memory_report()` measures
    them (`device`), and the host's under offload (the states and the staging ring, whose
    chunk follows the largest segment: `own_numel` and `chunk` give host_bytes' inputs)."""
    rules = stage_rules(zero_stage)
    full = flat_numel(groups, dp, per_group=rules.shard_params)
    sizes = segment_sizes([[(g.numel, g.tied)] for g in groups], dp,
                          bucket_elements(bucket_size_mb), rules.shard_params)
    chunk = staging_chunk(max(sizes) // (dp if rules.shard_optimizer else 1),
                          bucket_elements(bucket_size_mb))
    states = state_bytes(rules, full, full // dp, compute_bytes, offload, chunk)
    return {"device": states["device"], "host": states["host"], "flat_numel": full,
            "own_numel": states["own"], "chunk": chunk}


def megatron_states(groups: list[Group], zero_stage: int, dp: int, precision: str) -> dict:
    """DeepSpeed's buffers under Megatron-DeepSpeed: BF16_Optimizer (bf16: the stage's whole
    fp32 gradient, master and Adam sharded over dp) or its fp16 ZeRO-1 (fp32 gradients of the
    own shard only) or ZeRO-0 (FP16_Optimizer: everything whole, fp32 gradients made at the
    step)."""
    full = flat_numel(groups, dp, per_group=False)
    state = full // dp if zero_stage >= 1 else full
    grads = full if precision != "fp16" else state if zero_stage >= 1 else 0
    device = {"compute_params": 2 * full, "fp32_master": 4 * state, "fp32_grads": 4 * grads,
              "adam_m": 4 * state, "adam_v": 4 * state}
    return {"device": device, "host": {}, "flat_numel": full, "own_numel": state}


def compute_grads_held(groups: list[Group], compute_bytes: int) -> int:
    """The engine takes each 16-bit gradient as autograd makes it: one parameter's at a time,
    except that a tied head and embedding on one stage keep three embedding-sized gradients alive
    at once (ZeroEngine.compute_grads_held)."""
    largest = max(g.largest for g in groups)
    shared = [3 * g.numel for g in groups if g.shared]
    return compute_bytes * max([largest] + shared)


def stage3_working_set(groups: list[Group], dp: int, compute_bytes: int) -> int:
    """Stage 3 gathers a unit per use: the current and the prefetched one, plus the embedding the
    head uses again (ZeroEngine.working_set_bound)."""
    sizes = sorted((padded(g.numel, dp) for g in groups), reverse=True)
    shared = sum(padded(g.numel, dp) for g in groups if g.shared)
    return compute_bytes * (sum(sizes[:2]) + shared)


# ---- activations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationSpec:
    """What sizes the activations: the micro-batch shape, the layout's tp and sequence
    parallelism, the kernels."""

    seq: int
    micro_batch: int
    tp: int
    sequence_parallel: bool
    compute_bytes: int          # 16-bit activations: 2
    attention: str              # "fused" (flex, or SDPA's flash/efficient), "sdpa" (fused with
    #                             an ALiBi bias tensor), "unfused" (softmax stored) or "eager"
    #                             (HF's math: fp32 softmax stored, with the bias tensor)
    hidden_dropout: bool
    attention_dropout: bool
    mask_bytes: int = 1


def layer_items(shape: BloomShape, a: ActivationSpec) -> dict[str, float]:
    """Bytes one transformer layer stores for backward per micro-batch, without recompute."""
    s, b, h, t, c = a.seq, a.micro_batch, shape.hidden_size, a.tp, a.compute_bytes
    sbh = s * b * h
    rep = sbh / t if a.sequence_parallel else sbh    # LayerNorm / dropout region
    split = sbh / t                                   # tensor-parallel region
    ffn = s * b * shape.ffn_hidden_size / t
    items = {
        "ln_inputs": 2 * c * rep,
        "qkv_input": c * sbh,
        "q_k_v": 3 * c * split,
        "attention_output": c * split,
        "mlp_input": c * sbh,
        "gelu_input": c * ffn,
        "gelu_output": c * ffn,
        "dropout_masks": 2 * a.mask_bytes * rep if a.hidden_dropout else 0.0,
    }
    items.update(attention_core_items(shape, a))
    return items


def attention_core_items(shape: BloomShape, a: ActivationSpec) -> dict[str, float]:
    """What the attention core (softmax(QKᵀ/√d + alibi)·V) itself stores beside its output."""
    s, b, c = a.seq, a.micro_batch, a.compute_bytes
    heads = shape.num_heads // a.tp
    if a.attention == "unfused":
        scores = heads * s * s * b
        per = c + ((a.mask_bytes + c) if a.attention_dropout else 0)
        return {"softmax_and_dropout": per * scores}
    if a.attention == "eager":
        # softmax(dtype=float32) keeps its fp32 output for backward; bmm keeps the 16-bit cast
        # (in fp32 the same tensor), or the dropout's output with the dropout's mask beside it.
        if a.attention_dropout:
            per = 4 + c + a.mask_bytes
        else:
            per = 4 + (c if c != 4 else 0)
        return {"softmax_and_dropout": per * heads * s * s * b}
    return {"logsumexp": 4 * heads * s * b}


def selective_layer_items(shape: BloomShape, a: ActivationSpec) -> dict[str, float]:
    """Bytes one transformer layer keeps per micro-batch under selective recompute: the input the
    checkpoint holds and the outputs its policy caches (bloomtrain.model.recompute.
    selective_policy): the four matmuls' (the row-parallel ones full size on every rank, before
    their reduction) and a fused attention kernel's (context and logsumexp) unless it draws
    dropout. An unfused core (eager, or SDPA's math path) keeps nothing: it is recomputed."""
    s, b, h, t, c = a.seq, a.micro_batch, shape.hidden_size, a.tp, a.compute_bytes
    sbh = s * b * h
    items = {
        "block_input": c * (sbh / t if a.sequence_parallel else sbh),
        "qkv_output": 3 * c * sbh / t,
        "dense_output": c * sbh,
        "h_to_4h_output": c * s * b * shape.ffn_hidden_size / t,
        "4h_to_h_output": c * sbh,
    }
    if a.attention in ("fused", "sdpa") and not a.attention_dropout:
        items["attention_output"] = c * sbh / t
        items.update(attention_core_items(shape, a))
    return items


def chunk_activation_items(shape: BloomShape, a: ActivationSpec, num_layers: int, first: bool,
                           last: bool, recompute: str) -> dict[str, float]:
    """Bytes one model chunk stores per micro-batch under `recompute` (none|selective|full)."""
    s, b, h, t, c = a.seq, a.micro_batch, shape.hidden_size, a.tp, a.compute_bytes
    sbh = s * b * h
    rep = sbh / t if a.sequence_parallel else sbh
    layer = layer_items(shape, a)
    per_layer = sum(layer.values())
    if recompute == "selective":
        per_layer = sum(selective_layer_items(shape, a).values())
    elif recompute == "full":
        per_layer = c * rep
    items = {"blocks": num_layers * per_layer}
    if a.attention in ("sdpa", "eager") and num_layers:
        items["alibi_bias"] = c * (shape.num_heads // t) * s * s
    if first:
        items["embedding_ln_input"] = c * rep
    if last:
        items["ln_f_and_head_inputs"] = c * rep + c * sbh
        items["loss_softmax_fp32"] = 4 * s * b * shape.vocab_size / t
    else:
        items["stage_output"] = c * rep  # held by the pipeline runtime for the backward
    return items


def recompute_working_set(shape: BloomShape, a: ActivationSpec, recompute: str) -> float:
    """The activations rebuilt during one layer's backward: full recompute rebuilds a whole layer,
    selective what the layer stores without recompute beyond what its cache kept."""
    if recompute == "full":
        return sum(layer_items(shape, a).values())
    if recompute == "selective":
        return max(0.0, sum(layer_items(shape, a).values())
                   - sum(selective_layer_items(shape, a).values()))
    return 0.0


def loss_working_set(shape: BloomShape, a: ActivationSpec) -> float:
    """The last stage's transient logits for one micro-batch, beside the saved float32 softmax:
    the logits in the compute dtype and, unless that is float32 already, their float32 cast.
    The backward works in place on the saved softmax (bloomtrain.parallel.tensor.loss, at every
    tp), so its peak is no higher."""
    cast = 4 if a.compute_bytes != 4 else 0
    return (a.compute_bytes + cast) * a.seq * a.micro_batch * shape.vocab_size / a.tp


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, pp_rank: int, num_micro: int,
              num_chunks: int) -> tuple[int, ...]:
    """The most micro-batches whose activations each chunk of this rank holds at once, under our
    own schedules' op lists (bloomtrain.parallel.pipeline.schedules): the peak of forwards done and
    not yet backwarded, counted where the total of all chunks peaks. 1F1B: min(pp - rank, m)."""
    ops = SCHEDULES[schedule](pp, pp_rank, num_micro, num_chunks)
    live = [0] * num_chunks
    best, best_total = tuple(live), 0
    for op in ops:
        live[op.chunk] += 1 if op.kind == "F" else -1
        if op.kind == "F" and sum(live) > best_total:
            best_total, best = sum(live), tuple(live)
    return best


def peak_in_flight(schedule: str, pp: int, pp_rank: int, num_micro: int,
                   num_chunks: int) -> tuple[int, ...]:
    """`in_flight`, in closed form where the schedule has one (1F1B: min(pp - rank, m); GPipe:
    m), so that a 72-stage search does not replay op lists."""
    if pp == 1 or schedule == "1f1b":
        return (min(pp - pp_rank, num_micro),)
    if schedule == "gpipe":
        return (num_micro,)
    return in_flight(schedule, pp, pp_rank, num_micro, num_chunks)


@lru_cache(maxsize=4096)
def zb_h1_phases(pp: int, pp_rank: int, num_micro: int) -> tuple[tuple, tuple]:
    """ZB-H1's candidate peaks on one rank, from its op list: the (whole micro-batches, held W
    stores) at each B, and at each W. A micro-batch keeps its whole activations from its F to its
    B; from its B to its W only what W needs (the linear layers' inputs and output gradients,
    weightgrad.WeightGradStore), which W consumes one weight gradient at a time. Rank 0 runs B
    and W as one backward (nothing to defer): 1F1B's min(pp, m) and no W peak."""
    if pp_rank == 0:
        return ((min(pp, num_micro), 0),), ()
    whole = held = 0
    at_b, at_w = set(), set()
    for op in zb_h1_schedule(pp, pp_rank, num_micro):
        if op.kind == "F":
            whole += 1
        elif op.kind == "B":
            at_b.add((whole, held))
            whole, held = whole - 1, held + 1
        else:  # the store W consumes lives until it is done
            at_w.add((whole, held))
            held -= 1
    return tuple(sorted(at_b)), tuple(sorted(at_w))


def weight_store_items(shape: BloomShape, a: ActivationSpec, num_layers: int) -> dict[str, float]:
    """Bytes B leaves for W per micro-batch: each linear layer's input and output gradient
    (weightgrad._LinearDeferredWeightGrad). Per token and layer, inputs h (QKV), h/t (dense),
    h (h->4h), f/t (4h->h) and output gradients 3h/t, h, f/t, h: 4h + 12h/t values with f = 4h
    (the column layers keep their whole input and the row layers' output gradient is whole, with
    or without sequence parallelism). The LM head's are not held: the last stage computes its
    weight gradient in B (zb_h1_once_items)."""
    tokens, h, t, c = a.seq * a.micro_batch, shape.hidden_size, a.tp, a.compute_bytes
    f = shape.ffn_hidden_size
    per_layer = (h + h / t + h + f / t) + (3 * h / t + h + f / t + h)
    return {"held_weight_grad_inputs": c * tokens * per_layer * num_layers}


def zb_h1_once_items(shape: BloomShape, a: ActivationSpec, num_layers: int,
                     last: bool) -> tuple[dict[str, float], float]:
    """What a zb-h1 rank holds once, not per micro-batch: on the last stage the LM head's
    weight gradient, summed in B until the next W (WeightGradStore.running); and the one weight
    gradient W makes at a time (the largest linear layer's), at a W."""
    h, t, c, f = shape.hidden_size, a.tp, a.compute_bytes, shape.ffn_hidden_size
    once = {"head_weight_grad_sum": c * h * shape.vocab_size / t} if last else {}
    largest = c * h * max(3 * h, f) / t if num_layers else 0.0
    return once, largest


# ---- a pipeline rank's peak ------------------------------------------------------------------
# The caching allocator's fragmentation over what is live: torch's reserved/allocated ratio in
# large-model training is typically 1.05-1.15; the planner adds this fraction of the peak.
ALLOCATOR_FRACTION = 0.08
# DeepSpeed's `buffered_allreduce_fallback(elements_per_buffer=500000000)` and its ZeRO buckets
# (reduce_bucket_size 5e8): a flat copy of up to this many gradient elements exists at the step.
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000


@dataclass
class StageMemory:
    pp_rank: int
    num_blocks: int
    in_flight: tuple[int, ...]
    model_states: dict
    host: dict
    activations: dict            # bytes held at the backward peak, by item
    transients: dict             # step-phase and backward-phase extras, by item
    allocator: float = 0.0
    context: float = 0.0
    total: float = 0.0


def activation_spec(cand, work) -> ActivationSpec:
    d = work.shape
    return ActivationSpec(seq=work.seq, micro_batch=cand.micro_batch, tp=cand.tp,
                          sequence_parallel=cand.layout.sequence_parallel,
                          compute_bytes=work.compute_bytes, attention=work.attention,
                          hidden_dropout=d.hidden_dropout > 0,
                          attention_dropout=d.attention_dropout > 0,
                          mask_bytes=work.mask_bytes)


@lru_cache(maxsize=65536)
def rank_states(shape: BloomShape, layout: ParallelLayout, pp_rank: int, system: str,
                precision: str, offload: bool,
                bucket_size_mb: float = 25.0) -> tuple[list[Group], dict]:
    """A rank's parameter groups and model-state bytes (cached: a search asks for the same
    ranks of many candidates)."""
    groups = rank_groups(shape, layout, pp_rank)
    if system == "megatron-deepspeed":
        return groups, megatron_states(groups, layout.zero_stage, layout.dp, precision)
    c = 4 if precision == "fp32" else 2
    return groups, model_states(groups, layout.zero_stage, layout.dp, c, offload,
                                bucket_size_mb)


def stage_activations(cand, work, pp_rank: int, m: int) -> tuple[tuple, dict, float]:
    """(micro-batches in flight per chunk, activation bytes by item, the recompute and loss
    working sets) of one pipeline rank."""
    layout, shape, a = cand.layout, work.shape, activation_spec(cand, work)
    ranges, vstages = layout.stage_ranges(shape.num_layers), layout.virtual_stages(pp_rank)
    if layout.pp > 1 and layout.schedule == "zb-h1":
        return _zb_h1_activations(cand, work, pp_rank, m)
    flight = peak_in_flight(layout.schedule if layout.pp > 1 else "1f1b", layout.pp, pp_rank, m,
                            layout.num_virtual_stages)
    acts: dict[str, float] = {}
    for vs, count in zip(vstages, flight):
        items = _chunk_items(shape, a, ranges[vs][1] - ranges[vs][0], vs == 0,
                             vs == layout.num_stages - 1, cand.recompute)
        for k, v in items.items():
            acts[k] = acts.get(k, 0.0) + v * count
    last_here = layout.num_stages - 1 in vstages
    working = (recompute_working_set(shape, a, cand.recompute)
               + (loss_working_set(shape, a) if last_here else 0.0))
    return flight, acts, working


def _zb_h1_activations(cand, work, pp_rank: int, m: int) -> tuple[tuple, dict, float]:
    """ZB-H1's rank at the larger of its B and W peaks (zb_h1_phases); at a W the working set
    adds one weight gradient (WeightGradStore.run makes them one at a time)."""
    layout, shape, a = cand.layout, work.shape, activation_spec(cand, work)
    start, end = layout.stage_ranges(shape.num_layers)[pp_rank]
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    whole = _chunk_items(shape, a, end - start, first, last, cand.recompute)
    store = weight_store_items(shape, a, end - start)
    loss = loss_working_set(shape, a) if last else 0.0
    base = recompute_working_set(shape, a, cand.recompute) + loss
    once, grad = zb_h1_once_items(shape, a, end - start, last)
    at_b, at_w = zb_h1_phases(layout.pp, pp_rank, m)
    best = None
    for (n_whole, n_held), extra in [(x, 0.0) for x in at_b] + [(x, grad) for x in at_w]:
        acts = {k: v * n_whole for k, v in whole.items()}
        acts.update({k: v * n_held for k, v in store.items()})
        acts.update(once)
        total = sum(acts.values()) + base + extra
        if best is None or total > best[0]:
            best = (total, (n_whole + n_held,), acts, base + extra)
    return best[1], best[2], best[3]


@lru_cache(maxsize=65536)
def _chunk_items(shape, a, blocks, first, last, recompute):
    return chunk_activation_items(shape, a, blocks, first, last, recompute)


def secondary_size(cand, node_size: int) -> int:
    """hpZ's s: the ranks of a dp group on one node (the dp group's ranks are tp apart)."""
    return max(1, min(cand.dp, node_size // cand.tp))


def compression_states(cand, work, states: dict, node_size: int) -> dict:
    """What the compression options keep per rank: error feedback's fp32 residual, as large as
    the rank's gradient input (4 B per local parameter, not sharded); hpZ's secondary copy of
    the compute-dtype weights, 1/s of them on each of the s dp ranks of a node."""
    out = {}
    if cand.error_feedback:
        out["error_feedback"] = 4 * states["flat_numel"]
    if cand.hpz:
        s = secondary_size(cand, node_size)
        out["hpz_secondary"] = work.compute_bytes * states["flat_numel"] // s
    return out


def stage_memory(cand, work, pp_rank: int, m: int, context_bytes: int,
                 node_size: int = 8) -> StageMemory:
    """One pipeline rank at its peak: model states, the activations of its micro-batches in
    flight, the backward's and the step's transients, the allocator's allowance and the device
    context. The caching allocator keeps the backward's blocks, so the step's flat buffers
    (other sizes) come on top of them rather than reusing them."""
    layout, c = cand.layout, work.compute_bytes
    groups, states = rank_states(work.shape, layout, pp_rank, work.system, work.precision,
                                 cand.offload, work.bucket_size_mb)
    states = {**states, "device": {**states["device"],
                                   **compression_states(cand, work, states, node_size)}}
    flight, acts, working = stage_activations(cand, work, pp_rank, m)
    backward, step = _transients(cand, work, groups, states["flat_numel"], c)
    backward["working_sets"] = working
    live = (sum(states["device"].values()) + sum(acts.values()) + sum(backward.values())
            + sum(step.values()))
    ranges = layout.stage_ranges(work.shape.num_layers)
    out = StageMemory(pp_rank=pp_rank, num_blocks=sum(ranges[v][1] - ranges[v][0]
                                                       for v in layout.virtual_stages(pp_rank)),
                      in_flight=flight, model_states=states["device"], host=states["host"],
                      activations=acts, transients={**backward, **step})
    out.allocator = ALLOCATOR_FRACTION * live
    out.context = context_bytes
    out.total = live + out.allocator + out.context
    return out


def _transients(cand, work, groups, psi: int, c: int) -> tuple[dict, dict]:
    """(backward-phase, step-phase) extras by item."""
    backward, step = {}, {}
    if work.megatron:
        backward["compute_grads"] = c * psi  # every 16-bit grad of the stage lives to the step
        if work.precision == "fp16" and cand.zero_stage == 0:
            step["fp32_grad_copies"] = 8 * psi  # FP16_Optimizer: per-param fp32 copies + flat
        else:
            step["reduce_buffer"] = (4 if work.precision != "fp16" else 2) * min(
                psi, DEEPSPEED_BUCKET_ELEMENTS)
        return backward, step
    backward["compute_grads"] = compute_grads_held(groups, c)
    bucket = work.bucket_size_mb * 2 ** 20  # fp32 bytes of one reduction bucket
    rules = stage_rules(cand.zero_stage)  # bloomtrain's engine: its stage's rules (stages.py)
    if rules.shard_grads:
        backward["grad_staging"] = STAGING_BUCKETS * bucket
    if rules.shard_params:
        backward["stage3_gathered"] = stage3_working_set(groups, cand.dp, c)
    if rules.shard_optimizer and not rules.shard_grads and cand.dp > 1:
        step["reduce_scatter_out"] = 4 * min(psi, bucket / 4) / cand.dp
    return backward, step


def static_bytes(cand, work, node_size: int = 8) -> float:
    """The most model-state bytes any rank of `cand` holds: a lower bound of its peak that needs
    neither activations nor a schedule (the search prunes with it)."""
    def states(r):
        s = rank_states(work.shape, cand.layout, r, work.system, work.precision,
                        cand.offload)[1]
        return sum(s["device"].values()) + sum(
            compression_states(cand, work, s, node_size).values())
    return max(states(r) for r in representative_ranks(cand.layout, work.shape.num_layers))


def representative_ranks(layout: ParallelLayout, num_layers: int) -> list[int]:
    """The ranks whose memory or time can be the largest: the first and the last, and the first
    of each block count between them (1F1B holds the most in flight on the earliest). Every rank
    under the interleaved schedule, and under zb-h1, whose held W stores do not fall with the
    rank (BLOOM-176B's layout at zb-h1 peaked on rank 10, past the first of its block count)."""
    if layout.num_virtual_stages > 1 or layout.schedule == "zb-h1":
        return list(range(layout.pp))
    ranges = layout.stage_ranges(num_layers)
    seen, out = set(), [0, layout.pp - 1]
    for r in range(1, layout.pp - 1):
        blocks = ranges[r][1] - ranges[r][0]
        if blocks not in seen:
            seen.add(blocks)
            out.append(r)
    return sorted(set(out))
