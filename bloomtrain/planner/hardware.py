"""The machines a plan is for: per-device figures, the cluster's links, and the time of a collective
on them (the ring alpha-beta model NCCL's ring algorithm follows).

GPU figures are the vendors' dense bf16 tensor-core peaks, SM counts and HBM bandwidths, the
memory the device reports to torch (nvidia-smi's MiB), NVLink bandwidth one way per GPU, and a
typical DGX node's network (8 NICs). What fraction of each the work reaches is the fitted
efficiency (bloomtrain.planner.efficiency), the A100 fit for every GPU. `cpu` is one core of a
host per rank, its figures nominal until `--calibrate` fits its GEMM rate to a run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from bloomtrain.errors import UserError
from bloomtrain.planner.efficiency import A100, CPU, Efficiency

MIB = 2 ** 20
GIB = 2 ** 30
# Per-collective latency (the ring's alpha term per hop), NCCL's order of magnitude over NVLink and
# InfiniBand; gloo's over loopback for the cpu device.
INTRA_LATENCY_S = 10e-6
INTER_LATENCY_S = 30e-6
# Host side of ZeRO-Offload: PCIe 4 x16 one way, and the host memory bandwidth one GPU's share of
# a CPU Adam step streams at.
PCIE_GBS = 25.0
HOST_ADAM_GBS = 20.0
# CUDA context, cuBLAS workspaces and NCCL's buffers: outside torch's allocator, present on every
# GPU of a job (~0.5-1 GiB measured on A100/H100); a CPU process has none of them.
CUDA_CONTEXT_BYTES = GIB
# Host memory of one training process besides what the engine allocates (Python, torch and its
# libraries, gloo, the data's indices; on CUDA the driver's and the CUDA libraries' host side).
# cpu: 346 MiB resident after the first step of a tiny-model worker (torch 2.13 on the 2-core CI
# machine), rounded up. cuda: an estimate, not yet measured on a GPU host (bench/largest_fit.py
# reports a worker's resident memory before it builds: that figure).
PROCESS_HOST_BYTES = {"cpu": 384 * MIB, "cuda": 3 * GIB}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int        # what the device reports (torch.cuda.get_device_properties)
    peak_tflops: float       # dense bf16/fp16 tensor-core peak
    hbm_gbs: float           # device memory bandwidth, GB/s
    nvlink_gbps: float       # NVLink one way per GPU, Gbit/s
    node_network_gbps: float  # a node's network bandwidth, Gbit/s (all NICs)
    sms: int                 # streaming multiprocessors: the width of a GEMM's wave
    efficiency: Efficiency = A100
    latency_s: float = INTRA_LATENCY_S
    kind: str = "cuda"
    tile_elements: int = 256 * 128  # cuBLAS's largest bf16 tile on A100/H100
    host_bytes: int = 2048 * GIB  # a node's host memory (the DGX of the GPU; cpu: this host)

    @property
    def wave(self) -> int:
        """Output elements one wave of tiles covers: a tile per SM (per core on a CPU)."""
        return self.sms * self.tile_elements

    @property
    def context_bytes(self) -> int:
        return CUDA_CONTEXT_BYTES if self.kind == "cuda" else 0


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * GIB


GPUS: dict[str, GPU] = {
    "a100-40g": GPU("a100-40g", 40960 * MIB, 312.0, 1555.0, 2400.0, 1600.0, 108,
                    host_bytes=1024 * GIB),
    "a100-80g": GPU("a100-80g", 81920 * MIB, 312.0, 2039.0, 2400.0, 1600.0, 108),
    "h100": GPU("h100", 81559 * MIB, 989.0, 3350.0, 3600.0, 3200.0, 132),
    "h200": GPU("h200", 143771 * MIB, 989.0, 4800.0, 3600.0, 3200.0, 132),
    # One core per rank: ~90 GFLOP/s fp32 GEMMs (AVX2 FMA), ~20 GB/s of memory, gloo over
    # loopback; the GEMM's tile is the core's register block (6 x 16).
    "cpu": GPU("cpu", _host_memory(), 0.1, 20.0, 16.0, 16.0, 1, CPU, 100e-6, "cpu", 96,
               _host_memory()),
}


# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by what torch.cuda.get_device_name says, first
# match wins: what a run's MFU is measured against. The H100's PCIe and NVL boards run slower
# clocks than the SXM one the planner's "h100" is.
DEVICE_PEAKS = (("H100 PCIE", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0),
                ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0))


def device_peak_tflops(device) -> float | None:
    """The dense bf16 peak of a torch device, None where it is not a GPU listed above (a CPU
    has no such peak: no MFU is reported there)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch
    name = torch.cuda.get_device_name(device).upper().replace("-", " ")
    return next((peak for key, peak in DEVICE_PEAKS if key in name), None)


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    num_gpus: int
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None  # None: the GPU's NVLink figure
    inter_node_gbps: float | None = None  # None: the GPU's typical node network
    efficiency: float | None = None       # None: the fitted GEMM fraction of the GPU type
    host_memory_bytes: float | None = None  # per node; None: the GPU's (GPU.host_bytes)

    def __post_init__(self):
        if self.num_gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {self.num_gpus}")
        if self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise UserError(f"--gpus ({self.num_gpus}) is not a whole number of nodes of "
                            f"--gpus-per-node ({self.gpus_per_node}); use "
                            f"{self.num_gpus // self.gpus_per_node * self.gpus_per_node} or "
                            f"{-(-self.num_gpus // self.gpus_per_node) * self.gpus_per_node}")
        for what, v in (("--intra-node-gbps", self.intra_node_gbps),
                        ("--inter-node-gbps", self.inter_node_gbps),
                        ("--host-memory-gib", self.host_memory_bytes)):
            if v is not None and not 0 < v < float("inf"):  # NaN too: it compares false
                shown = v / GIB if what == "--host-memory-gib" else v  # as the user wrote it
                raise UserError(f"{what} must be a positive finite number, got {shown:g}")
        # a GPU's GEMMs reach at most its peak; the cpu device's peak is one core's, which a
        # rank with several threads exceeds
        top = 1.0 if self.gpu.kind == "cuda" else 64.0
        if self.efficiency is not None and not 0 < self.efficiency <= top:
            raise UserError(f"the compute efficiency must be in (0, {top:g}], got "
                            f"{self.efficiency}")

    @property
    def node_size(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def host_bytes(self) -> float:
        """A node's host memory."""
        return self.gpu.host_bytes if self.host_memory_bytes is None else self.host_memory_bytes

    @property
    def rates(self) -> Efficiency:
        """The fitted efficiency, with the GEMM fraction replaced where given."""
        eff = self.gpu.efficiency
        return eff if self.efficiency is None else eff.with_gemm(self.efficiency)

    @property
    def compute_efficiency(self) -> float:
        return self.rates.gemm

    @property
    def intra_bytes_per_s(self) -> float:
        return (self.intra_node_gbps or self.gpu.nvlink_gbps) * 1e9 / 8 * self.rates.nvlink

    @property
    def node_network_bytes_per_s(self) -> float:
        gbps = self.inter_node_gbps or self.gpu.node_network_gbps
        return gbps * 1e9 / 8 * self.rates.network

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_tflops * 1e12

    def with_efficiency(self, efficiency: float) -> "Cluster":
        return replace(self, efficiency=efficiency)

    # ---- links of a rank group --------------------------------------------------------------
    def group_link(self, size: int, stride: int) -> tuple[float, float]:
        """(bytes/s, latency) of a ring over `size` ranks `stride` apart in the rank order, when
        every GPU of a node is in such a ring at once (the groups of one kind all communicate
        together). Inside a node: NVLink. Across nodes: each ring enters and leaves every node
        it spans once, so the node's network is shared by the rings crossing it: a ring with
        k members per node gets node_bw · k / gpus_per_node."""
        if size <= 1:
            return float("inf"), 0.0
        node = self.node_size
        if size * stride <= node:  # the group's span fits in one (aligned) node
            return self.intra_bytes_per_s, self.gpu.latency_s
        per_node = max(1, node // stride) if stride < node else 1
        return self.node_network_bytes_per_s * per_node / node, INTER_LATENCY_S

    def p2p_link(self, stride: int, count: int = 2) -> tuple[float, float]:
        """Point to point along a chain of `count` ranks `stride` apart (a pipeline), every GPU
        sending at once. Within one node: NVLink. Across nodes the ranks at a node's edge share
        its network one way: all of the node's GPUs when a stage fills nodes (stride >= a node),
        else the `stride` ranks of the node's last stage."""
        node = self.node_size
        if stride * count <= node:
            return self.intra_bytes_per_s, self.gpu.latency_s
        return self.node_network_bytes_per_s / min(stride, node), INTER_LATENCY_S


def ring_time(kind: str, nbytes: float, size: int, link: tuple[float, float]) -> float:
    """Seconds for a ring collective over `size` ranks. `nbytes` is the full buffer (all-reduce),
    the output (all-gather) or the input (reduce-scatter), as comm counts it."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw, latency = link
    hops = size - 1
    factor = 2 * hops / size if kind == "all_reduce" else hops / size
    steps = 2 * hops if kind == "all_reduce" else hops
    return factor * nbytes / bw + steps * latency
