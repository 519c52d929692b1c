"""Pipeline execution (Narayanan et al., arXiv 2104.04473): `pipeline_train_step` /
`pipeline_eval_step` run a rank's op list with batched isend/irecv to the neighbouring stages,
freeing each sent activation (Megatron's `deallocate_output_tensor`), with a timeout and a
precise error on every wait.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from bloomtrain.layout import check_micro_batches
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, Op, op_p2p
from bloomtrain.parallel.pipeline.timeline import Timeline
from bloomtrain.parallel.pipeline.weightgrad import (DeferWeightGrads, WeightGradStore,
                                                     backward_input)

COMM_NAME = "pp"


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
                 timeout: float, timeline, peer_ops: dict[int, list[Op]]):
        self.topo, self.num_chunks, self.num_micro = topo, num_chunks, num_micro
        self.recv_shape, self.dtype, self.device = tuple(recv_shape), dtype, device
        self.timeout, self.timeline = timeout, timeline
        # (work, alias, what, peer pp rank, position of the peer's op that consumes it or None)
        self.pending_sends: list[tuple[object, torch.Tensor, str, int, int | None]] = []
        self.posted: dict[tuple[str, int, int], tuple[object, torch.Tensor, str]] = {}
        # The neighbours' op lists, as positions, and how far each neighbour is known to be: a
        # message from a peer's op k means the peer has run its ops up to k, so it has received
        # every message that its ops up to k consumed. Gloo reports a send completed only once
        # waited for; waiting for those sends then costs nothing and frees their buffers, which
        # would otherwise live to the end of the step.
        self.peer_pos = {peer: {(op.kind, op.chunk, op.micro_batch): i for i, op in enumerate(ops)}
                         for peer, ops in peer_ops.items()}
        self.peer_done = dict.fromkeys(peer_ops, -1)

    def global_rank(self, pp_rank: int) -> int:
        return self.topo.stage_rank(pp_rank)

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
        pp = self.topo.pp_size
        for op, tensor in sends:
            _, send = op_p2p(op, pp, self.topo.pp_rank, self.num_chunks)
            peer_pp, kind, stage = send
            peer = self.global_rank(peer_pp)
            what = (f"{self.where(op.chunk)}: send {kind} for micro-batch {op.micro_batch} "
                    f"to rank {peer}")
            alias = tensor.detach()
            p2p_ops.append(dist.P2POp(dist.isend, alias, peer,
                                      tag=self.tag(kind, stage, op.micro_batch)))
            consumer = ("F" if kind == "activation" else "B", stage // pp, op.micro_batch)
            records.append(("send", alias, what, peer_pp,
                            self.peer_pos.get(peer_pp, {}).get(consumer)))
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
        coalesced = len(works) != len(p2p_ops)
        if coalesced:  # NCCL coalesces a batch into one work
            works = [works[0]] * len(p2p_ops)
        for work, (key, tensor, what, *peer) in zip(works, records):
            if key == "send":
                # A coalesced work also holds the batch's receive: never waited for early.
                peer_pp, consumer = peer
                self.pending_sends.append((work, tensor, what, peer_pp,
                                           None if coalesced else consumer))
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
        self._release_received_sends(op)
        return buf

    def _release_received_sends(self, op: Op) -> None:
        """The message just received was sent by the peer after its op `producer`: every send
        of ours that the peer consumed at or before that op has arrived."""
        pp = self.topo.pp_size
        recv, _ = op_p2p(op, pp, self.topo.pp_rank, self.num_chunks)
        peer_pp, kind, stage = recv
        src = stage - 1 if kind == "activation" else stage + 1
        producer = ("F" if kind == "activation" else "B", src // pp, op.micro_batch)
        done = self.peer_pos.get(peer_pp, {}).get(producer)
        if done is None or done <= self.peer_done[peer_pp]:
            return
        self.peer_done[peer_pp] = done
        keep = []
        for send in self.pending_sends:
            work, _, what, to, consumer = send
            if to == peer_pp and consumer is not None and consumer <= done:
                _wait(work, self.timeout, what)
            else:
                keep.append(send)
        self.pending_sends = keep

    def finish(self) -> None:
        t0 = time.perf_counter()
        for work, _, what, *_ in self.pending_sends:
            _wait(work, self.timeout, what)
        self.pending_sends = []
        if self.timeline is not None:
            self.timeline.record("send_wait", t0, time.perf_counter())


def _check_step_args(schedule: str, chunks, micro_batches, topo) -> tuple[int, int]:
    num_chunks, num_micro = len(chunks), len(micro_batches)
    check_micro_batches(num_micro, topo.pp_size, schedule)
    if (schedule == "interleaved") != (num_chunks > 1):
        raise ValueError(f"{num_chunks} model chunks per rank with schedule {schedule!r}: the "
                         f"interleaved schedule runs several chunks, the others exactly one")
    return num_chunks, num_micro


class _Step:
    """One rank's ops of one step: each forward, backward and (zb-h1) W, with their messages."""

    def __init__(self, schedule: str, chunks, micro_batches, topo, *, train: bool, scale_loss,
                 p2p: _P2P, timeline):
        self.chunks, self.micro_batches, self.train = chunks, micro_batches, train
        self.scale_loss, self.p2p, self.timeline = scale_loss, p2p, timeline
        self.num_micro = len(micro_batches)
        # zb-h1: B leaves the weight gradients to W (bloomtrain.parallel.pipeline.weightgrad).
        # The last stage's LM head computes its weight gradient in B, and hands it over right
        # after it (WeightGradStore.running).
        self.store = None
        if train and schedule in SPLIT_BACKWARD:
            self.store = WeightGradStore([c.lm_head.weight for c in chunks if c.is_last])
        # (chunk, micro-batch) -> (received input or None, output or loss) until the backward.
        self.stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64,
                                    device=next(chunks[0].parameters()).device)

    def record(self, kind: str, t0: float, op: Op) -> None:
        if self.timeline is not None:
            self.timeline.record(kind, t0, time.perf_counter(), op.chunk, op.micro_batch)

    def run(self, op: Op) -> list:
        if op.kind == "F":
            return self.forward(op)
        if op.kind == "B":
            return self.backward(op)
        t0 = time.perf_counter()
        self.store.run((op.chunk, op.micro_batch))
        self.record("W", t0, op)
        return []

    def forward(self, op: Op) -> list:
        chunk, batch = self.chunks[op.chunk], self.micro_batches[op.micro_batch]
        inp = None
        if not chunk.is_first:
            inp = self.p2p.wait_recv(op)
            inp.requires_grad_(self.train)
        t0 = time.perf_counter()
        if chunk.is_last:
            out = chunk(batch["tokens"] if chunk.is_first else inp, batch["labels"],
                        batch.get("loss_mask"))
            self.loss_sum += out.detach().double()
        else:
            out = chunk(batch["tokens"] if chunk.is_first else inp)
        self.record("F", t0, op)
        if self.train:
            self.stash[(op.chunk, op.micro_batch)] = (inp, out)
        return [] if chunk.is_last else [(op, out)]

    def backward(self, op: Op) -> list:
        chunk = self.chunks[op.chunk]
        inp, out = self.stash.pop((op.chunk, op.micro_batch))
        grad = None if chunk.is_last else self.p2p.wait_recv(op)
        t0 = time.perf_counter()
        if chunk.is_last:
            # The step's gradient is the mean over micro-batches, as one process averaging the
            # micro-batch losses gets it.
            out = self.scale_loss(out / self.num_micro)
        # The first stage sends no input gradient, and under zb-h1 its W follows its B at once:
        # one backward does both, holding what 1F1B holds (W then finds nothing left to do).
        if self.store is None or chunk.is_first:
            _backward(out, grad)
            inp_grad = None if chunk.is_first else inp.grad
        else:
            params = [p for p in chunk.parameters() if p.requires_grad]
            inp_grad = backward_input(out, grad, inp, params, self.store,
                                      (op.chunk, op.micro_batch))
            self.store.hand_running()
        self.record("B", t0, op)
        return [] if chunk.is_first else [(op, inp_grad)]


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
    neighbours = {(topo.pp_rank - 1) % topo.pp_size, (topo.pp_rank + 1) % topo.pp_size}
    peer_ops = {peer: SCHEDULES[schedule](topo.pp_size, peer, num_micro, num_chunks)
                for peer in neighbours - {topo.pp_rank}}
    p2p = _P2P(topo, num_chunks, num_micro, recv_shape, dtype, device, timeout, timeline,
               peer_ops)
    step = _Step(schedule, chunks, micro_batches, topo, train=train, scale_loss=scale_loss,
                 p2p=p2p, timeline=timeline)
    # W ops have no messages: each op posts the receive of the next op that has one.
    talking = [op for op in ops if op.kind != "W"]
    grad_context = torch.enable_grad() if train else torch.no_grad()
    defer = DeferWeightGrads(step.store) if step.store is not None else contextlib.nullcontext()
    with grad_context, defer:
        p2p.post([], talking[0])
        k = 0
        for op in ops:
            sends = step.run(op)
            if op.kind != "W":
                k += 1
                p2p.post(sends, talking[k] if k < len(talking) else None)
        p2p.finish()
    mean_loss = _broadcast_loss(float(step.loss_sum) / num_micro, topo, device, timeout, p2p)
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
    ("gpipe", "1f1b", "interleaved" or "zb-h1") and leave the gradients in the parameters' .grad
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
