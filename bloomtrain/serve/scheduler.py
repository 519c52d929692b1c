"""The scheduler of the serving engine: which tokens of which sequences the next step feeds.
Every step is scheduled afresh (continuous, iteration-level batching, Orca: Yu et al., OSDI
2022), with chunked prefill under a per-step token budget (Sarathi-Serve, Agrawal et al., arXiv
2403.02310), and vLLM's recompute preemption when the KV blocks run out. A sequence's
computation is a function of its own tokens: prompt chunks end at multiples of `prefill_chunk`,
and every later token, produced or replayed after a preemption, is fed alone, so that with the
runner's batch-invariant numerics its logits never depend on the batch, nor on a preemption.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from bloomtrain.serve.config import EngineConfig, blocks_for
from bloomtrain.serve.kv_cache import BlockPool
from bloomtrain.serve.batch import SeqStep, StepBatch


class Sequence:
    """A prompt and what has been generated for it; `params` is its SamplingParams, `sink`
    receives its SeqOutputs, `text` is its TextStream (or None without a tokenizer)."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params, sink, text=None,
                 device="cpu"):
        self.id = seq_id
        self.tokens = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.sink = sink
        self.text = text
        self.num_computed = 0          # tokens whose keys and values are in the cache
        self.blocks: list[int] = []
        # A seeded request draws from its own generator, on the logits' device, so that it
        # gives the same tokens alone and batched; the others share the device's.
        self.generator = None
        if params.do_sample and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.prompt_logprobs = [None] if params.prompt_logprobs else None
        self.prompt_logprobs_sent = False
        self.admitted = False
        self.requeued = False  # preempted and waiting to be admitted again (the engine's count)
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def next_chunk(self, chunk: int) -> int:
        """Tokens the next step feeds: up to the next multiple of `chunk` inside the prompt,
        one at a time after it."""
        p = self.num_computed
        if p < self.num_prompt:
            return min((p // chunk + 1) * chunk, self.num_prompt) - p
        return 1


@dataclass
class Entry:
    """One sequence's part of a scheduled step."""

    seq: Sequence
    start: int              # first position fed
    num: int                # tokens fed
    logit_row: int          # first of its rows in the step's logits
    num_logits: int
    sample: bool            # its last logit row picks the next token



class Scheduler:
    """The block pool, the waiting queue and the running batch. `on_admit(seq)` is called when
    a sequence is admitted (every time, preempted ones again), `on_preempt(seq)` when one is
    preempted. A step takes, in order:
    1. the running sequences, oldest first: a decoding sequence adds its one new token, a
       prefilling one its next prompt chunk if the step's token budget still has room. Decodes
       always fit (the budget is at least a chunk plus one token per running sequence), so a
       long prompt never stalls them, and the oldest prefill always progresses;
    2. waiting sequences, first come first served, while the budget, the running-batch limit
       and the free KV blocks allow (one free block per running sequence is kept back, so that
       an admission does not force the next decode step to preempt).
    Blocks are taken as a sequence grows."""

    def __init__(self, config: EngineConfig, on_admit=lambda seq: None,
                 on_preempt=lambda seq: None):
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_admit, self.on_preempt = on_admit, on_preempt

    # ---- the queues: nothing outside this class edits them ------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (first come, first served)."""
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Give a sequence's blocks back and take it out of the batch (it finished)."""
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, ids: set[int]) -> list[Sequence]:
        """Take the sequences `ids` out of the queue and the batch, their blocks back in the
        pool; returns them, waiting ones first."""
        out = [s for s in self.waiting if s.id in ids] + [s for s in self.running if s.id in ids]
        for seq in out:
            self._drop(seq)
        return out

    def clear(self) -> list[Sequence]:
        """Take every sequence out (the engine stops); returns them, waiting ones first."""
        out = list(self.waiting) + list(self.running)
        for seq in out:
            self._drop(seq)
        return out

    def _drop(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _preempt(self, seq: Sequence) -> None:
        """When the pool runs dry, the youngest running sequence: its blocks are freed and it
        goes back to the head of the queue with the tokens it has produced, to be recomputed."""
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.on_preempt(seq)

    def schedule(self) -> tuple[list[Entry], StepBatch | None]:
        """The next step: which sequences feed which tokens, and the batch to run (the order is
        the class's)."""
        cfg = self.config
        budget = cfg.max_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = seq.next_chunk(cfg.prefill_chunk)
            if n > budget:  # a prompt chunk waits for a step with room
                i += 1
                continue
            need = blocks_for(seq.num_computed + n, cfg.block_size) - len(seq.blocks)
            while need > self.pool.num_free and seq in self.running:
                self._preempt(self.running[-1])
                preempted = True
            if seq not in self.running:
                break
            seq.blocks += self.pool.allocate(need)
            chosen.append((seq, n))
            budget -= n
            i += 1
        while (self.waiting and not preempted and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            n = seq.next_chunk(cfg.prefill_chunk)
            need = blocks_for(n, cfg.block_size)
            # Keep a block per running sequence free, so that admitting does not make the next
            # decode step preempt at once.
            if n > budget or self.pool.num_free - need < len(self.running):
                break
            self.waiting.popleft()
            self.on_admit(seq)
            seq.blocks = self.pool.allocate(need)
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            return [], None
        entries, ids, steps, logit_rows = [], [], [], []
        for seq, n in chosen:
            p = seq.num_computed
            row = len(ids)
            ids += seq.tokens[p:p + n]
            steps.append(SeqStep(row, n, p + n, list(seq.blocks)))
            sample = p + n == len(seq.tokens) and seq.params.max_tokens > 0
            want_prompt = (seq.prompt_logprobs is not None
                           and len(seq.prompt_logprobs) < seq.num_prompt)
            first = len(logit_rows)
            if want_prompt:
                logit_rows += range(row, row + n)
            elif sample:
                logit_rows.append(row + n - 1)
            entries.append(Entry(seq, p, n, first, len(logit_rows) - first, sample))
            seq.num_computed = p + n
        return entries, StepBatch(ids, steps, logit_rows)
