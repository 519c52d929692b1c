"""Host memory under ZeRO-Offload, per node: what `bloomtrain plan` shows for an offload layout
and what `bloomtrain train` checks before anything is allocated.

Each offloading rank of a node holds in host memory the fp32 masters and Adam moments of its own
range (12 bytes per owned parameter; bloomtrain.parallel.zero.memory.host_bytes), the staging
ring its copies go through (pinned; about one reduction bucket), and the process itself
(hardware.PROCESS_HOST_BYTES: Python, torch, the CUDA libraries' host side). On a CPU device the
device's model states (compute copy, gradients) are host memory too, and are counted. The ranks
of a node are consecutive (torchrun's and the grid's order, pp outermost), so a node of a
pipeline can hold stages of different sizes: the planner sums each node's own ranks and reports
the largest node.

Two limits: the host's memory, and for the page-locked part (the ring; the states too with
parallel.offload_pin_memory) the process's locked-memory limit, RLIMIT_MEMLOCK (`ulimit -l`),
where it holds: over it, a run is refused only if page-locking just past the limit fails (a
CUDA driver need not charge its own pinned allocations to it).
What the host has: `MemAvailable` from /proc/meminfo at the check (memory the kernel can give
without swapping; less where the process's memory cgroup, a SLURM job's or a container's, has
less left), or BLOOMTRAIN_HOST_MEMORY when set (bytes, or with a KiB/MiB/GiB/TiB
suffix): a test simulates a small host with it, and a job that shares its node can state its
share. `bloomtrain plan` takes the node's memory from --host-memory-gib, else the GPU's usual
node (hardware.GPU.host_bytes).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

from bloomtrain.errors import UserError
from bloomtrain.launch import slurm_tasks_on_node
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.zero.memory import pinned_bytes, pinned_size
from bloomtrain.planner import memory as mem
from bloomtrain.planner.hardware import PROCESS_HOST_BYTES

HOST_MEMORY_ENV = "BLOOMTRAIN_HOST_MEMORY"
GIB = 2 ** 30
MIB = 2 ** 20
_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": MIB, "gib": GIB, "tib": 2 ** 40}


@dataclass(frozen=True)
class NodeHost:
    """One node's host bytes under offload, by item, summed over its `ranks` offloading ranks;
    `pinned` is the largest page-locked share of one process (what RLIMIT_MEMLOCK limits)."""

    ranks: int
    items: dict = field(default_factory=dict)
    pinned: int = 0

    @property
    def total(self) -> float:
        return float(sum(self.items.values()))


@lru_cache(maxsize=65536)
def rank_host(shape: BloomShape, layout: ParallelLayout, pp_rank: int, precision: str,
              bucket_size_mb: float, pin_states: bool, device_kind: str,
              error_feedback: bool = False) -> tuple[dict, int]:
    """(host bytes by item, page-locked bytes) of one offloading rank of pipeline stage
    `pp_rank`, less its process. `error_feedback`: parallel.grad_error_feedback, whose residual
    (4 bytes per local parameter, at dp > 1) is on the device that reduces."""
    _, states = mem.rank_states(shape, layout, pp_rank, "bloomtrain", precision, True,
                                bucket_size_mb)
    host = states["host"]
    items = {"optimizer_states": host["fp32_master"] + host["adam_m"] + host["adam_v"],
             "staging_ring": host["staging_ring"]}
    if pin_states and device_kind == "cuda":  # pinned: rounded up to powers of two
        items["optimizer_states"] = 3 * pinned_size(host["fp32_master"])
    if device_kind == "cpu":
        items["device_model_states"] = sum(states["device"].values())
        if error_feedback and layout.dp > 1:
            items["device_model_states"] += 4 * states["flat_numel"]
    return items, pinned_bytes(states["own_numel"], states["chunk"], pin_states)


def node_host(shape: BloomShape, layout: ParallelLayout, ranks, precision: str,
              bucket_size_mb: float, pin_states: bool, device_kind: str,
              process_bytes: float | None = None, error_feedback: bool = False) -> NodeHost:
    """The host bytes of the node that runs global `ranks`, each with `process_bytes` of its
    own (default PROCESS_HOST_BYTES of the device kind)."""
    ranks = list(ranks)
    items: dict[str, float] = {}
    pinned = 0
    for r in ranks:
        mine, pin = rank_host(shape, layout, layout.coords(r).pp, precision, bucket_size_mb,
                              pin_states, device_kind, error_feedback)
        for k, v in mine.items():
            items[k] = items.get(k, 0) + v
        pinned = max(pinned, pin)
    per = PROCESS_HOST_BYTES[device_kind] if process_bytes is None else process_bytes
    items["process_overhead"] = per * len(ranks)
    return NodeHost(len(ranks), items, pinned)


@lru_cache(maxsize=4096)
def worst_node(shape: BloomShape, layout: ParallelLayout, node_size: int, precision: str,
               bucket_size_mb: float, pin_states: bool, device_kind: str,
               error_feedback: bool = False) -> NodeHost:
    """The node of `layout` (nodes of `node_size` consecutive ranks) that needs the most."""
    world = layout.world_size
    nodes = [node_host(shape, layout, range(n, min(n + node_size, world)), precision,
                       bucket_size_mb, pin_states, device_kind, error_feedback=error_feedback)
             for n in range(0, world, node_size)]
    return max(nodes, key=lambda n: n.total)


# ---- the host this process runs on -----------------------------------------------------------
def parse_bytes(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    unit = (m.group(2) or "").lower() if m else ""
    unit = unit if unit in ("", "b") else unit[0] + "ib"  # GB taken as GiB
    if not m or unit not in _UNITS:
        raise UserError(f"{what}={text!r} is not a size; give bytes, or a number with KiB, "
                        f"MiB, GiB or TiB")
    return int(float(m.group(1)) * _UNITS[unit])


def available_host_memory() -> tuple[int, str]:
    """(bytes this node can still give, where the figure comes from): the smaller of the
    kernel's MemAvailable and what this process's memory cgroup has left, when it is limited (a
    SLURM job's or a container's share of the node, which MemAvailable does not know)."""
    given = os.environ.get(HOST_MEMORY_ENV)
    if given:
        return parse_bytes(given, HOST_MEMORY_ENV), HOST_MEMORY_ENV
    avail, source = None, "free pages"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail, source = int(line.split()[1]) * 1024, "MemAvailable"
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    left = cgroup_memory_left()
    if left is not None and left < avail:
        return left, "the memory cgroup's limit"
    return avail, source


def cgroup_memory_left(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup"
                       ) -> int | None:
    """Bytes this process's memory cgroup may still charge (its limit less its usage), or None
    where it has no limit or none can be read. cgroup v2 (memory.max, memory.current) or v1
    (memory/.../memory.limit_in_bytes, memory.usage_in_bytes)."""
    try:
        with open(membership) as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None
    candidates = []
    for _, controllers, path in lines:
        path = path.lstrip("/")
        if controllers == "":  # v2's unified hierarchy
            candidates.append((os.path.join(root, path), "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((os.path.join(root, "memory", path), "memory.limit_in_bytes",
                               "memory.usage_in_bytes"))
    for where, limit_file, usage_file in candidates:
        try:
            with open(os.path.join(where, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(where, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        # v2 says "max" when unlimited; v1 a number near 2**63 rounded to a page.
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def memlock_limit() -> int | None:
    """This process's soft RLIMIT_MEMLOCK in bytes (None: unlimited)."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


