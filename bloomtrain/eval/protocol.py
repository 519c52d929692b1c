"""Rank 0 drives, the other ranks follow: rank 0 runs the harness and turns its requests into
commands, which it broadcasts to every rank of the job before running them itself; the other
ranks loop in `worker_loop`, receiving and running commands until told to stop. The channel is
bloomtrain.parallel.commands' (the one a tensor-parallel server's workers follow too), over the
world group.

Ops: SCORE (bloomtrain.eval.forward.score), PREFILL (start a generated batch: a fresh KV cache,
then its prompts), DECODE (finished rows leave the cache, the others' next tokens), STOP.
"""
from __future__ import annotations

import torch

from bloomtrain.eval import forward
from bloomtrain.eval.model import EvalModel
from bloomtrain.parallel import comm
from bloomtrain.parallel.commands import Commands, follow

SCORE, PREFILL, DECODE = 1, 2, 3  # and commands.STOP


def _score_batch(payload: torch.Tensor, rows: int, seq: int, queries: int) -> forward.ScoreBatch:
    lengths, rest = payload[:rows], payload[rows:]
    inputs, q = rest[:rows * seq].view(rows, seq), rest[rows * seq:].view(3, queries)
    return forward.ScoreBatch(inputs, lengths, q[0], q[1], q[2])


class Executor:
    """Rank 0's side: each method broadcasts its command, then runs it here too. With one
    process the broadcasts are no-ops. `micro_rows`: rows per pipeline micro-batch (None:
    forward's rule). `busy` is true from a command's broadcast until it has run: an error
    raised meanwhile left the ranks out of step, which no caller can repair."""

    def __init__(self, model: EvalModel, micro_rows: int | None = None):
        self.model, self.micro_rows = model, micro_rows
        self.commands = Commands(comm.world_group(), forward.COMM_NAME)
        self.cache: forward.EvalCache | None = None
        self.rows: torch.Tensor | None = None  # the generated batch so far, without a cache
        self.closed = False
        self.busy = False

    def _run(self, op: int, sizes: tuple[int, int, int], payload: torch.Tensor, work):
        self.busy = True
        self.commands.send(op, sizes, payload)
        out = work()
        self.busy = False
        return out

    def score(self, rows: list[list[int]], queries: list[tuple[int, int, int]]) -> torch.Tensor:
        """[2, Q]: the log-probability of each query's target at (row, position), and
        whether it is the greedy token there."""
        seq = max(len(r) for r in rows)
        inputs = torch.zeros((len(rows), seq), dtype=torch.int64)
        for i, r in enumerate(rows):
            inputs[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        q = torch.tensor(queries, dtype=torch.int64).reshape(-1, 3).t()
        payload = torch.cat([lengths, inputs.reshape(-1), q.reshape(-1)])
        batch = _score_batch(payload, len(rows), seq, len(queries))
        return self._run(SCORE, (len(rows), seq, len(queries)), payload,
                         lambda: forward.score(self.model, batch, self.micro_rows))

    def prefill(self, rows: list[list[int]], max_len: int) -> torch.Tensor:
        """Start generating from `rows` (prompts of one length, to grow to `max_len` tokens at
        most): the logits [b, V] after each."""
        ids = torch.tensor(rows, dtype=torch.int64)
        if not forward.uses_cache(self.model):
            self.rows = ids
            return self._whole(ids)
        b, s = ids.shape

        def start():
            self.cache = forward.EvalCache(self.model, b, max_len)
            return forward.next_logits(self.model, ids, s - 1, self.cache)

        return self._run(PREFILL, (b, s, max_len), ids.view(-1), start)

    def decode(self, tokens: list[int], keep: list[int]) -> torch.Tensor:
        """Continue rows `keep` of the batch (the others have finished) by `tokens`, one each:
        the logits [len(keep), V] after them."""
        new = torch.tensor(tokens, dtype=torch.int64)
        rows = torch.tensor(keep, dtype=torch.int64)
        if not forward.uses_cache(self.model):
            self.rows = torch.cat([self.rows.index_select(0, rows), new[:, None]], dim=1)
            return self._whole(self.rows)

        def step():
            self.cache.keep(rows)
            return forward.next_logits(self.model, new[:, None], 0, self.cache)

        return self._run(DECODE, (len(tokens), 0, 0), torch.cat([new, rows]), step)

    def _whole(self, ids: torch.Tensor) -> torch.Tensor:
        """Without a cache: the whole sequences, right-padded to the model's multiple."""
        seq = forward.padded_length(self.model, ids.shape[1])
        padded = torch.zeros((ids.shape[0], seq), dtype=torch.int64)
        padded[:, :ids.shape[1]] = ids
        return self._run(PREFILL, (ids.shape[0], seq, ids.shape[1] - 1), padded.view(-1),
                         lambda: forward.next_logits(self.model, padded, ids.shape[1] - 1, None))

    def close(self) -> None:
        """Tell the other ranks to leave `worker_loop` (once; not while they run a command
        with this rank, whose error is then the job's)."""
        if not self.closed and not self.busy:
            self.closed = True
            self.commands.stop()


def worker_loop(model: EvalModel, micro_rows: int | None = None) -> int:
    """Every rank but 0: run the commands rank 0 broadcasts until STOP. Returns how many ran."""
    cache = None

    def run(op: int, sizes, payload: torch.Tensor) -> None:
        nonlocal cache
        a, b, c = sizes
        if op == SCORE:
            forward.score(model, _score_batch(payload, a, b, c), micro_rows)
        elif op == PREFILL:
            # With the cache: (rows, prompt length, tokens a row may reach); without:
            # (rows, padded length, the position whose logits are wanted).
            if forward.uses_cache(model):
                cache = forward.EvalCache(model, a, c)
                forward.next_logits(model, payload.view(a, b), b - 1, cache)
            else:
                forward.next_logits(model, payload.view(a, b), c, None)
        elif op == DECODE:
            cache.keep(payload[a:])
            forward.next_logits(model, payload[:a, None], 0, cache)
        else:
            raise RuntimeError(f"unknown evaluation command {op} from rank 0")

    return follow(Commands(comm.world_group(), forward.COMM_NAME), run)
