"""The forward passes of an evaluation, run by every rank of the job in lockstep on the same
inputs (rank 0 broadcasts them: bloomtrain.eval.protocol): `score` (the log-probability of
given target tokens and whether each is the greedy choice) and `next_logits` (generation). The
vocabulary is the model's whole (padded) output, as HF's BloomForCausalLM scores it and the
harness's HF backend reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bloomtrain.eval.model import EvalModel
from bloomtrain.model.bloom import packed_attention
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline.stage import PipelineChunk

COMM_NAME = "eval"
# fp32 logits of the LM head computed at once per rank (512 MiB): BLOOM's 250,880-entry
# vocabulary over thousands of scored positions would not fit otherwise.
LOGITS_BUDGET = 1 << 27


@dataclass
class ScoreBatch:
    """Rows of token ids, right-padded, and the queries: (row, position, target) each."""

    inputs: torch.Tensor   # [b, S] int64
    lengths: torch.Tensor  # [b]
    q_row: torch.Tensor    # [Q]
    q_pos: torch.Tensor    # [Q]
    q_target: torch.Tensor  # [Q]


class EvalCache:
    """The keys and values of a batch being generated, in the serving engine's paged KV cache
    (the one KV cache and attention path of inference: bloomtrain.serve.kv_cache and the
    model's paged backend): this rank's layers only, every row a sequence with a block table of
    its own, sized at prefill for `max_len` tokens a row. Finished rows leave (`keep`)."""

    BLOCK = 16

    def __init__(self, model: EvalModel, rows: int, max_len: int):
        from bloomtrain.serve.kv_cache import PagedKVCache

        layers = [b.self_attention.layer_idx for c in model.chunks
                  for b in c.transformer.h.values()]
        per = -(-max_len // self.BLOCK)
        shape = model.shape
        self.kv = PagedKVCache(shape.num_layers, rows * per, self.BLOCK,
                               shape.num_heads // model.topo.tp_size, shape.head_dim,
                               model.dtype, model.device, layers=layers)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
        self.lengths = [0] * rows
        self.max_len = max_len

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch, in that order (finished sequences leave)."""
        order = rows.tolist()
        self.tables = [self.tables[r] for r in order]
        self.lengths = [self.lengths[r] for r in order]

    def step(self, inputs: list[list[int]], last: int):
        """The StepBatch that feeds every row's `inputs` (one list per row, all of one
        length) after its cached tokens, with each row's logits at position `last` of its
        new tokens."""
        from bloomtrain.serve.batch import SeqStep, StepBatch

        q = len(inputs[0])
        seqs, ids = [], []
        for i, new in enumerate(inputs):
            ctx = self.lengths[i] + q
            if ctx > self.max_len:
                raise ValueError(f"row {i} grows to {ctx} tokens, past the {self.max_len} its "
                                 f"cache was sized for")
            seqs.append(SeqStep(i * q, q, ctx, self.tables[i][:-(-ctx // self.BLOCK)]))
            ids += new
            self.lengths[i] = ctx
        return StepBatch(ids, seqs, [i * q + last for i in range(len(inputs))])


# ---- the pipeline --------------------------------------------------------------------------------

def _peer(model: EvalModel, virtual_stage: int) -> int:
    """The global rank running `virtual_stage` in this rank's pipeline."""
    return model.topo.stage_rank(virtual_stage % model.topo.pp_size)


def _pad_multiple(model: EvalModel) -> int:
    return model.topo.tp_size if model.sequence_parallel else 1


def _run_stages(model: EvalModel, micro_inputs: list[torch.Tensor], on_last,
                paged: list | None = None) -> None:
    """Run each micro-batch of token ids [m, S] through this rank's chunks, in (chunk,
    micro-batch) order: embed or receive, the chunk's blocks, then send on or, on the last
    virtual stage, `on_last(micro_index, hidden)` with the hidden states [m, S(/tp), h]
    before ln_f. `paged`: each micro-batch's attention metadata (the model's inference
    protocol, bloomtrain.model.attention.StepAttention: a scoring step's packed sequences or
    a generation step's paged KV cache, each micro-batch one row [1, T] of packed tokens),
    which the blocks then attend through."""
    sends = []
    for index, chunk in enumerate(model.chunks):
        vs = chunk.virtual_stage
        for m, ids in enumerate(micro_inputs):
            if chunk.is_first:
                x = chunk.transformer.embed(ids)
            else:  # packed micro-batches differ in length: each its own
                x = torch.empty((ids.shape[0], ids.shape[1] // _pad_multiple(model),
                                 model.shape.hidden_size), dtype=model.dtype, device=model.device)
                comm.recv(x, _peer(model, vs - 1), COMM_NAME)
            x = chunk.transformer.run_blocks(x, chunk.transformer.h.values(),
                                             paged=None if paged is None else paged[m])
            if chunk.is_last:
                on_last(m, x)
            else:
                x = x.contiguous()
                sends.append((comm.isend(x, _peer(model, vs + 1), COMM_NAME), x))
    for work, _ in sends:
        work.wait()


def _last_chunk(model: EvalModel) -> PipelineChunk | None:
    return next((c for c in model.chunks if c.is_last), None)


def _from_last_stage(model: EvalModel, t: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `t` on every stage (the first's is what rank 0 reads)."""
    topo = model.topo
    comm.broadcast(t, topo.stage_rank(topo.pp_size - 1), topo.pp_group, COMM_NAME)
    return t


# ---- scoring -------------------------------------------------------------------------------------

def target_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 group) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, is-greedy) of `targets` [n] under logits split along the vocabulary
    [n, V/tp] (fp32), with four all-reduces of [n] over `group`. Greedy is torch.argmax's:
    the first index of the maximum."""
    local_max, local_arg = logits.max(dim=-1)  # [n]
    top = local_max.clone()
    comm.all_reduce(top, group, COMM_NAME, op=comm.ReduceOp.MAX)
    sum_exp = (logits - top[:, None]).exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group, COMM_NAME)
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0]
    picked = torch.where(inside, picked, torch.zeros_like(picked))
    comm.all_reduce(picked, group, COMM_NAME)
    nowhere = torch.iinfo(torch.int64).max
    first = torch.where(local_max == top, local_arg + vocab_start,
                        torch.full_like(local_arg, nowhere))
    comm.all_reduce(first, group, COMM_NAME, op=comm.ReduceOp.MIN)
    return picked - top - sum_exp.log(), first == targets


def _replica_rows(model: EvalModel, num_rows: int) -> tuple[int, int, bool]:
    """(first row, number of rows, whether the rows are split over dp) of this replica. Under
    ZeRO-3 each unit's weights are gathered over dp as it runs, so every replica must run
    the same forwards: there each one scores every row."""
    dp = model.topo.dp_size
    if dp == 1 or model.dp_lockstep:
        return 0, num_rows, False
    per = -(-num_rows // dp)
    first = min(model.topo.dp_rank * per, num_rows)
    return first, min(per, num_rows - first), True


def _micro_rows(model: EvalModel, rows: int, seq: int, micro_rows: int | None) -> int:
    """Rows per micro-batch: `micro_rows`, else the rows split into 2 * pp micro-batches for
    a pipeline (a bubble of (pp-1)/(3pp-1)), else all of them; under sequence parallelism the
    LM head sees every position, so its logits are kept within LOGITS_BUDGET."""
    pp = model.topo.pp_size
    step = micro_rows or (-(-rows // (2 * pp)) if pp > 1 else rows)
    if model.sequence_parallel:
        vocab_local = model.shape.vocab_size // model.topo.tp_size
        step = min(step, max(1, LOGITS_BUDGET // (seq * vocab_local)))
    return max(1, min(step, rows))


@torch.no_grad()
def score(model: EvalModel, batch: ScoreBatch, micro_rows: int | None = None) -> torch.Tensor:
    """[2, Q] fp32 on the CPU: each query's log-probability and greedy flag (0 or 1), complete
    on the first pipeline stage of every replica (rank 0 among them).

    Data-parallel replicas take equal slices of the rows (under ZeRO-3, whose weight gathers
    need every replica to run the same forwards, each takes all). A replica streams its slice
    through its pipeline in micro-batches, each stage sending its output on without waiting:
    the smallest unfinished (virtual stage, micro-batch) can always run, so nothing deadlocks.
    A micro-batch is its rows packed into one padding-free row of tokens, each attending
    causally to itself (the model's inference protocol, as the serving engine packs prompts:
    bloomtrain.model.attention.PackedAttention), with no KV cache, since nothing decodes after;
    under sequence parallelism, whose hidden states are sequence shards, the rows are
    right-padded instead (a causal model never sees the padding of the positions that matter).
    The last stage computes logits only at the queried positions (the LM head is the largest
    matmul of a short continuation's scoring) and reduces them over the vocabulary shards
    without gathering them (Megatron's vocab-parallel cross-entropy: max, sum of exponentials
    and the target's logit, each all-reduced over tp). Each query's figures then go to rank 0:
    summed over dp (each query has one owner), broadcast from the last pipeline stage."""
    topo = model.topo
    first, count, split = _replica_rows(model, batch.inputs.shape[0])
    out = torch.zeros((2, batch.q_row.numel()), dtype=torch.float32, device=model.device)
    if count:
        mine = ((batch.q_row >= first) & (batch.q_row < first + count)).nonzero()[:, 0]
        model.train(False)
        run = _score_padded if model.sequence_parallel else _score_packed
        run(model, batch, range(first, first + count), mine, micro_rows, out)
    if split:  # each query was scored by one replica, zeros elsewhere
        comm.all_reduce(out, topo.dp_group, COMM_NAME)
    return _from_last_stage(model, out).cpu()


def _score_packed(model: EvalModel, batch: ScoreBatch, rows: range, mine: torch.Tensor,
                  micro_rows: int | None, out: torch.Tensor) -> None:
    """Score queries `mine` (all in `rows`) into `out`, each micro-batch of rows packed into
    one row of tokens [1, T] (T at most the padded batch's rows x longest)."""
    step = _micro_rows(model, len(rows), 0, micro_rows)
    lengths = batch.lengths[rows.start:rows.stop].tolist()
    slopes = model.chunks[0].transformer.alibi_slopes  # this rank's heads
    start = [0] * len(rows)  # each row's first token in its micro-batch's packed row
    micro, metas = [], []
    for lo in range(0, len(rows), step):
        group = range(lo, min(lo + step, len(rows)))
        at = 0
        for r in group:
            start[r], at = at, at + lengths[r]
        micro.append(torch.cat([batch.inputs[rows.start + r, :lengths[r]] for r in group]))
        metas.append(packed_attention([lengths[r] for r in group], slopes, model.dtype,
                                      model.device))
    local_row = batch.q_row[mine] - rows.start
    micro_of = local_row // step
    where = torch.tensor(start, dtype=torch.int64)[local_row] + batch.q_pos[mine]

    def on_last(m: int, hidden: torch.Tensor) -> None:  # hidden [1, T, h]
        sel = (micro_of == m).nonzero()[:, 0]
        if sel.numel():  # the same on every tp rank: the collectives below match
            q = mine[sel]
            out[:, q.to(model.device)] = _score_queries(
                model, hidden, torch.zeros_like(sel), where[sel], batch.q_target[q])

    _run_stages(model, [ids[None].to(model.device) for ids in micro], on_last, paged=metas)


def _score_padded(model: EvalModel, batch: ScoreBatch, rows: range, mine: torch.Tensor,
                  micro_rows: int | None, out: torch.Tensor) -> None:
    """Score queries `mine` (all in `rows`) into `out`, the rows right-padded to one length
    (a multiple of tp: sequence parallelism's shards) in micro-batches [m, S]."""
    count = len(rows)
    seq = padded_length(model, int(batch.lengths[rows.start:rows.stop].max()))
    inputs = torch.zeros((count, seq), dtype=torch.int64)
    width = min(seq, batch.inputs.shape[1])
    inputs[:, :width] = batch.inputs[rows.start:rows.stop, :width]
    step = _micro_rows(model, count, seq, micro_rows)
    local_row = batch.q_row[mine] - rows.start

    def on_last(m: int, hidden: torch.Tensor) -> None:
        lo = m * step
        sel = ((local_row >= lo) & (local_row < lo + hidden.shape[0])).nonzero()[:, 0]
        if sel.numel():  # the same on every tp rank: the collectives below match
            q = mine[sel]
            out[:, q.to(model.device)] = _score_queries(
                model, hidden, local_row[sel] - lo, batch.q_pos[q], batch.q_target[q])

    _run_stages(model, list(inputs.to(model.device).split(step)), on_last)


def _score_queries(model: EvalModel, hidden: torch.Tensor, rows: torch.Tensor,
                   pos: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[2, n] stats of queries (micro-batch row, position, target) from the last chunk's
    hidden states [m, S(/tp), h], the LM head run only where a query looks, in slices that
    keep its logits within LOGITS_BUDGET."""
    chunk = _last_chunk(model)
    device = hidden.device
    rows, pos, targets = rows.to(device), pos.to(device), targets.to(device)
    vocab_local = model.shape.vocab_size // model.topo.tp_size
    group, start = model.topo.tp_group, model.vocab_start
    if model.sequence_parallel:
        # The head gathers the sequence itself: logits at every position, then picked.
        logits = chunk.lm_head(chunk.transformer.ln_f(hidden))  # [m, S, V/tp]
        picked = logits[rows, pos].float()
        return torch.stack([t.float() for t in target_stats(picked, targets, start, group)])
    where, index = torch.unique(torch.stack([rows, pos]), dim=1, return_inverse=True)
    normed = chunk.transformer.ln_f(hidden[where[0], where[1]])  # [u, h]
    out = torch.empty((2, targets.numel()), dtype=torch.float32, device=device)
    span = max(1, LOGITS_BUDGET // vocab_local)
    for lo in range(0, normed.shape[0], span):
        logits = chunk.lm_head(normed[lo:lo + span]).float()  # [u', V/tp]
        sel = ((index >= lo) & (index < lo + span)).nonzero()[:, 0]
        lp, greedy = target_stats(logits[index[sel] - lo], targets[sel], start, group)
        out[0, sel], out[1, sel] = lp, greedy.float()
    return out


# ---- generation ----------------------------------------------------------------------------------

@torch.no_grad()
def next_logits(model: EvalModel, inputs: torch.Tensor, last: int,
                cache: EvalCache | None) -> torch.Tensor:
    """fp32 logits [b, V] at position `last` of `inputs` [b, S] (the new tokens, after the
    cache's), complete on the first pipeline stage; with `cache`, the new tokens' keys and
    values go into it and attention reads it (the serving engine's paged path: the rows packed
    into one, each its own sequence). Every replica runs the whole batch; the last stage
    gathers the logits over tp and broadcasts them to the first stage, where rank 0 chooses the
    next tokens. Under sequence parallelism hidden states are sequence shards, which a
    one-token step cannot be: there the cache is off and each step runs the whole sequence,
    padded to a multiple of tp."""
    from bloomtrain.serve.runner import plan_step

    topo = model.topo
    b = inputs.shape[0]
    out = torch.empty((b, model.shape.vocab_size), dtype=torch.float32, device=model.device)
    model.train(False)
    if cache is None:
        def on_last(_: int, hidden: torch.Tensor) -> None:
            chunk = _last_chunk(model)
            if model.sequence_parallel:
                local = chunk.lm_head(chunk.transformer.ln_f(hidden))[:, last]  # [b, V/tp]
            else:
                local = chunk.lm_head(chunk.transformer.ln_f(hidden[:, last]))  # [b, V/tp]
            out.copy_(_gather_vocab(local.float().contiguous(), topo.tp_group))

        _run_stages(model, [inputs.to(model.device)], on_last)
        return _from_last_stage(model, out).cpu()
    batch = cache.step(inputs.tolist(), last)
    slopes = model.chunks[0].transformer.alibi_slopes  # this rank's heads
    ids, meta, rows = plan_step(batch, cache.kv, slopes, model.dtype, model.device)

    def on_paged(_: int, hidden: torch.Tensor) -> None:  # hidden [1, T, h]
        chunk = _last_chunk(model)
        local = chunk.lm_head(chunk.transformer.ln_f(hidden[0].index_select(0, rows)))
        out.copy_(_gather_vocab(local.float().contiguous(), topo.tp_group))

    _run_stages(model, [ids[None]], on_paged, paged=[meta])
    return _from_last_stage(model, out).cpu()


def _gather_vocab(local: torch.Tensor, group) -> torch.Tensor:
    tp = comm.group_size(group)
    if tp == 1:
        return local
    full = local.new_empty((tp * local.shape[0], local.shape[1]))
    comm.all_gather_into_tensor(full, local, group, COMM_NAME)
    # [tp * b, V/tp] -> [b, V]: rank i holds vocabulary rows [i V/tp, (i+1) V/tp).
    return full.view(tp, local.shape[0], -1).transpose(0, 1).reshape(local.shape[0], -1)


def padded_length(model: EvalModel, length: int) -> int:
    """The length a step's rows are padded to (a multiple of tp under sequence parallelism)."""
    mult = _pad_multiple(model)
    return -(-length // mult) * mult


def uses_cache(model: EvalModel) -> bool:
    return not model.sequence_parallel


