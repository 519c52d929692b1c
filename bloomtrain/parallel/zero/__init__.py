"""ZeRO data parallelism (Rajbhandari et al., arXiv 1910.02054) with BLOOM's BF16Optimizer
layout, one module per concern; `engine.ZeroEngine` composes them."""
from bloomtrain.parallel.zero.engine import ZeroEngine

__all__ = ["ZeroEngine"]
