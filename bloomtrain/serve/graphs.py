"""Decode steps replayed from CUDA graphs, as vLLM does: a step in which every sequence decodes
one token launches a few hundred small kernels, and at small batches the GPU waits on Python
to launch them. A CUDA graph captures the step's kernels once and replays them with one launch.

A graph replays fixed shapes and fixed addresses, so a decode step is run on static input
buffers (token ids, write slots, block tables, query positions) at a padded batch size (one of
GRAPH_BATCH_SIZES) and a padded key width (a power-of-two multiple of the runner's decode
bucket), and everything the model's attention needs is computed from those buffers inside the
captured region (the ALiBi bias from the query positions, the PagedAttention metadata over
views of the buffers), through the same model code as an eager step. Padding sequences write
their keys and values into the cache's scratch block, which no sequence owns, and attend to it
alone; their logits are ignored. The graph ends at the hidden states: the LM head runs eagerly
on the graph's static output (one matmul, whose [rows, vocab] output would otherwise be kept
alive per graph: tens of MB each at BLOOM's vocabulary), and so does sampling. Prefill chunks,
mixed steps, and batches or contexts beyond the captured set run eagerly (`run` returns None),
as do steps under tensor parallelism (its all-reduces inside a graph are not done here).

On CPU there are no graphs: `capture=False` runs the same static-buffer step eagerly (tests
check it equals the normal decode, bitwise, and writes no real slot beyond the batch's own).
"""
from __future__ import annotations

import math

import torch

from bloomtrain.model.attention import PagedAttention
from bloomtrain.model.bloom import alibi_bias
from bloomtrain.model.paged_flex import flex_paged_decode
from bloomtrain.serve.batch import StepBatch
from bloomtrain.serve.config import blocks_for
from bloomtrain.serve.runner import DECODE_BUCKET

# vLLM's sizes: a batch is padded up to the next of these, so a handful of graphs serve every
# batch size up to the largest.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Graphs are captured lazily, at a (batch size, key width) pair's first step, not all at start:
# the pairs are the product of batch sizes and widths (13 x 8 at 256 sequences of 4096 tokens),
# most of which a given load never meets. Each costs once a few steps' time for the capture and,
# with the flex decode kernel (compiled per shape, bloomtrain.model.paged_flex), its compile:
# seconds in which that step, and every client's stream, waits (bench/serve_gpu.py reports a
# server's first pass over a load apart from the later ones, `engine_cold`). All
# graphs share one memory pool (they replay one at a time), so more graphs cost little memory;
# the bound only caps capture time. Beyond it, new pairs run eagerly.
MAX_GRAPHS = 64
WARMUP_STEPS = 2  # eager runs on a side stream before a capture, as torch's docs prescribe


def graphs_wanted(device, tp_group, enforce_eager: bool) -> bool:
    """CUDA graphs for decode steps: on CUDA, a single-rank runner, unless enforce_eager."""
    return torch.device(device).type == "cuda" and tp_group is None and not enforce_eager


def use_decode_graphs(runner, max_num_seqs: int, max_model_len: int,
                      enforce_eager: bool = False) -> None:
    """Give `runner` (a ModelRunner) CUDA graphs for its decode steps where graphs_wanted."""
    if graphs_wanted(runner.device, runner.tp_group, enforce_eager):
        runner.graphs = DecodeGraphs(runner, max_num_seqs, max_model_len, capture=True)


