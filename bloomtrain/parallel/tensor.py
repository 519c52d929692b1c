"""Tensor parallelism (Megatron-LM, Shoeybi et al., arXiv 1909.08053) and sequence parallelism
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198), applied to the single-device `BloomForCausalLM` by a plan.

Read top to bottom:
1. the communication ops as autograd functions: Megatron's `f` (identity forward, all-reduce
   backward) and `g` (all-reduce forward, identity backward), and the sequence-parallel pairs
   all-gather/reduce-scatter along the sequence;
2. the layers that hold one shard each: column-, row- and vocab-parallel, and the LM head tied to
   the vocab-parallel embedding;
3. the vocab-parallel cross-entropy, which never materializes the full logits;
4. the dropout RNG of tensor-parallel regions;
5. the plan, `apply_tensor_parallel`, which swaps the model's modules in place;
6. the mapping between full and sharded tensors (pure functions of names, for checkpoints).

Layout: hidden states are [b, s, h], batch first, so sequence parallelism splits dim 1.
Collectives work on dim 0, so the sequence dim is moved to the front around each of them.

Parameter attributes set here, the contract with the optimizer, ZeRO and checkpoints:
- `p.tp_split_dim`: the dim along which the full tensor is split over tp ranks (0 for column- and
  vocab-parallel weights and column biases, 1 for row-parallel weights), or None if every tp rank
  holds the full tensor.
- `p.tp_replicated`: `tp_split_dim is None`. Such parameters exist once per tp group, so the
  global grad norm counts them on one tp rank only.
- `p.grad_needs_tp_allreduce`: under sequence parallelism, every replicated parameter (the
  LayerNorms and the row-parallel biases) sees only this rank's part of the sequence, so its grad
  is a partial sum that must be all-reduced over tp (`allreduce_sequence_parallel_grads`) before
  anything else reads it (dp reduction, clipping, the step). False without sequence parallelism,
  where the replicated region computes identical grads on every tp rank.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from bloomtrain.model.bloom import BloomForCausalLM
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.comm import ReduceOp, group_rank, group_size
from bloomtrain.utils import UserError

SEQUENCE_DIM = 1  # hidden states are [b, s, h]
COMM_NAME = "tp"


# ---- 1. communication ops ----------------------------------------------------------------------

def _check_sequence_divisible(seq_len: int, world: int) -> None:
    if seq_len % world:
        raise UserError(f"the sequence length ({seq_len}) must be divisible by parallel.tp "
                        f"({world}) with parallel.sequence_parallel=true; change data.seq_length "
                        f"or turn sequence parallelism off")


def _all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    front = x.movedim(dim, 0).contiguous()  # [n_local, ...]
    out = front.new_empty((world * front.shape[0],) + tuple(front.shape[1:]))  # [n, ...]
    comm.all_gather_into_tensor(out, front, group, COMM_NAME)
    return out.movedim(0, dim)


def _reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    _check_sequence_divisible(x.shape[dim], world)
    front = x.movedim(dim, 0).contiguous()  # [n, ...]
    out = front.new_empty((front.shape[0] // world,) + tuple(front.shape[1:]))  # [n_local, ...]
    comm.reduce_scatter_tensor(out, front, group, COMM_NAME)
    return out.movedim(0, dim)


def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    _check_sequence_divisible(x.shape[dim], world)
    return x.chunk(world, dim)[group_rank(group)].contiguous()


def _all_reduced_copy(x: torch.Tensor, group) -> torch.Tensor:
    # A copy, not in place: the input may be referenced elsewhere in the graph (autograd can hand
    # the same gradient tensor to several consumers, e.g. both operands of an add).
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group, COMM_NAME)
    return out


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel layer is replicated; each rank's gradient
    w.r.t. it covers only its output columns, so the backward sums them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced_copy(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: a row-parallel layer yields partial sums; the forward adds them up, and the
    (replicated) gradient of the sum is the gradient of each part."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's replacement for f: all-gather the sequence shards in front of a
    column-parallel layer. Each rank's gradient w.r.t. the full sequence is partial (its output
    columns only), so the backward reduces it and keeps this rank's shard: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's replacement for g: sum the row-parallel partial outputs and keep
    this rank's sequence shard. The backward all-gathers the shard gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Enter a sequence-parallel region from a replicated tensor: keep this rank's shard."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """copy_to_tp_region: identity forward, all-reduce backward."""
    return x if group is None else _CopyToTensorParallelRegion.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """reduce_from_tp_region: all-reduce forward, identity backward."""
    return x if group is None else _ReduceFromTensorParallelRegion.apply(x, group)


copy_to_tp_region = f
reduce_from_tp_region = g


def gather_from_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """All-gather along `dim` forward, reduce-scatter backward."""
    return x if group is None else _GatherFromSequenceParallelRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """Reduce-scatter along `dim` forward, all-gather backward."""
    return x if group is None else _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """Split along `dim` forward, all-gather backward."""
    return x if group is None else _ScatterToSequenceParallelRegion.apply(x, group, dim)


# ---- 2. layers ---------------------------------------------------------------------------------

def _mark(p: nn.Parameter, split_dim: int | None, sequence_parallel: bool) -> None:
    p.tp_split_dim = split_dim
    p.tp_replicated = split_dim is None
    p.grad_needs_tp_allreduce = sequence_parallel and split_dim is None


def _shard(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    # A copy, so that the full tensor it was cut from can be freed.
    return t.detach().chunk(tp_size, dim)[tp_rank].clone()


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by output features: rank i computes Y_i = X A_i and the output stays
    split. `weight` is the [out/tp, in] row block of nn.Linear's weight, `bias` the [out/tp] block.
    The input is replicated (f) or, with sequence parallelism, gathered from sequence shards,
    unless `input_gathered`: then the caller has gathered it already, and the backward of that
    gather sums the partial input gradients."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group,
                 sequence_parallel: bool = False, input_gathered: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.input_gathered = input_gathered
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        for p in self.parameters():
            _mark(p, 0, sequence_parallel)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False,
                  input_gathered: bool = False) -> "ColumnParallelLinear":
        bias = None if linear.bias is None else _shard(linear.bias, 0, tp_rank, tp_size)
        return cls(_shard(linear.weight, 0, tp_rank, tp_size), bias, group, sequence_parallel,
                   input_gathered)

    def forward(self, x):  # [b, s(/tp with SP), in] -> [b, s, out/tp]
        if self.sequence_parallel:
            if not self.input_gathered:
                x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = f(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A with A split by input features: rank i holds X_i (the split output of a
    column-parallel layer) and A_i, computes the partial sum X_i A_i, and the partial sums are
    reduced (g) or, with sequence parallelism, reduce-scattered to sequence shards. The bias is
    replicated and added once, after the reduction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        _mark(self.weight, 1, sequence_parallel)
        if self.bias is not None:
            _mark(self.bias, None, sequence_parallel)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False) -> "RowParallelLinear":
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(_shard(linear.weight, 1, tp_rank, tp_size), bias, group, sequence_parallel)

    def forward(self, x):  # [b, s, in/tp] -> [b, s(/tp with SP), out]
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = g(partial, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank i holds rows [i*V/tp, (i+1)*V/tp) of the embedding. Token ids outside that range
    produce zero rows here, so the sum over ranks (g, or a reduce-scatter to sequence shards)
    is the full lookup."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = vocab_start
        self.weight = nn.Parameter(weight)
        _mark(self.weight, 0, sequence_parallel)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        weight = _shard(embedding.weight, 0, tp_rank, tp_size)
        return cls(weight, tp_rank * weight.shape[0], group, sequence_parallel)

    def forward(self, input_ids):  # [b, s] -> [b, s(/tp with SP), h]
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return g(out, self.group)


class VocabParallelLMHead(nn.Module):
    """The LM head as a column-parallel layer over the vocabulary, sharing the vocab-parallel
    embedding's local shard (tied, as in BLOOM: the same Parameter object, so the two
    contributions to its gradient accumulate in one .grad). The logits stay split [b, s, V/tp]
    for `vocab_parallel_cross_entropy`."""

    def __init__(self, embedding: VocabParallelEmbedding, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = embedding.weight

    def forward(self, hidden):  # [b, s(/tp with SP), h] -> [b, s, V/tp]
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.group)
        else:
            hidden = f(hidden, self.group)
        return F.linear(hidden, self.weight)


# ---- 3. vocab-parallel cross-entropy -----------------------------------------------------------

IGNORE_INDEX = -100  # F.cross_entropy's default, which bloomtrain.model.lm_loss inherits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, in fp32, with three all-reduces of
    [b, s] tensors instead of a gather of [b, s, V]: the max (for stability), the target logit
    (found on the rank that owns the label) and the sum of exponentials. The gradient,
    softmax - onehot, is local to each shard."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        ctx.input_dtype = logits.dtype
        logits = logits.float()  # [b, s, V/tp]
        logits_max = logits.max(dim=-1).values  # [b, s]
        comm.all_reduce(logits_max, group, COMM_NAME, op=ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: the input stays untouched

        local_labels = labels - vocab_start
        outside = (local_labels < 0) | (local_labels >= logits.shape[-1])
        local_labels = local_labels.masked_fill(outside, 0)
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)  # [b, s]
        target = target.masked_fill(outside, 0.0)
        comm.all_reduce(target, group, COMM_NAME)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)  # [b, s]
        comm.all_reduce(sum_exp, group, COMM_NAME)
        ignored = labels == IGNORE_INDEX
        losses = (sum_exp.log() - target).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside, ignored)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_labels, outside, ignored = ctx.saved_tensors
        # In place on the saved softmax, as Megatron does: it is the largest activation of the
        # model ([b, s, V/tp] fp32), and this graph is never backpropagated twice.
        grad = softmax
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -onehot)
        grad.mul_(grad_losses.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor,
                                 group) -> torch.Tensor:
    """Per-token fp32 losses [b, s] from logits split along the vocabulary [b, s, V/tp], as
    F.cross_entropy(full_logits, labels, reduction="none") would give."""
    vocab_start = group_rank(group) * logits_shard.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, vocab_start, group)


def vocab_parallel_lm_loss(logits_shard, labels, loss_mask, group) -> torch.Tensor:
    """`bloomtrain.model.lm_loss` over vocab-split logits: the mean over the loss mask."""
    losses = vocab_parallel_cross_entropy(logits_shard, labels, group)
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


class VocabParallelLMLoss:
    """The `loss_fn(logits, labels, loss_mask)` that the plan installs on BloomForCausalLM."""

    def __init__(self, group):
        self.group = group

    def __call__(self, logits, labels, loss_mask=None):
        return vocab_parallel_lm_loss(logits, labels, loss_mask, self.group)


# ---- 4. dropout RNG ----------------------------------------------------------------------------

_SEED_MIX = 0x9E3779B97F4A7C15  # odd, so distinct tp ranks always map to distinct seeds


class TensorParallelRNG:
    """The dropout RNG of tensor-parallel regions, after Megatron's
    `model_parallel_cuda_manual_seed` (per-rank seed = seed + 2718 + tp_rank).

    Replicated regions (hidden dropout without sequence parallelism) use the default generator,
    which is seeded identically on every tp rank and so drops the same elements everywhere, as
    the replicated activations require. Split regions (attention dropout on local heads; with
    sequence parallelism, everything inside a block, which then runs on sequence shards or local
    heads) must drop independently per rank, or every rank would repeat the same mask on its part
    of the tensor. `fork()` switches the default generator of `device` to a per-rank stream
    inside its `with` block and restores it afterwards.

    Unlike Megatron's tracker, the forked stream is not carried from fork to fork. Each fork
    draws one number from the default CPU generator (the same draw on every tp rank, so the
    default streams stay in step) and seeds the per-rank stream from (draw, seed, tp_rank).
    The forked masks are therefore a function of the default RNG state, which is what
    torch.utils.checkpoint saves and restores around a recomputation and what a checkpoint
    saves: activation recomputation replays the same attention-dropout masks (with a carried
    tracker state it would silently draw new ones and compute wrong gradients), and resuming
    needs only the default generators' states. The state dict is therefore just the seed.
    """

    def __init__(self, seed: int, tp_rank: int, device="cpu"):
        self.seed = int(seed)
        self.tp_rank = tp_rank
        self.device = torch.device(device)

    @property
    def rank_seed(self) -> int:
        return self.seed + 2718 + self.tp_rank

    @contextlib.contextmanager
    def fork(self):
        draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        stream_seed = (draw + self.rank_seed * _SEED_MIX) % 2 ** 63
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(stream_seed)
        else:
            saved = torch.get_rng_state()
            torch.default_generator.manual_seed(stream_seed)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)

    def state_dict(self) -> dict:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])


def _fork_rng_around_forward(module: nn.Module, fork) -> None:
    """Run module.forward inside fork() by hooks, so the module keeps its class and its HF
    parameter names. always_call closes the context even when forward raises."""
    open_contexts = []

    def enter(mod, args):
        ctx = fork()
        ctx.__enter__()
        open_contexts.append(ctx)

    def leave(mod, args, output):
        open_contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _gather_sequence_before_forward(attention: nn.Module, group) -> None:
    """BloomAttention takes the sequence length from its input, and attention needs the whole
    sequence, so under sequence parallelism the all-gather in front of query_key_value moves to
    the attention module's entrance (a pre-hook keeps the module and its names unchanged)."""

    def gather_input(mod, args):
        return (gather_from_sequence_parallel_region(args[0], group),) + tuple(args[1:])

    attention.register_forward_pre_hook(gather_input)


