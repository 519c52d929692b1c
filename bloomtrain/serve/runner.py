"""One forward step of the serving engine: the new tokens of every scheduled sequence packed into
one padding-free row of tokens, run through the model's own forward (BloomModel.forward with
`paged`: bloomtrain.model.attention's paged backend), attention per sequence over its blocks of
the paged KV cache. A step holds, per sequence, `q_len` new tokens (a prefill chunk, or one
token when decoding) at positions [ctx_len - q_len, ctx_len): row-wise work (embedding,
LayerNorms, every matmul, GeLU) runs on all rows at once, attention per sequence (prefill chunks
one call each, decodes in one batched call over keys padded to a common length).

Batch invariance: a request produces the same tokens whatever else is served. On CPU its logits
are bitwise the same (matmul rows padded to `min_rows`, prompts cut at fixed positions, decode
keys padded by whole DECODE_BUCKETs; each at its line); on CUDA, cuBLAS picks kernels (split-K
among them) by problem size, so batched and alone agree to float rounding, not bitwise.

On CUDA, decode-only steps replay CUDA graphs instead (bloomtrain.serve.graphs: the same model
code on static buffers at padded shapes; `ModelRunner.graphs`), unless --enforce-eager. There,
decodes read their keys and values in place with FlexAttention (bloomtrain.model.paged_flex;
`ModelRunner.decode`, BLOOMTRAIN_PAGED_DECODE=gather|flex|auto); on CPU they gather them, the
batch-invariant way (flex's compiled CPU kernel, faster at large batches, rounds a sequence
differently alone than batched: README, Serve).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bloomtrain.model.attention import PagedAttention
from bloomtrain.model.bloom import alibi_bias
from bloomtrain.model.paged_flex import decode_kernel, flex_paged_decode, pad_pow2
from bloomtrain.serve.batch import StepBatch
from bloomtrain.serve.kv_cache import PagedKVCache, slots_of
from bloomtrain.serve.sampler import SamplingBatch, sample

# CPU GEMMs (MKL) take a different kernel, with a different summation order, for a handful of
# rows than for many, and from some row count on compute each output row the same way whatever
# the count: every matmul's rows are padded to at least that count (`min_rows`), measured when
# the runner is built (batch_invariant_rows), since it depends on the CPU and the library. Too
# many rows of padding cost a small step dearly (a lone decode padded to 16 rows, not 4, ran 40%
# longer on a 2-core CPU).
MIN_ROWS = 16       # rows of padding where none is measured (CUDA), or none was found to hold
# A decode's keys are padded to the longest context of the step, rounded up to whole blocks and
# a multiple of this, and masked with -inf: batched matmuls compute each matrix alone, and
# padding by whole multiples of 32 masked positions only adds exact zeros after the real
# positions to the sums of the softmax and of p·V, whose vector lanes stay where they were
# (tests/serve/test_serve.py checks it on the machine it runs on).
DECODE_BUCKET = 32
# Decodes of very different lengths are attended in up to DECODE_GROUPS calls (decode_groups),
# when a cut saves more than DECODE_GROUP_COST padded keys (summed over the group's sequences):
# what one more gather and attention call per layer costs, about (of 64, 128, 256 and 512 keys,
# 256 did best on bench/serve_load.py's load at one thread).
DECODE_GROUPS = 3
DECODE_GROUP_COST = 256
ROW_CANDIDATES = (1, 2, 4, 8, 16)
# Row counts the probe tries: every count up to 33 (kernels switch at small counts), then
# counts around the multiples of the blocking sizes GEMMs use, then the step's largest.
PROBE_ROWS = (*range(1, 34), 47, 48, 49, 63, 64, 65, 95, 96, 97, 127, 128, 129, 255, 256, 257)
PROBE_COLS = 16384  # output features probed per matmul (bloom-7b1's widest layer)


def _matmuls(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias or None) of each distinct matmul a step runs through F.linear: one per
    (shape, dtype, with or without bias) among the linear layers and the LM head (the
    embedding lookups are not matmuls; int8 weights are probed as int8_matmul runs them,
    converted to the activations' dtype)."""
    out, seen = [], set()
    for module in model.modules():
        q = getattr(module, "weight_int8", None)
        if q is not None:  # Int8Linear, and Int8Embedding as the tied LM head's matrix
            candidates = [(q, None)]
        else:
            w = getattr(module, "weight", None)
            if (not isinstance(w, torch.Tensor) or w.dim() != 2 or "Embedding" in
                    type(module).__name__):
                continue
            b = getattr(module, "bias", None)
            candidates = [(w, None)] + ([(w, b)] if isinstance(b, torch.Tensor) else [])
        for w, b in candidates:
            key = (tuple(w.shape), w.dtype, b is not None)
            if key not in seen:
                seen.add(key)
                out.append((w.detach(), None if b is None else b.detach()))
    return out


