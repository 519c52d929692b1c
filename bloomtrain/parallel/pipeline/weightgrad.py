"""The split backward of zero-bubble pipeline parallelism (Qi et al., "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241 §2): B computes the gradient of a stage's input, which the previous
stage waits for; W computes the gradients of the stage's weights, which nobody needs until the
optimizer step, so the schedule (zb-h1) can run it later, in a bubble.

The model is not changed. While `DeferWeightGrads` is active (a TorchFunctionMode, so it reaches
every `F.linear`: nn.Linear, the tensor-parallel column and row layers and the LM head alike), a
linear layer runs as `_LinearDeferredWeightGrad`, whose backward inside a B returns the input's
gradient only and leaves (input, output gradient) in the store: a weight gradient is the matmul
dy^T·x, the half of a linear layer's backward that W runs. Outside a B (the first stage, which has
no input gradient to send, runs B and W as one backward) it is an ordinary linear. `backward_input`
(B) takes the gradients of the stage input and of the parameters outside linear layers (LayerNorm,
the embedding) without accumulating them; `WeightGradStore.run` (W) adds the deferred matmuls and
hands every parameter gradient of the micro-batch to autograd in one pass, so the parameters' hooks
(ZeRO's accumulation and reduce-scatter) see one complete backward per micro-batch, as under 1F1B.
The mode must also be active in B: activation checkpointing recomputes the forward there, and the
recomputation must record the same ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """What B leaves for W, per (chunk, micro-batch): the inputs and output gradients of the
    linear layers, and the other parameters' gradients."""

    def __init__(self):
        self.key: tuple[int, int] | None = None  # the micro-batch whose B is running
        self.linears: dict[tuple[int, int], list] = {}
        self.grads: dict[tuple[int, int], list] = {}

    def put_linear(self, weight, bias, x, dy) -> None:
        self.linears.setdefault(self.key, []).append((weight, bias, x, dy))

    def put_grads(self, key, params, grads) -> None:
        self.grads[key] = [(p, g) for p, g in zip(params, grads) if g is not None]

    @torch.no_grad()
    def run(self, key: tuple[int, int]) -> None:
        """W of one micro-batch: the deferred weight-gradient matmuls, then every parameter
        gradient of the micro-batch accumulated by autograd (hooks included)."""
        sums: dict[torch.Tensor, torch.Tensor] = {}

        def add(p, g):
            sums[p] = g if p not in sums else sums[p] + g

        for weight, bias, x, dy in self.linears.pop(key, []):
            dw, db = _weight_grads(x, dy, bias is not None)
            add(weight, dw)
            if bias is not None:
                add(bias, db)
        for p, g in self.grads.pop(key, []):
            add(p, g)
        if sums:
            Variable._execution_engine.run_backward(
                tensors=tuple(sums), grad_tensors=tuple(sums.values()), keep_graph=False,
                create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)

    def pending(self) -> int:
        return len(set(self.linears) | set(self.grads))


def _weight_grads(x, dy, with_bias: bool):
    """A linear layer's weight and bias gradients from its input and output gradient."""
    dy2 = dy.reshape(-1, dy.shape[-1])  # [b*s, out]
    return dy2.t().mm(x.reshape(-1, x.shape[-1])), dy2.sum(0) if with_bias else None  # [out, in]


class _LinearDeferredWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        # The parameters themselves (leaves), not saved copies: W accumulates into them.
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # dy: [..., out]
        (x,) = ctx.saved_tensors
        bias = ctx.bias if ctx.needs_input_grad[2] else None
        dx = dy.matmul(ctx.weight) if ctx.needs_input_grad[0] else None  # [..., in]
        if ctx.store.key is not None:  # inside a B: W comes later
            ctx.store.put_linear(ctx.weight, bias, x, dy)
            return dx, None, None, None
        # An ordinary backward (the first stage's, which does B and W at once).
        dw, db = _weight_grads(x, dy, bias is not None)
        return dx, dw, db, None


class DeferWeightGrads(TorchFunctionMode):
    """Linear layers with trainable weights, under autograd, defer their weight gradients to
    `store` (see the module docstring); everything else runs as it is."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.requires_grad:
                return _LinearDeferredWeightGrad.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   params: list[torch.Tensor], store: WeightGradStore,
                   key: tuple[int, int]) -> torch.Tensor | None:
    """B of one micro-batch: backpropagate `grad` (None: `out` is the loss) from `out`, whose
    storage may have been released (as in runtime._backward), to the stage input `inp` and to
    `params`, accumulating nothing. Returns the input's gradient; the parameter gradients and the
    linear layers' W work stay in `store` under `key`."""
    if grad is None:
        grad = torch.ones_like(out, memory_format=torch.preserve_format)
    inputs = ([inp] if inp is not None else []) + list(params)
    store.key = key
    try:
        grads = Variable._execution_engine.run_backward(
            tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
            inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=False)
    finally:
        store.key = None
    if inp is not None:
        store.put_grads(key, params, grads[1:])
        return grads[0]
    store.put_grads(key, params, grads)
    return None
