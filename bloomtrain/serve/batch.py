"""What the scheduler hands the model runner for one step (vLLM's SchedulerOutput): the new
tokens of every scheduled sequence packed into one row, each sequence's rows, context length and
KV blocks, and the rows whose next-token logits are wanted. The scheduler writes it, the runner
(and each tensor-parallel rank, through `pack`/`unpack`) reads it; neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqStep:
    """One sequence's part of a step: its rows [row, row + q_len) of the packed batch, and its
    context length after the step (positions already cached + q_len)."""

    row: int
    q_len: int
    ctx_len: int
    blocks: list[int]


@dataclass
class StepBatch:
    input_ids: list[int]
    seqs: list[SeqStep]
    logit_rows: list[int]  # rows whose next-token logits are wanted, in this order

    def pack(self) -> torch.Tensor:
        """The batch as one int64 tensor, for the broadcast to the other tensor-parallel ranks:
        [T, S, R, B, ids (T), (row, q_len, ctx_len, num_blocks) per sequence, blocks (B),
        logit rows (R)]."""
        blocks = [b for s in self.seqs for b in s.blocks]
        meta = [v for s in self.seqs for v in (s.row, s.q_len, s.ctx_len, len(s.blocks))]
        head = [len(self.input_ids), len(self.seqs), len(self.logit_rows), len(blocks)]
        return torch.tensor(head + self.input_ids + meta + blocks + self.logit_rows,
                            dtype=torch.int64)

    @classmethod
    def unpack(cls, t: torch.Tensor) -> "StepBatch":
        v = t.tolist()
        num_ids, num_seqs, num_rows, _ = v[:4]
        at = 4
        ids = v[at:at + num_ids]
        at += num_ids
        meta = v[at:at + 4 * num_seqs]
        at += 4 * num_seqs
        seqs = []
        for i in range(num_seqs):
            row, q_len, ctx_len, n = meta[4 * i:4 * i + 4]
            seqs.append(SeqStep(row, q_len, ctx_len, v[at:at + n]))
            at += n
        return cls(ids, seqs, v[at:at + num_rows])
