"""The vocab-parallel cross-entropy (Megatron-LM, arXiv 1909.08053): the loss over logits split
along the vocabulary, without ever materializing the full logits.
"""
from __future__ import annotations

import torch

from bloomtrain.model.bloom import IGNORE_INDEX, mean_over_mask
from bloomtrain.parallel import comm
from bloomtrain.parallel.comm import ReduceOp, group_rank
from bloomtrain.parallel.tensor.regions import COMM_NAME



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
    return mean_over_mask(losses, labels, loss_mask)


class VocabParallelLMLoss:
    """The `loss_fn(logits, labels, loss_mask)` that the plan installs on BloomForCausalLM."""

    def __init__(self, group):
        self.group = group

    def __call__(self, logits, labels, loss_mask=None):
        return vocab_parallel_lm_loss(logits, labels, loss_mask, self.group)
