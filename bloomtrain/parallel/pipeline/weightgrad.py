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
the embedding) without accumulating them; `WeightGradStore.run` (W) runs the deferred matmuls and
hands every parameter gradient of the micro-batch to autograd in one backward pass, so the
parameters' hooks (ZeRO's accumulation and reduce-scatter) see one complete backward per
micro-batch, as under 1F1B. In that pass each matmul is a node, so W holds one weight gradient at
a time and frees each (input, output gradient) as it goes. What a micro-batch holds from its B to
its W is then the paper's M_W (16 values per token and hidden unit per layer), less than its
activations M_B: ZB-H1's bound on memory. The LM head is the exception: its output gradient is
vocabulary-wide, so the store (given it as `immediate`) has B compute its weight gradient and
hand it to autograd at once, in a pass of its own (each micro-batch's, accumulated in fp32). The mode must also be active in B: activation
checkpointing recomputes the forward there, and the recomputation must record the same ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """What B leaves for W, per (chunk, micro-batch): the inputs and output gradients of the
    linear layers, and the other parameters' gradients."""

    def __init__(self, immediate=()):
        self.key: tuple[int, int] | None = None  # the micro-batch whose B is running
        self.linears: dict[tuple[int, int], list] = {}
        self.grads: dict[tuple[int, int], list] = {}
        # Weights whose gradient B computes at once (the LM head, see `running`).
        self.immediate = {id(w) for w in immediate}
        # id(parameter) -> (parameter, its gradient that this B computed). The LM head's
        # (input, output gradient) is vocab-wide per token, too large to hold back for W; its
        # weight gradient is computed in B and handed to autograd right after it (hand_running),
        # one backward pass per micro-batch: its hooks add each micro-batch's 16-bit gradient
        # to the fp32 accumulator, as under 1F1B. (A sum kept until the next W added the first
        # pp micro-batches' gradients in 16 bits; up to pp x an fp16 overflow's chance.)
        self.running: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def put_linear(self, weight, bias, x, dy) -> None:
        # Detached: the store keeps the tensors, not the graph of the backward that made them.
        self.linears.setdefault(self.key, []).append((weight, bias, x.detach(), dy.detach()))

    def add_running(self, param, grad) -> None:
        if id(param) in self.running:
            self.running[id(param)][1].add_(grad)
        else:
            self.running[id(param)] = (param, grad)

    def put_grads(self, key, params, grads) -> None:
        self.grads[key] = [(p, g) for p, g in zip(params, grads) if g is not None]

    def run(self, key: tuple[int, int]) -> None:
        """W of one micro-batch: the deferred weight-gradient matmuls and every other parameter
        gradient of the micro-batch, accumulated by autograd (hooks included) in one backward
        pass. Each linear layer's matmul is a node of that pass (_WeightGrad), so autograd runs
        it, hands its gradient to the weight's accumulation (which it runs first: accumulation
        nodes have the highest priority) and frees its input and output gradient before the
        next: W holds one weight gradient at a time, not the stage's, and what B left shrinks
        as W goes. The other gradients enter through nodes too (_HandOff), which let go of them,
        so that autograd can take them as .grad instead of copying them."""
        linears = self.linears.pop(key, [])
        others = self.grads.pop(key, [])
        outs = []
        with torch.enable_grad():
            while others:
                outs.append(_HandOff.apply(*others.pop()))
            while linears:
                outs.append(_WeightGrad.apply(*linears.pop()))
        _run_backward(outs)

    def hand_running(self) -> None:
        """The gradients this B computed at once (the LM head's), to autograd in a pass of
        their own, hooks included."""
        others = list(self.running.values())
        self.running.clear()
        with torch.enable_grad():
            _run_backward([_HandOff.apply(*other) for other in others])

    def pending(self) -> int:
        return len(set(self.linears) | set(self.grads))


def _run_backward(outs: list) -> None:
    """One backward pass from the empty outputs of _WeightGrad/_HandOff nodes."""
    if outs:
        Variable._execution_engine.run_backward(
            tensors=tuple(outs), grad_tensors=tuple(out.new_empty(0) for out in outs),
            keep_graph=False, create_graph=False, inputs=(), allow_unreachable=True,
            accumulate_grad=True)


def _weight_grads(x, dy, with_bias: bool):
    """A linear layer's weight and bias gradients from its input and output gradient."""
    dy2 = dy.reshape(-1, dy.shape[-1])  # [b*s, out]
    return dy2.t().mm(x.reshape(-1, x.shape[-1])), dy2.sum(0) if with_bias else None  # [out, in]


class _WeightGrad(torch.autograd.Function):
    """A deferred weight-gradient matmul as an autograd node: its forward keeps (x, dy) and
    returns an empty tensor to start the pass from; its backward is the matmul, whose results
    autograd passes to the weight's and bias's accumulation. Autograd releases what the node
    saved once it has run."""

    @staticmethod
    def forward(ctx, weight, bias, x, dy):
        ctx.save_for_backward(x, dy)
        ctx.with_bias = bias is not None
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        x, dy = ctx.saved_tensors
        dw, db = _weight_grads(x, dy, ctx.with_bias)
        return dw, db, None, None


class _HandOff(torch.autograd.Function):
    """A parameter gradient computed earlier, as an autograd node that passes it on once and
    keeps no reference to it."""

    @staticmethod
    def forward(ctx, param, grad):
        ctx.grad = grad
        return param.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grad, ctx.grad = ctx.grad, None
        return grad, None


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
            if id(ctx.weight) in ctx.store.immediate:
                dw, db = _weight_grads(x, dy, bias is not None)
                ctx.store.add_running(ctx.weight, dw)
                if bias is not None:
                    ctx.store.add_running(bias, db)
            else:
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