# ---- 5. the plan -------------------------------------------------------------------------------

def validate_tensor_parallel(shape: BloomShape, tp_size: int, sequence_parallel: bool = False,
                             seq_length: int | None = None) -> None:
    """Check that `shape` splits over `tp_size` ranks; raise a UserError that says what to change.
    Pure, so config validation can call it before any process group exists."""
    if tp_size < 1:
        raise UserError(f"parallel.tp must be at least 1, got {tp_size}")
    if shape.num_heads % tp_size:
        raise UserError(f"model.num_heads ({shape.num_heads}) must be divisible by "
                        f"parallel.tp ({tp_size})")
    if shape.ffn_hidden_size % tp_size:
        raise UserError(f"model.ffn_hidden_size ({shape.ffn_hidden_size}) must be divisible by "
                        f"parallel.tp ({tp_size})")
    if shape.vocab_size % tp_size:
        raise UserError(f"the padded vocabulary ({shape.vocab_size}) must be divisible by "
                        f"parallel.tp ({tp_size}); set model.make_vocab_size_divisible_by to a "
                        f"multiple of {tp_size}")
    if sequence_parallel and seq_length is not None and seq_length % tp_size:
        raise UserError(f"data.seq_length ({seq_length}) must be divisible by parallel.tp "
                        f"({tp_size}) with parallel.sequence_parallel=true")