@torch.inference_mode()
def batch_invariant_rows(model, max_rows: int, dtype: torch.dtype, matmul=F.linear
                         ) -> int | None:
    """The fewest rows, of ROW_CANDIDATES, from which every matmul of `model` gives each row
    bitwise the same result whatever the row count (probed at PROBE_ROWS up to `max_rows`,
    against the result at `max_rows`, on random inputs); None when no candidate holds (this
    CPU's GEMMs change a row's summation order with the row count even for many rows)."""
    g = torch.Generator().manual_seed(0)
    counts = sorted({m for m in PROBE_ROWS if m < max_rows} | {max_rows})
    first_bad = 0  # the largest row count whose rows differ from the reference, or 0
    for w, b in _matmuls(model):
        # A vocabulary-sized head (250,880 rows for BLOOM) is probed on its first PROBE_COLS
        # rows, as wide as the widest layer a CPU serves, so with the same wide-matrix
        # kernels at a fraction of the cost (the probe runs at every start).
        w, b = w[:PROBE_COLS].to(dtype), None if b is None else b[:PROBE_COLS].to(dtype)
        x = torch.randn((max_rows, w.shape[1]), generator=g).to(w.device, dtype)
        ref = matmul(x, w, b)
        for m in counts:
            out = matmul(x[:m], w, b)
            if m > first_bad and not torch.equal(out, ref[:m]):
                first_bad = m
    fits = [r for r in ROW_CANDIDATES if r > first_bad]
    return fits[0] if fits else None


def plan_step(batch: StepBatch, cache: PagedKVCache, slopes: torch.Tensor, dtype: torch.dtype,
              device, min_rows: int = 1, decode: str = "gather"
              ) -> tuple[torch.Tensor, PagedAttention, torch.Tensor]:
    """A step's (token ids [rows] padded to `min_rows`, its attention metadata for the model's
    paged backend, the logit rows [>= min_rows]), built the same way on every rank that runs
    it: each prompt chunk's block table and ALiBi bias (`slopes`: this rank's heads), the
    decodes' tables and biases padded to a common width (`decode` "gather"), or their
    FlexAttention metadata (`decode` "flex": bloomtrain.model.paged_flex), and the slot of
    every new token."""
    dev, bs = device, cache.block_size
    num_tokens = len(batch.input_ids)
    ids = batch.input_ids + [0] * (max(num_tokens, min_rows) - num_tokens)
    write_slots = [0] * num_tokens
    prefills, decoding = [], []
    for s in batch.seqs:
        if s.q_len > 1:
            table = torch.tensor([s.blocks], device=dev)
            slots = slots_of(table[0], s.ctx_len, bs)
            write_slots[s.row:s.row + s.q_len] = slots[s.ctx_len - s.q_len:].tolist()
            q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=dev,
                                 dtype=torch.float32)
            bias = alibi_bias(slopes, q_pos[None], s.ctx_len, dtype)[:, 0]
            prefills.append((s.row, s.row + s.q_len, table, cache.buffer(table), s.ctx_len,
                             bias))
        else:
            decoding.append(s)
            p = s.ctx_len - 1
            write_slots[s.row] = s.blocks[p // bs] * bs + p % bs
    decodes, flex = [], []
    if decoding and decode == "flex":
        flex.append(_flex_decodes(decoding, cache, slopes, dev))
    elif decoding:
        # Whole blocks, and a multiple of DECODE_BUCKET keys (why: at DECODE_BUCKET).
        bucket = math.lcm(DECODE_BUCKET, bs)
        for group, padded in decode_groups(decoding, bucket):
            width = padded // bs
            # Padding blocks point at block 0: real memory, finite values, masked below.
            tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in group],
                                  device=dev)  # [D, width]
            q_pos = torch.tensor([[s.ctx_len - 1] for s in group], device=dev,
                                 dtype=torch.float32)  # [D, 1]
            bias = alibi_bias(slopes, q_pos, padded, dtype)  # [nh, D, 1, Lp]
            rows = torch.tensor([s.row for s in group], device=dev)
            decodes.append((rows, tables, cache.buffer(tables), bias.view(-1, 1, padded)))
    meta = PagedAttention(cache, torch.tensor(write_slots, device=dev, dtype=torch.int64),
                          num_tokens, prefills, decodes, flex)
    num_logits = len(batch.logit_rows)
    logit_rows = batch.logit_rows + [0] * (max(num_logits, min_rows) - num_logits)
    return (torch.tensor(ids, device=dev), meta, torch.tensor(logit_rows, device=dev))


