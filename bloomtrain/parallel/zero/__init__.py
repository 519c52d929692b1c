"""ZeRO data parallelism (Rajbhandari et al., arXiv 1910.02054) with BLOOM's BF16Optimizer
layout, one module per concern; `engine.ZeroEngine` composes them. The engine is imported on
first use, so that the pure layout functions (segments) load without torch: the planner sizes
buffers with them."""

__all__ = ["ZeroEngine"]


def __getattr__(name):
    if name == "ZeroEngine":
        from bloomtrain.parallel.zero.engine import ZeroEngine
        return ZeroEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