class DecodeGraphs:
    """Decode steps of `runner` on static buffers sized for `max_num_seqs` sequences of up to
    `max_model_len` tokens: captured as CUDA graphs and replayed (`capture`), or run eagerly
    on the same buffers (`capture=False`, for CPU tests). `sizes`: the padded batch sizes (by
    default GRAPH_BATCH_SIZES up to the first that holds max_num_seqs)."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool,
                 sizes: tuple[int, ...] | None = None):
        self.runner, self.capture = runner, capture
        cache, dev = runner.cache, runner.device
        if sizes is None:
            sizes = tuple(s for s in GRAPH_BATCH_SIZES if s < max_num_seqs)
            sizes += tuple(s for s in GRAPH_BATCH_SIZES if s >= max_num_seqs)[:1]
        self.sizes = sizes
        bs = cache.block_size
        # Key widths: whole blocks and whole DECODE_BUCKETs as the eager decode pads them (see
        # runner.DECODE_BUCKET), doubled from there, so that a graph gathers at most twice the
        # keys the eager step would.
        self.base_keys = math.lcm(DECODE_BUCKET, bs)
        self.max_keys = blocks_for(max_model_len, self.base_keys) * self.base_keys
        batch = max(sizes)
        rows = max(batch, runner.min_rows)  # matmul rows, padded as an eager step pads them
        self.scratch_slot = cache.scratch_block * bs
        self.ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.write_slots = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((batch, self.max_keys // bs), dtype=torch.int64, device=dev)
        self.q_pos = torch.zeros((batch, 1), dtype=torch.float32, device=dev)
        self.seq_rows = torch.arange(batch, device=dev)  # sequence i decodes at row i
        self.slopes = runner.slopes.to(device=dev, dtype=torch.float32)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (size, keys) -> (graph, hidden)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps run here, graph or (capture=False) static eager

    def shape_for(self, batch: StepBatch) -> tuple[int, int] | None:
        """(padded batch size, key width) of a decode-only step that this path runs, or None:
        a step with a prompt chunk, sequences not at rows 0..D-1 each with its one logit row,
        more sequences than the largest size, or a context beyond max_model_len."""
        seqs = batch.seqs
        if not seqs or len(seqs) > self.sizes[-1] or any(s.q_len != 1 for s in seqs):
            return None
        if (batch.logit_rows != list(range(len(seqs)))
                or any(s.row != i for i, s in enumerate(seqs))):
            return None
        longest = max(s.ctx_len for s in seqs)
        if longest > self.max_keys:
            return None
        size = next(s for s in self.sizes if s >= len(seqs))
        buckets = -(-longest // self.base_keys)
        keys = self.base_keys * (1 << (buckets - 1).bit_length())
        return size, min(keys, self.max_keys)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits [>= len(batch.seqs), vocab] (row i: sequence i), or None where
        the step runs eagerly."""
        shape = self.shape_for(batch)
        if shape is None:
            return None
        if not self.capture:
            self._fill(batch, *shape)
            hidden = self._step(*shape)
        else:
            if shape not in self.graphs:
                if len(self.graphs) >= MAX_GRAPHS:
                    return None
                self.graphs[shape] = self._capture(*shape)
            graph, hidden = self.graphs[shape]
            self._fill(batch, *shape)
            graph.replay()  # reads the static inputs, overwrites `hidden`
        self.replays += 1
        return self.runner.model.lm_head(hidden)

    def _fill(self, batch: StepBatch, size: int, keys: int) -> None:
        """The batch into the static buffers, padded to `size` sequences: a padding sequence
        writes to the scratch slot and attends to the scratch block alone (position 0)."""
        seqs, width = batch.seqs, keys // self.runner.cache.block_size
        pad, scratch = size - len(seqs), self.runner.cache.scratch_block
        bs = self.runner.cache.block_size
        slots = [s.blocks[(s.ctx_len - 1) // bs] * bs + (s.ctx_len - 1) % bs for s in seqs]
        tables = [s.blocks[:width] + [scratch] * (width - len(s.blocks[:width])) for s in seqs]
        rows = self.ids.shape[0]
        host = [
            (self.ids, batch.input_ids + [0] * (rows - len(seqs))),
            (self.write_slots[:size], slots + [self.scratch_slot] * pad),
            (self.tables[:size, :width], tables + [[scratch] * width] * pad),
            (self.q_pos[:size, 0], [float(s.ctx_len - 1) for s in seqs] + [0.0] * pad),
        ]
        for static, values in host:
            static.copy_(torch.tensor(values, dtype=static.dtype))

    def _pad_all(self) -> None:
        """Every static buffer to padding: what a warm-up or a capture run writes goes to the
        scratch block only."""
        self.ids.zero_()
        self.write_slots.fill_(self.scratch_slot)
        self.tables.fill_(self.runner.cache.scratch_block)
        self.q_pos.zero_()

    def _step(self, size: int, keys: int) -> torch.Tensor:
        """The decode step on the static buffers: what a graph captures. Hidden states after
        ln_f [rows, h], rows = max(size, min_rows) as the eager step pads its matmuls."""
        r, cache = self.runner, self.runner.cache
        rows = max(size, r.min_rows)
        tables = self.tables[:size, :keys // cache.block_size]
        if r.decode == "flex":  # read in place (bloomtrain.model.paged_flex), from the buffers
            flex = [flex_paged_decode(self.seq_rows[:size], tables, self.q_pos[:size],
                                      self.slopes, cache.block_size, cache.plane_blocks,
                                      compiled=self.capture)]
            meta = PagedAttention(cache, self.write_slots[:size], size, [], [], flex)
            return r.model.transformer(self.ids[None, :rows], paged=meta)[0]
        # [nh, size, 1, keys] -> [nh * size, 1, keys], head-major like the cache's reads.
        bias = alibi_bias(self.slopes, self.q_pos[:size], keys, r.dtype).view(-1, 1, keys)
        decodes = [(self.seq_rows[:size], tables, cache.buffer(tables), bias)]
        meta = PagedAttention(cache, self.write_slots[:size], size, [], decodes)
        return r.model.transformer(self.ids[None, :rows], paged=meta)[0]

    def _capture(self, size: int, keys: int) -> tuple:
        """A CUDA graph of `_step(size, keys)` and its static output, after warm-up runs on a
        side stream (torch.cuda.graphs' recipe: lazy initialisations and the allocator's
        first blocks happen outside the capture)."""
        self._pad_all()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(size, keys)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._step(size, keys)
        return graph, hidden