def decode_groups(decoding: list, bucket: int) -> list[tuple[list, int]]:
    """The decoding sequences in groups attended one batched call each, with each group's key
    length (its longest context rounded up to `bucket`). One group pads every sequence to the
    step's longest context; under a load of mixed lengths that is twice the keys there are
    (bench/serve_load.py's requests: 1.99x), gathered and attended for nothing. Sorted by
    length, the sequences are cut where it saves more padded keys than DECODE_GROUP_COST per
    extra group, into at most DECODE_GROUPS groups. A sequence's logits are the same whichever
    group it is in: its keys are padded by whole buckets either way (DECODE_BUCKET)."""
    order = sorted(decoding, key=lambda s: s.ctx_len)
    pads = [-(-s.ctx_len // bucket) * bucket for s in order]
    cuts = [len(order)]  # group ends, the last group first
    while len(cuts) < DECODE_GROUPS:
        end = cuts[-1]
        # The best cut of order[:end] into [:i] and [i:end], against leaving it whole.
        best, at = end * pads[end - 1] - DECODE_GROUP_COST, None
        for i in range(1, end):
            if pads[i - 1] == pads[end - 1]:
                break
            cost = i * pads[i - 1] + (end - i) * pads[end - 1]
            if cost < best:
                best, at = cost, i
        if at is None:
            break
        cuts.append(at)
    starts = cuts[1:] + [0]
    return [(order[a:b], pads[b - 1]) for a, b in zip(starts, cuts)]


def _flex_decodes(decoding: list, cache: PagedKVCache, slopes: torch.Tensor, dev):
    """The decoding sequences' FlexAttention metadata, the batch padded to a power of two and
    the tables to a power-of-two width, so that the compiled kernel meets few shapes (padding
    sequences: row of the first, position 0 of block 0; their output is dropped)."""
    d = len(decoding)
    size, width = pad_pow2(d), pad_pow2(max(len(s.blocks) for s in decoding))
    tables = [s.blocks + [0] * (width - len(s.blocks)) for s in decoding]
    tables += [[0] * width] * (size - d)
    rows = [s.row for s in decoding] + [decoding[0].row] * (size - d)
    q_pos = [s.ctx_len - 1 for s in decoding] + [0] * (size - d)
    return flex_paged_decode(torch.tensor(rows, device=dev), torch.tensor(tables, device=dev),
                             torch.tensor(q_pos, device=dev), slopes, cache.block_size,
                             cache.plane_blocks, num_real=d,
                             compiled=torch.device(dev).type == "cuda")


class ModelRunner:
    """Runs StepBatches through a (possibly tensor-parallel, possibly int8) BloomForCausalLM,
    keeping keys and values in `cache`. `tp_group` is None or the group the model is split
    over; every rank of it runs the same batches, and the vocabulary-parallel logits meet on
    the group's first rank alone (a gather, not an all-gather), which samples. `min_rows`: the
    rows every matmul is padded to (see MIN_ROWS; build_runner measures it, the same on every
    rank of `tp_group`)."""

    def __init__(self, model, cache: PagedKVCache, tp_group=None, min_rows: int = MIN_ROWS):
        self.model = model
        self.min_rows = min_rows
        self.cache = cache
        self.tp_group = tp_group
        tr = model.transformer
        self.slopes = tr.alibi_slopes  # this rank's heads under tensor parallelism
        self.dtype = tr.word_embeddings_layernorm.weight.dtype
        self.device = tr.word_embeddings_layernorm.weight.device
        # Decode steps from CUDA graphs (bloomtrain.serve.graphs.use_decode_graphs), or None:
        # every step eager.
        self.graphs = None
        # "flex": decodes read the cache in place (bloomtrain.model.paged_flex); "gather":
        # copied out and attended with HF's math. BLOOMTRAIN_PAGED_DECODE, or by device.
        self.decode = decode_kernel(self.device, cache.block_size)
        # Bytes of MKL-packed weight copies for steps of min_rows rows (serve/packed.py).
        self.packed_bytes = 0

    def _plan(self, batch: StepBatch) -> tuple[torch.Tensor, PagedAttention, torch.Tensor]:
        return plan_step(batch, self.cache, self.slopes, self.dtype, self.device, self.min_rows,
                         self.decode)

    # ---- the forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: StepBatch, sampling: SamplingBatch | None = None):
        """Write the batch's keys and values into the cache; with `sampling`, return its
        SamplerOutput (the tokens chosen and the log-probabilities asked for, sampled on the
        logits' device: bloomtrain.serve.sampler). Without, return the fp32 logits
        [len(batch.logit_rows), vocab] (the padded vocabulary). Under tensor parallelism only
        the group's first rank gets either; the others get None."""
        logits = self.logits(batch)
        if logits is None:
            return None
        if sampling is None:
            return logits[:len(batch.logit_rows)].float()
        return sample(logits, sampling)

    def logits(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits [>= len(batch.logit_rows), vocab] in the model's dtype (rows
        padded to min_rows), on the group's first rank; None on the others. `graphs`, when
        set, runs the decode steps it can (see DecodeGraphs.run)."""
        if self.graphs is not None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        ids, meta, logit_rows = self._plan(batch)
        hidden = self.model.transformer(ids[None], paged=meta)  # [1, rows, h], after ln_f
        logits = self.model.lm_head(hidden[0].index_select(0, logit_rows))  # [R, V / tp]
        if self.tp_group is not None:
            return self._gather_vocab(logits)
        return logits

    def _gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """[R, V/tp] on each rank -> [R, V] on the group's first rank: rank i holds vocabulary
        rows [i V/tp, (i+1) V/tp)."""
        import torch.distributed as dist

        from bloomtrain.parallel import comm

        pieces = comm.gather(local.contiguous(), dist.get_global_rank(self.tp_group, 0),
                             self.tp_group, "tp")
        return None if pieces is None else torch.cat(pieces, dim=1)