def apply_tensor_parallel(model: BloomForCausalLM, topo, sequence_parallel: bool = False,
                          seed: int = 1234, seq_length: int | None = None) -> BloomForCausalLM:
    """Split `model` (full weights, identical on every tp rank) over `topo.tp_group` in place and
    return it. Column-parallel: query_key_value (its per-head layout makes a row block a set of
    whole heads) and dense_h_to_4h; row-parallel: self_attention.dense and dense_4h_to_h;
    vocab-parallel: the embedding and the tied LM head; the ALiBi slopes are cut to the local
    heads and the loss becomes the vocab-parallel cross-entropy. `model(ids)` then returns
    logits split along the vocabulary [b, s, V/tp].

    With sequence parallelism the activations between the tensor-parallel regions (embedding
    LayerNorm, block LayerNorms, residuals, hidden dropout, ln_f) live on sequence shards
    [b, s/tp, h]: the embedding and the row-parallel layers reduce-scatter instead of
    all-reducing, and the column-parallel layers and the LM head all-gather their input.

    `seed` seeds the tensor-parallel dropout streams (`model.tp_rng`). Apply the plan after
    moving the model to its device: the RNG forks that device's generator. With tp=1 no module
    is replaced; only the parameter attributes are set, so consumers need no special case.
    """
    tp_size, tp_rank, group = topo.tp_size, topo.tp_rank, topo.tp_group
    validate_tensor_parallel(model.shape, tp_size, sequence_parallel, seq_length)
    if tp_size > 1:
        sp = sequence_parallel
        transformer = model.transformer
        rng = TensorParallelRNG(seed, tp_rank, transformer.word_embeddings.weight.device)
        embedding = VocabParallelEmbedding.from_full(transformer.word_embeddings, tp_rank,
                                                     tp_size, group, sp)
        transformer.word_embeddings = embedding
        for block in transformer.h:
            attn, mlp = block.self_attention, block.mlp
            attn.query_key_value = ColumnParallelLinear.from_full(
                attn.query_key_value, tp_rank, tp_size, group, sp, input_gathered=sp)
            if sp:
                _gather_sequence_before_forward(attn, group)
            attn.dense = RowParallelLinear.from_full(attn.dense, tp_rank, tp_size, group, sp)
            mlp.dense_h_to_4h = ColumnParallelLinear.from_full(mlp.dense_h_to_4h, tp_rank,
                                                               tp_size, group, sp)
            mlp.dense_4h_to_h = RowParallelLinear.from_full(mlp.dense_4h_to_h, tp_rank, tp_size,
                                                            group, sp)
            if sp:
                # Every activation inside a block is split (sequence shards or local heads).
                _fork_rng_around_forward(block, rng.fork)
            else:
                attn.rng_context = rng.fork
        transformer.alibi_slopes = transformer.alibi_slopes.chunk(tp_size)[tp_rank].clone()
        transformer.sequence_parallel_size = tp_size if sp else 1
        model.lm_head = VocabParallelLMHead(embedding, group, sp)
        model.loss_fn = VocabParallelLMLoss(group)
        model.tp_rng = rng
    for name, p in model.named_parameters():
        _mark(p, tp_split_dim_of(name), sequence_parallel and tp_size > 1)
    return model