# How far past RLIMIT_MEMLOCK pins_past_the_limit pins to see whether the limit holds.
MEMLOCK_PROBE_EXTRA = 2 * MIB


def pins_past_the_limit(nbytes: int) -> bool:
    """Whether this process can page-lock `nbytes` through torch's CUDA host allocator,
    tried once (and freed). RLIMIT_MEMLOCK governs mlock() and RDMA registrations; whether the
    CUDA driver's own cudaHostAlloc is held to it depends on the driver. So a ring over the limit
    is refused only where pinning past the limit really fails. False without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # torch.AcceleratorError is one
        return False
    del buf
    return True


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), 0 where /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def launch_device_kind(device: str) -> str:
    """The device kind of train.device before torch is imported (the launcher's check): `auto`
    counts as CUDA where the NVIDIA driver lists a GPU. A wrong guess only moves the launcher's
    estimate; each worker checks again with its real device."""
    if device != "auto":
        return "cuda" if device.startswith("cuda") else "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        gpus = os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        gpus = []
    return "cuda" if gpus and visible not in ("", "-1") else "cpu"


def node_ranks(world: int, env=os.environ) -> range:
    """The global ranks of this process's node: LOCAL_WORLD_SIZE consecutive ranks from
    RANK - LOCAL_RANK (torchrun's; under a plain srun SLURM's tasks per node, its block
    distribution); the whole job where nothing says (one process alone: itself)."""
    rank = int(env.get("RANK", 0))
    local = int(env.get("LOCAL_RANK", 0))
    slurm = slurm_tasks_on_node(env)
    size = int(env.get("LOCAL_WORLD_SIZE") or (slurm if slurm is not None else world))
    start = rank - local
    return range(start, min(start + size, world))


# ---- the check ---------------------------------------------------------------------------------
def check_host(cfg, shape: BloomShape, layout: ParallelLayout, device_kind: str, ranks,
               resident: int = 0) -> NodeHost | None:
    """Raise UserError, in one line, when the offloading ranks `ranks` of this node cannot get
    their host memory, or a process's page-locked part is over RLIMIT_MEMLOCK and pinning past
    that limit fails (on CUDA: the CPU pins nothing; pins_past_the_limit). `resident`: what each of them holds already (measured in this process, before
    it allocates anything); the process overhead counts only past it. None without offload.
    train.ignore_plan lets a run start anyway."""
    p = cfg.parallel
    if not p.offload_optimizer:
        return None
    node = node_host(shape, layout, ranks, cfg.train.precision, p.bucket_size_mb,
                     p.offload_pin_memory, device_kind, error_feedback=p.grad_error_feedback)
    overhead = node.items["process_overhead"]
    still = max(0.0, overhead - resident * node.ranks)
    needed = node.total - overhead + still
    avail, source = available_host_memory()
    problems = []
    if needed > avail:
        problems.append(host_message(node, needed, avail, source, layout, still, device_kind,
                                     p.offload_pin_memory))
    limit = memlock_limit()
    if (device_kind == "cuda" and limit is not None and node.pinned > limit
            and not pins_past_the_limit(min(node.pinned, limit + MEMLOCK_PROBE_EXTRA))):
        what = ("the staging ring and, with parallel.offload_pin_memory, the states"
                if p.offload_pin_memory else "the staging ring")
        problems.append(
            f"ZeRO-Offload pins {node.pinned / MIB:,.0f} MiB per process ({what}), over the "
            f"locked-memory limit of {limit / MIB:,.0f} MiB (ulimit -l); raise it (ulimit -l "
            f"unlimited; docker --ulimit memlock=-1), "
            + ("set parallel.offload_pin_memory=false, " if p.offload_pin_memory else "")
            + "or lower parallel.bucket_size_mb (the ring holds about one bucket)")
    if problems and not cfg.train.ignore_plan:
        raise UserError("; ".join(problems) + " (train.ignore_plan=true starts anyway)")
    return node


def host_message(node: NodeHost, needed: float, avail: float, source: str,
                 layout: ParallelLayout, overhead: float, device_kind: str = "cuda",
                 pin_states: bool = False) -> str:
    """The one line that says how much, how much there is, and what to change: only changes
    that make the node need less (no ZeRO-1 at dp 1, where it shards nothing; no fewer
    processes on a node of one)."""
    i = node.items
    parts = [f"optimizer states {size(i['optimizer_states'])}",
             f"staging ring {size(i['staging_ring'])}"]
    if "device_model_states" in i:
        parts.append(f"device model states on the CPU {size(i['device_model_states'])}")
    if overhead:
        parts.append(f"process overhead {size(overhead)}")
    fixes = []
    if pin_states and device_kind == "cuda":
        fixes.append("parallel.offload_pin_memory=false (pinned states are rounded up to "
                     "powers of two)")
    if layout.zero_stage == 0 and layout.dp > 1:
        fixes.append("parallel.zero_stage=1 (shards the states over dp)")
    fixes.append("more nodes (a larger dp gives each rank a smaller shard"
                 + (" at zero_stage >= 1)" if layout.zero_stage == 0 else ")"))
    if device_kind == "cuda":
        fixes.append("parallel.offload_optimizer=false (the states on the device)")
    elif node.ranks > 1:  # the device is this host: offload moves nothing off it
        fixes.append("fewer processes per node")
    return (f"ZeRO-Offload needs {size(needed, True)} of host memory on this node "
            f"({node.ranks} rank{'s' if node.ranks != 1 else ''}: {' + '.join(parts)}), "
            f"more than the {size(avail, True)} available ({source}); use "
            + ", or ".join(fixes))


def size(n: float, exact: bool = False) -> str:
    """Bytes as GiB (MiB under one GiB); `exact` adds the count: 1.50 GiB (1,610,612,736 B)."""
    unit, scale = ("GiB", GIB) if n >= GIB else ("MiB", MIB)
    return f"{n / scale:.2f} {unit}" + (f" ({int(n):,} bytes)" if exact else "")
