"""The machines a plan is for: per-GPU figures, the cluster's links, and the time of a collective
on them (the ring alpha-beta model NCCL's ring algorithm follows).

Figures are the vendors' dense bf16 tensor-core peaks and HBM bandwidths, the memory the device
reports to torch (nvidia-smi's MiB), NVLink bandwidth one way per GPU, and a typical DGX node's
network (8 NICs). `efficiency` is the one calibrated number: the fraction of peak the model's
matmul-bound compute sustains, before any communication or pipeline bubble. Its defaults are
assumptions stated here, not measurements of ours:
- A100: 0.60. Korthikanti et al. (arXiv 2205.05198, Table 5) report 56-57% hardware FLOPs
  utilization end to end for 175B-1T GPT models on A100 with Megatron-LM, bubble and
  communication included, so the compute itself runs a little above that.
- H100/H200: 0.50. Megatron-Core's published GPT-3 175B figure on H100 is 47% MFU end to end
  (about 390 of 989 TFLOP/s).
`bloomtrain plan --calibrate RUN_DIR` replaces it with the value that reproduces a real run.

The default holds at GEMMs of `REFERENCE_TOKENS` rows (b·s = 2048, the micro-batch 1 of those
runs). Fewer rows leave part of the GPU's tiles and waves idle (wave quantization; Anthony et
al., arXiv 2401.14489), more fill them: the rate scales as n/(n + HALF_RATE_TOKENS). That constant
is our assumption, chosen to reproduce the size of the effect BLOOM-176B's operators saw when a
micro-batch of 2 outran a micro-batch of 1 despite twice the pipeline bubble (bloom_facts.md §1,
the 2022-03-14 switch): 4096 rows run 6% faster than 2048, 1024 rows 11% slower.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from bloomtrain.errors import UserError

MIB = 2 ** 20
GIB = 2 ** 30
# Per-collective latency (the ring's alpha term per hop), NCCL's order of magnitude over NVLink and
# InfiniBand; it matters only for the many small collectives of small models.
INTRA_LATENCY_S = 10e-6
INTER_LATENCY_S = 30e-6
# Host side of ZeRO-Offload: PCIe 4 x16 one way, and the host memory bandwidth one GPU's share of
# a CPU Adam step streams at.
PCIE_GBS = 25.0
HOST_ADAM_GBS = 20.0
REFERENCE_TOKENS = 2048
HALF_RATE_TOKENS = 256


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int        # what the device reports (torch.cuda.get_device_properties)
    peak_tflops: float       # dense bf16/fp16 tensor-core peak
    hbm_gbs: float           # device memory bandwidth, GB/s
    nvlink_gbps: float       # NVLink one way per GPU, Gbit/s
    node_network_gbps: float  # a node's network bandwidth, Gbit/s (all NICs)
    efficiency: float        # default fraction of peak the compute sustains (see module doc)


GPUS: dict[str, GPU] = {
    "a100-40g": GPU("a100-40g", 40960 * MIB, 312.0, 1555.0, 2400.0, 1600.0, 0.60),
    "a100-80g": GPU("a100-80g", 81920 * MIB, 312.0, 2039.0, 2400.0, 1600.0, 0.60),
    "h100": GPU("h100", 81559 * MIB, 989.0, 3350.0, 3600.0, 3200.0, 0.50),
    "h200": GPU("h200", 143771 * MIB, 989.0, 4800.0, 3600.0, 3200.0, 0.50),
}


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
    efficiency: float | None = None       # None: the GPU's default

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
                        ("--inter-node-gbps", self.inter_node_gbps)):
            if v is not None and v <= 0:
                raise UserError(f"{what} must be positive, got {v}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise UserError(f"the compute efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def node_size(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def compute_efficiency(self) -> float:
        return self.efficiency if self.efficiency is not None else self.gpu.efficiency

    @property
    def intra_bytes_per_s(self) -> float:
        return (self.intra_node_gbps or self.gpu.nvlink_gbps) * 1e9 / 8

    @property
    def node_network_bytes_per_s(self) -> float:
        return (self.inter_node_gbps or self.gpu.node_network_gbps) * 1e9 / 8

    def with_efficiency(self, efficiency: float) -> "Cluster":
        return replace(self, efficiency=efficiency)

    def flops_per_s(self, tokens: int) -> float:
        """The compute rate of GEMMs over `tokens` rows (see the module doc)."""
        def shape(n):
            return n / (n + HALF_RATE_TOKENS)
        scale = shape(tokens) / shape(REFERENCE_TOKENS)
        return self.gpu.peak_tflops * 1e12 * min(1.0, self.compute_efficiency * scale)

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
            return self.intra_bytes_per_s, INTRA_LATENCY_S
        per_node = max(1, node // stride) if stride < node else 1
        return self.node_network_bytes_per_s * per_node / node, INTER_LATENCY_S

    def p2p_link(self, stride: int) -> tuple[float, float]:
        """Point to point between ranks `stride` apart, every GPU sending at once."""
        if stride < self.node_size:
            return self.intra_bytes_per_s, INTRA_LATENCY_S
        return self.node_network_bytes_per_s / self.node_size, INTER_LATENCY_S


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