def sequence_parallel_grad_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters whose grads are partial sums over tp (`grad_needs_tp_allreduce`)."""
    return [(n, p) for n, p in model.named_parameters()
            if getattr(p, "grad_needs_tp_allreduce", False)]


@torch.no_grad()
def allreduce_sequence_parallel_grads(model_or_grads, group) -> None:
    """Sum the sequence-parallel partial grads over tp, in place, with one all-reduce.

    Pass the model (its flagged parameters' .grad are reduced) or an iterable of grad tensors,
    e.g. the slices of an optimizer's flat fp32 grad buffer that belong to the parameters of
    `sequence_parallel_grad_params`."""
    if isinstance(model_or_grads, nn.Module):
        grads = [p.grad for _, p in sequence_parallel_grad_params(model_or_grads)
                 if p.grad is not None]
    else:
        grads = list(model_or_grads)
    comm.all_reduce_coalesced(grads, group, COMM_NAME)


# ---- 6. full <-> sharded tensors ---------------------------------------------------------------

_COLUMN_PARALLEL = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_ROW_PARALLEL_WEIGHTS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
_VOCAB_PARALLEL = ("word_embeddings.weight", "lm_head.weight")


def tp_split_dim_of(name: str) -> int | None:
    """The dim along which the HF-named parameter `name` is split over tp, or None if
    replicated (LayerNorms, row-parallel biases). Names may carry a prefix."""
    if name.endswith(_COLUMN_PARALLEL) or name.endswith(_VOCAB_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL_WEIGHTS):
        return 1
    return None


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp_rank-th shard of the full tensor `name` (a copy; the full tensor itself if it is
    replicated)."""
    dim = tp_split_dim_of(name)
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise UserError(f"{name} has {full.shape[dim]} entries along dim {dim}, which do not "
                        f"split over parallel.tp ({tp_size})")
    return _shard(full, dim, tp_rank, tp_size)


def shard_full_state(full_state: dict[str, torch.Tensor], topo) -> dict[str, torch.Tensor]:
    """Inverse of gather_full_state: this rank's shards, ready for model.load_state_dict."""
    return {n: shard_tensor(n, t, topo.tp_rank, topo.tp_size) for n, t in full_state.items()}


@torch.no_grad()
def gather_full_tensors(tensors: dict[str, torch.Tensor], topo) -> dict[str, torch.Tensor]:
    """All-gather each tensor named like a parameter (a weight, its grad, an optimizer moment)
    to full shape along its tp split dim; replicated ones are copied. Collective over tp: every
    tp rank must pass the same names in the same order."""
    out = {}
    for name, t in tensors.items():
        dim = tp_split_dim_of(name)
        if dim is None or topo.tp_size == 1:
            out[name] = t.detach().clone()
        else:
            out[name] = _all_gather_along(t.detach(), dim, topo.tp_group).contiguous()
    return out


def gather_full_state(model: nn.Module, topo) -> dict[str, torch.Tensor]:
    """The full (tp=1) state dict of a tensor-parallel model, on every tp rank."""
    return gather_full_tensors(model.state_dict(), topo)
