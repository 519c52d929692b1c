"""ZeRO data parallelism (Rajbhandari et al., arXiv 1910.02054) with BLOOM's BF16Optimizer
semantics, one module per concern; `engine.ZeroEngine` composes them (see its docstring for the
map)."""
from bloomtrain.parallel.zero.engine import ZeroEngine
from bloomtrain.parallel.zero.step import StepResult

__all__ = ["StepResult", "ZeroEngine"]
