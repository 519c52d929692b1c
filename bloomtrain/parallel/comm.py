"""Every collective and point-to-point call of the package goes through the wrappers below, which
check each tensor's device against its group's backend, record the op each thread is blocked in
(the hang watchdog's input, bloomtrain/train/watchdog.py), and count calls and bytes per (kind,
group name) when asked (`stats_scope`, or BLOOMTRAIN_COMM_STATS=1):

    comm.STATS.snapshot()          # {("all_reduce", "tp"): {"calls": 8, "bytes": 65536}, ...}

Bytes are the size of the full buffer of the operation, the convention of nccl-tests: the tensor
for all-reduce and broadcast, the gathered output for all-gather, the unreduced input for
reduce-scatter and all-to-all, the message for send/recv. `group=None` is a group of one
(Topology's convention): a collective on it is a no-op and is not counted, where torch would read
None as the whole world. Point-to-point calls name their peer by global rank.
"""
from __future__ import annotations

import contextlib
import os
from threading import get_ident
from time import monotonic

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch >= 2.13 renamed the single-tensor collectives and deprecates the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    def __init__(self, enabled: bool | None = None):
        if enabled is None:
            enabled = os.environ.get("BLOOMTRAIN_COMM_STATS", "0") not in ("", "0")
        self.enabled = enabled
        self._counts: dict[tuple[str, str], dict[str, int]] = {}
        self.p2p_log: list | None = None

    def enable(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def reset(self) -> None:
        self._counts = {}

    def trace_p2p(self, enabled: bool = True) -> None:
        """Keep every point-to-point op, in posting order, as (kind, peer, tag, shape). NCCL
        ignores tags and matches a pair's messages by order alone, so the order is what a test
        must check (gloo, which matches tags, would hide a mismatch)."""
        self.p2p_log = [] if enabled else None

    # Host-side accounting, per call. Under torch.compile it must run, not be traced (a trace
    # would count once and guard on the counts): bloomtrain.parallel.compile wraps it in
    # torch.compiler.disable (untraced_record) when it compiles, not this class at import, since
    # that decorator imports torch._dynamo, 1.5 s of the start of every process.
    def record(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        entry = self._counts.setdefault((kind, name), {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += tensor.numel() * tensor.element_size()

    def snapshot(self) -> dict[tuple[str, str], dict[str, int]]:
        return {key: dict(v) for key, v in self._counts.items()}


# Module state (allow-listed in tests/structure.py). Accounting only: it never changes what is
# computed or sent, so it cannot make two runs differ, and it spares threading a counter through
# every autograd function, whose backward passes run where no argument reaches. Disabled, a call
# costs one bool test; a run enables it only inside stats_scope, which restores the setting.
STATS = CommStats()
# all_reduce_coalesced concatenates tensors below this many elements (16 MB of fp32) into one
# collective; larger ones gain nothing from it and would cost a copy of their size.
COALESCE_MAX_ELEMENTS = 1 << 22


def untraced_record() -> None:
    """Make `CommStats.record` run eagerly at every call under torch.compile (once per process;
    bloomtrain.parallel.compile calls it before it compiles anything)."""
    if not getattr(CommStats.record, "_bloomtrain_untraced", False):
        record = torch.compiler.disable(CommStats.record)
        record._bloomtrain_untraced = True
        CommStats.record = record


@contextlib.contextmanager
def stats_scope(enabled: bool):
    """Count communication inside the block when `enabled` (or BLOOMTRAIN_COMM_STATS is set),
    from zero; restore the previous setting and counts afterwards."""
    saved = (STATS.enabled, STATS.snapshot())
    STATS.enabled = enabled or saved[0]
    STATS.reset()
    try:
        yield STATS
    finally:
        STATS.enabled, STATS._counts = saved


class InFlight:
    """The op each thread is blocked in, for the hang watchdog: (op, group name, group, peer,
    start time), stored before the torch.distributed call and cleared after it; an async op
    while it is posted and while its `Work.wait()` runs. Written by the calling thread, read by
    the watchdog's; each write is one store of an immutable tuple, so a reader never sees half
    an entry. On NCCL a blocking call returns once enqueued, so a hang shows at a later host
    sync, and `last` (the op this process entered last) is what the report names."""

    def __init__(self):
        # thread ident -> (op, name, group, peer, monotonic start) while blocked, else None
        self.busy: dict[int, tuple | None] = {}
        # The op most recently begun, any thread: a new tuple per op, so a reader that keeps the
        # one it saw knows whether any op began since (the watchdog's sign of progress).
        self.last: tuple | None = None
        # Called as on_failure(entry, error) when an op raises a timeout/connection error.
        self.on_failure = None
        # Long phases running (long_phase), any thread; a list, so that += from two threads
        # cannot lose a count (each append or pop is one atomic operation).
        self._long: list[str] = []

    @contextlib.contextmanager
    def long_phase(self, what: str):
        """A phase that may rightly take longer than the hang timeout, a checkpoint's write or
        its hashing: the watchdog's step clock stops while one runs and starts again after it.
        Its own collectives (LONG_OPS) are bounded by their group's timeout instead."""
        self._long.append(what)
        try:
            yield
        finally:
            self._long.pop()

    @property
    def in_long_phase(self) -> bool:
        return bool(self._long)

    def snapshot(self) -> dict[int, tuple]:
        """The ops in flight now, by thread."""
        return {k: v for k, v in self.busy.copy().items() if v is not None}


# Ops of these names wait on other ranks' disk reads and writes (the checkpoint group: a
# shard's write, a checksum share of a resume), which take as long as the files do: the hang
# watchdog leaves them to the collective timeout.
LONG_OPS = ("checkpoint",)

# Module state (allow-listed in tests/structure.py): every wrapper writes it, autograd backward
# passes included, and the watchdog's thread reads it. Like STATS, it never changes what is sent.
INFLIGHT = InFlight()

# How a timed-out or broken collective reads (gloo: "Timed out waiting 3000ms ...", "Connection
# closed by peer"; NCCL: "... timeout", "aborted"); a shape or dtype mistake does not.
_FAILURE_WORDS = ("timed out", "timeout", "connection", "closed by peer", "reset by peer",
                  "broken pipe", "abort")


def is_comm_failure(error: BaseException) -> bool:
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    text = str(error).lower()
    return any(w in text for w in _FAILURE_WORDS)


def _call(kind: str, name: str, group, peer, async_op: bool, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) with (kind, name, group, peer) in flight for this thread while it
    runs; an async op's handle comes back as a Work, in flight again while it is waited for."""
    if torch.compiler.is_dynamo_compiling():
        # Traced into the graph as a functional collective (train.compile's tensor-parallel
        # regions): no host bookkeeping there; the watchdog's step heartbeat sees such a hang.
        return fn(*args, **kwargs)
    slot, key = INFLIGHT, get_ident()
    slot.busy[key] = slot.last = entry = (kind, name, group, peer, monotonic())
    try:
        out = fn(*args, **kwargs)
    except RuntimeError as e:
        hook = slot.on_failure
        if hook is not None and is_comm_failure(e):
            hook(entry, e)
        raise
    finally:
        slot.busy[key] = None
    return Work(out, kind, name, group, peer) if async_op and out is not None else out


class Work:
    """A torch.distributed work handle whose wait() is recorded in INFLIGHT; anything else
    (is_completed, get_future, ...) goes to the handle."""
    __slots__ = ("group", "kind", "name", "peer", "work")

    def __init__(self, work, kind: str, name: str, group, peer=None):
        self.work, self.kind, self.name, self.group, self.peer = work, kind, name, group, peer

    def wait(self, timeout=None):
        args = () if timeout is None else (timeout,)
        return _call(self.kind, self.name, self.group, self.peer, False, self.work.wait, *args)

    def __getattr__(self, attr):
        return getattr(self.work, attr)


class CommDeviceError(RuntimeError):
    """A collective was given a tensor on a device its group's backend does not serve."""


# NCCL serves only CUDA tensors and gloo (as we use it) only CPU tensors: a collective on a
# tensor its backend does not serve fails on a cluster, never on a laptop, so every wrapper
# checks first. Device types served, per backend name; one we do not know is trusted with both.
_BACKEND_DEVICES = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"}),
                    "mpi": frozenset({"cpu", "cuda"}), "ucc": frozenset({"cpu", "cuda"})}
# Module state (allow-listed in tests/structure.py): what each group serves, read from its
# backend string once (it never changes), so that a check is a dict lookup and a set test.
# `declare_devices` overrides it, which is how a CPU-only test stands in for an NCCL group.
_GROUP_DEVICES: dict = {}


def keeps_guard(entry) -> bool:
    """Dynamo's guard filter for train.compile (bloomtrain.parallel.compile): every guard but
    those on _GROUP_DEVICES. Tracing a collective reads it, so Dynamo would guard on its keys,
    and the first use of any later group (the checkpoint writer's, at the first save) would
    recompile every block; the groups a block uses are guarded by name themselves."""
    return not (entry.is_global and "._GROUP_DEVICES" in entry.name)


def backend_devices(backend: str) -> frozenset[str]:
    """`"nccl"` -> {"cuda"}; `"cpu:gloo,cuda:nccl"` -> {"cpu", "cuda"}."""
    backend = str(backend).lower()
    if ":" in backend:
        return frozenset(part.split(":")[0].strip() for part in backend.split(","))
    return _BACKEND_DEVICES.get(backend, frozenset({"cpu", "cuda"}))


def declare_devices(group, device_types) -> None:
    """Record the device types `group` serves (None: forget, read the backend again)."""
    key = dist.group.WORLD if group is None else group
    if device_types is None:
        _GROUP_DEVICES.pop(key, None)
    else:
        _GROUP_DEVICES[key] = frozenset(device_types)


def group_devices(group) -> frozenset[str]:
    key = dist.group.WORLD if group is None else group
    served = _GROUP_DEVICES.get(key)
    if served is None:
        served = _GROUP_DEVICES[key] = backend_devices(dist.get_backend(key))
    return served


def check_devices(op: str, name: str, group, *tensors: torch.Tensor) -> None:
    served = group_devices(group)
    for t in tensors:
        if t.device.type not in served:
            raise CommDeviceError(
                f"{op} on group '{name}' got a tensor on {t.device}, but the group's backend "
                f"serves only {'/'.join(sorted(served))} tensors: move the tensor to the "
                f"training device (NCCL has no CPU tensors), or run that collective on a "
                f"group whose backend serves {t.device.type}")


def world_group():
    """The group of every rank, or None (a group of one) without a multi-process job."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor, group, name: str, op=ReduceOp.SUM, async_op: bool = False):
    if group is None:
        return None
    check_devices("all_reduce", name, group, tensor)
    if STATS.enabled:
        STATS.record("all_reduce", name, tensor)
    return _call("all_reduce", name, group, None, async_op, dist.all_reduce, tensor, op=op,
                 group=group, async_op=async_op)


def all_gather_into_tensor(output, input_, group, name: str, async_op: bool = False):
    """Concatenate every rank's `input_` along dim 0 into `output`."""
    if group is None:
        output.copy_(input_)
        return None
    check_devices("all_gather", name, group, output, input_)
    if STATS.enabled:
        STATS.record("all_gather", name, output)
    return _call("all_gather", name, group, None, async_op, _all_gather_single, output, input_,
                 group=group, async_op=async_op)


def reduce_scatter_tensor(output, input_, group, name: str, op=ReduceOp.SUM,
                          async_op: bool = False):
    """Sum `input_` over ranks and keep this rank's dim-0 chunk in `output`."""
    if group is None:
        output.copy_(input_)
        return None
    check_devices("reduce_scatter", name, group, output, input_)
    if STATS.enabled:
        STATS.record("reduce_scatter", name, input_)
    return _call("reduce_scatter", name, group, None, async_op, _reduce_scatter_single, output,
                 input_, op=op, group=group, async_op=async_op)


def all_to_all_single(output, input_, group, name: str, async_op: bool = False):
    """Split `input_` along dim 0 into equal chunks, send chunk j to rank j; `output` holds the
    chunk every rank sent here, in rank order. Counted as the input's bytes (what leaves this
    rank, the own chunk included, as for reduce-scatter)."""
    if group is None:
        output.copy_(input_)
        return None
    check_devices("all_to_all", name, group, output, input_)
    if STATS.enabled:
        STATS.record("all_to_all", name, input_)
    return _call("all_to_all", name, group, None, async_op, dist.all_to_all_single, output,
                 input_, group=group, async_op=async_op)


def gather(tensor, dst: int, group, name: str) -> list[torch.Tensor] | None:
    """Every rank's `tensor` (all of one shape), as a list in group-rank order on global rank
    `dst`; None elsewhere. Only `dst` receives: what an all-gather would send to every rank."""
    if group is None:
        return [tensor]
    check_devices("gather", name, group, tensor)
    if STATS.enabled:
        STATS.record("gather", name, tensor)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] \
        if dist.get_rank() == dst else None
    _call("gather", name, group, None, False, dist.gather, tensor, out, dst=dst, group=group)
    return out


def broadcast(tensor, src: int, group, name: str, async_op: bool = False):
    """`src` is a global rank, as in torch.distributed."""
    if group is None:
        return None
    check_devices("broadcast", name, group, tensor)
    if STATS.enabled:
        STATS.record("broadcast", name, tensor)
    return _call("broadcast", name, group, None, async_op, dist.broadcast, tensor, src=src,
                 group=group, async_op=async_op)


def send(tensor, dst: int, name: str, group=None) -> None:
    check_devices("send", name, group, tensor)
    if STATS.enabled:
        STATS.record("send", name, tensor)
    _call("send", name, group, dst, False, dist.send, tensor, dst=dst, group=group)


def recv(tensor, src: int, name: str, group=None):
    check_devices("recv", name, group, tensor)
    if STATS.enabled:
        STATS.record("recv", name, tensor)
    return _call("recv", name, group, src, False, dist.recv, tensor, src=src, group=group)


def isend(tensor, dst: int, name: str, group=None):
    check_devices("send", name, group, tensor)
    if STATS.enabled:
        STATS.record("send", name, tensor)
    return _call("send", name, group, dst, True, dist.isend, tensor, dst=dst, group=group)


def irecv(tensor, src: int, name: str, group=None):
    check_devices("recv", name, group, tensor)
    if STATS.enabled:
        STATS.record("recv", name, tensor)
    return _call("recv", name, group, src, True, dist.irecv, tensor, src=src, group=group)


def batch_isend_irecv(ops: list, name: str) -> list:
    """`ops` are torch.distributed.P2POp; each is counted as a send or a recv."""
    for op in ops:
        check_devices("batch_isend_irecv", name, op.group, op.tensor)
    if STATS.p2p_log is not None:
        STATS.p2p_log += [("send" if op.op in (dist.isend, dist.send) else "recv", op.peer,
                           op.tag, tuple(op.tensor.shape)) for op in ops]
    if STATS.enabled:
        for op in ops:
            STATS.record("send" if op.op in (dist.isend, dist.send) else "recv", name, op.tensor)
    peers = tuple(sorted({op.peer for op in ops}))
    group = ops[0].group if ops else None
    # Posting is in flight too: NCCL creates a pair's communicator at its first p2p, collectively.
    works = _call("batch_isend_irecv", name, group, peers, False, dist.batch_isend_irecv, ops)
    if len(works) != len(ops):  # NCCL coalesces a batch into one work
        return [Work(w, "batch_isend_irecv", name, group, peers) for w in works]
    return [Work(w, "send" if op.op in (dist.isend, dist.send) else "recv", name, op.group,
                 op.peer) for w, op in zip(works, ops)]


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group, name: str) -> None:
    """Sum `tensors` over `group` in place: the small ones (LayerNorm and bias grads, where
    latency, not bandwidth, is what a call per tensor costs) with one collective over their
    concatenation, each of COALESCE_MAX_ELEMENTS or more (the tied embedding's gradient
    segments: 4.1 GB at bloom-7b1 under pp) on its own, contiguous ones in place, with no
    copy."""
    if group is None or not tensors:
        return
    small = []
    for t in tensors:
        if t.numel() >= COALESCE_MAX_ELEMENTS and t.is_contiguous():
            all_reduce(t, group, name)
        else:
            small.append(t)
    if len(small) <= 1:
        for t in small:
            all_reduce(t, group, name)
        return
    flat = torch.cat([t.reshape(-1) for t in small])
    all_reduce(flat, group, name)
    offset = 0
    for t in small:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# ---- control plane: barriers and small Python objects ----------------------------------------

def barrier(group, name: str) -> None:
    """Wait for every rank of `group` (None: a group of one, nothing to wait for). On a group
    that serves CUDA, name this rank's device: NCCL otherwise guesses it from the rank, which is
    wrong when ranks and devices are not numbered alike, and hangs."""
    if group is None:
        return
    if STATS.enabled:
        STATS.record("barrier", name, torch.empty(0))
    if "cuda" in group_devices(group) and torch.cuda.is_available():
        _call("barrier", name, group, None, False, dist.barrier, group=group,
              device_ids=[torch.cuda.current_device()])
    else:
        _call("barrier", name, group, None, False, dist.barrier, group=group)


def gather_object(obj, dst: int, group, name: str) -> list | None:
    """Every rank's picklable `obj`, as a list on global rank `dst` (None elsewhere). For small
    control messages (a checkpoint's file list), never for tensors."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    _call("gather_object", name, group, None, False, dist.gather_object, obj, out, dst=dst,
          group=group)
    return out


def all_gather_object(obj, group, name: str) -> list:
    """Every rank's picklable `obj` on every rank of `group`, in rank order. For small control
    messages (a rank's verdict on a checkpoint), never for tensors."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    _call("all_gather_object", name, group, None, False, dist.all_gather_object, out, obj,
          group=group)
    return out


def broadcast_object(obj, src: int, group, name: str):
    """Global rank `src`'s picklable `obj` on every rank of `group`."""
    if group is None:
        return obj
    box = [obj]
    _call("broadcast_object", name, group, None, False, dist.broadcast_object_list, box,
          src=src, group=group)
    return box[0]
