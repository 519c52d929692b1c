"""What the config alone decides of the attention kernel a run trains with, torch-free (the
launcher validates a config and the planner predicts a kernel before torch is imported):
`train.attention`'s rule on the config and the sequence length up to which `auto` takes the
eager kernel on a CPU. The choice itself, which needs the device, is
bloomtrain.model.attention.resolve_attention's."""
from __future__ import annotations

from bloomtrain.errors import UserError


def check_attention(requested: str, attention_dropout: float) -> None:
    """What the config alone decides of `train.attention` (auto, sdpa, flex or eager)."""
    if requested == "flex" and attention_dropout > 0:
        raise UserError(f"train.attention=flex has no attention dropout; set "
                        f"model.attention_dropout=0 (it is {attention_dropout}) or "
                        f"train.attention=sdpa")


# On CPU in bf16/fp16, auto takes the "eager" kernel (HF's baddbmm + fp32 softmax + bmm) up to
# this sequence length and SDPA above it: SDPA's fused CPU kernel is slow in reduced precision at
# short sequences (its backward above all). Measured fwd+bwd, bf16, one thread, the same ALiBi +
# causal bias, median of 60 interleaved reps (15 from 512), eager/sdpa time:
#   [b, heads, s, hd] = [2, 8, s, 32]:  s=64 0.33, 128 0.58, 256 0.91, 512 1.75, 1024 3.28
#                       [1, 16, s, 64]: s=128 0.34, 256 0.42, 512 1.19, 1024 2.07
# so the time crossover lies between 256 and 512 (torch 2.13 CPU). But eager stores the s² fp32
# softmax output and bf16 probabilities per layer: at s=256 in bench/vs_deepspeed.py (bf16,
# ZeRO-2, 4 layers, 2 x 256 tokens) it raised the peak by 72 MiB (345 vs 273 MiB) for a step
# 0.87x DeepSpeed's against SDPA's 0.93x; hence 128, where the time gain is large and the s²
# memory small. fp32 keeps SDPA (its numerics).
EAGER_MAX_SEQ = 128

# On CUDA, auto takes FlexAttention (ALiBi as a score_mod, the causal BlockMask) up to this head
# dimension and SDPA (its memory-efficient kernel, the ALiBi bias as a float mask) above it. The
# one GPU run so far (one H200, torch 2.11, bf16, seq 2048, whole training steps, issue 38's
# table), tokens/s flex against SDPA:
#   bloom-560m, head_dim 64, micro-batch 4:  eager 69,241 vs 64,869 (1.07x), compiled 72,656 vs
#                                            61,591 (1.18x)
#   bloom-1b7, head_dim 128, micro-batch 2:  eager 18,349 vs 21,833 (0.84x), compiled 19,679 vs
#                                            21,337 (0.92x)
# bloom-1b7, bloom-7b1 and BLOOM-176B all have head_dim 128. Between 64 and 128 (bloom-3b's 80)
# nothing is measured, so SDPA, the kernel that was never slower by much, keeps it.
FLEX_MAX_HEAD_DIM = 64


def flex_pays(head_dim: int) -> bool:
    """Whether auto prefers FlexAttention on CUDA at this head dimension (FLEX_MAX_HEAD_DIM)."""
    return head_dim <= FLEX_MAX_HEAD_DIM
