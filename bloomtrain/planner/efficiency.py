"""The rates the step-time model runs its work at, each with a mechanism and a parameter fitted to
BLOOM-176B's public runs (docs/planner_fit.md; `python bench/planner_fit.py` refits them from
docs/planner_data.csv and checks the figures below):

- GEMMs: `gemm` of the tensor-core peak once the GEMM is large, less wave quantization: a GEMM
  whose output fills W waves of tiles over the GPU's SMs (hardware.GPU.wave) idles, on average,
  half a wave in its last one, so it runs at W/(W + 1/2) of that (Anthony et al., arXiv
  2401.14489; NVIDIA's matmul performance guide). W falls with hidden/tp and micro-batch x seq.
- tp collectives: `nvlink` of the NVLink bandwidth (NCCL's ring does not reach the link's peak).
- pp sends and the dp reduction across nodes: `network` of the node network's bandwidth.
- memory-bound kernels (LayerNorm, GeLU, dropout, residual adds, the unfused softmax): their
  bytes at `hbm` of the device's memory bandwidth.
- the host: `op_s` seconds of host time per dispatched op. Where launches are synchronous
  (BLOOM ran with CUDA_LAUNCH_BLOCKING=1; a CPU runs each op in the dispatching thread) the device
  waits for it on every op; where they are asynchronous it is hidden unless the host is the
  slower of the two.

`band` is the spread of the fit: the standard deviation of log(measured / predicted) over the
fitted rows, scaled up by sqrt(n / (n - k)) for the k fitted parameters. Predictions carry
exp(±band) as their error band.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Ops dispatched per transformer block and micro-batch, counted on bloomtrain's model (aten ops
# under a dispatch mode; tests/planner/test_plan.py recounts them): forward, backward, and what full
# recompute adds to the backward (the block's forward again, and checkpoint's own ops). Hidden
# dropout adds the masks' ops. Outside the blocks: the embedding, LayerNorms, head and loss.
BLOCK_OPS = {"forward": 30, "backward": 66, "recompute": 63}
DROPOUT_OPS = {"forward": 8, "backward": 2, "recompute": 9}
OUTER_OPS = {"forward": 30, "backward": 24}


@dataclass(frozen=True)
class Efficiency:
    gemm: float           # fraction of the tensor-core peak a large GEMM sustains
    nvlink: float         # fraction of NVLink bandwidth a tp collective achieves
    network: float        # fraction of the node network a pp send or dp collective achieves
    hbm: float            # fraction of memory bandwidth a memory-bound kernel achieves
    op_s: float           # host seconds per dispatched op
    band: float = 0.0     # 1-sigma log error of a step-time prediction (module doc)
    source: str = ""      # what the figures were fitted to

    def with_gemm(self, gemm: float) -> "Efficiency":
        return replace(self, gemm=gemm)

    def gemm_seconds(self, m: int, n: int, k: int, peak_flops: float, wave: int,
                     batch: int = 1) -> float:
        """Seconds of a [m, k] x [k, n] GEMM (`batch` of them, one launch) on a device whose
        one wave of tiles covers `wave` output elements."""
        flops = 2.0 * m * n * k * batch
        waves = m * n * batch / wave
        return flops / (peak_flops * self.gemm * waves / (waves + 0.5))

    def memory_seconds(self, nbytes: float, bytes_per_s: float) -> float:
        return nbytes / (bytes_per_s * self.hbm)

    @property
    def band_factor(self) -> float:
        return math.exp(self.band)


# Fitted by bench/planner_fit.py to docs/planner_data.csv's fit rows (A100-80GB, Jean Zay, under
# BLOOM's CUDA_LAUNCH_BLOCKING=1); band: the leave-one-out spread (docs/planner_fit.md).
A100 = Efficiency(gemm=0.991, nvlink=0.298, network=0.504, hbm=0.405, op_s=27.7e-6, band=0.0377,
                  source="BLOOM-176B's runs on A100-80GB (docs/planner_fit.md)")
# A CPU rank: nominal figures for one core (hardware.GPUS["cpu"]), its GEMM fraction unknown
# until `bloomtrain plan --calibrate` fits it to a run; eager PyTorch's ~10 us per op. The band:
# calibrated on one layout, tests/planner/test_plan.py's eight other CPU layouts came out with a root
# mean square log error of 0.20 (docs/planner_fit.md).
CPU = Efficiency(gemm=0.5, nvlink=1.0, network=1.0, hbm=0.5, op_s=10e-6, band=0.25,
                 source="nominal (calibrate with --calibrate RUN_DIR)")
