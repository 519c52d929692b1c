"""Evaluation with EleutherAI's lm-evaluation-harness, in any parallel layout and during
training (Megatron-DeepSpeed's tasks/eval_harness/evaluate.py, rewritten on bloomtrain's own
layout machinery). In reading order: `model` (a rank's pieces of the model, from a checkpoint,
an HF directory or a live run), `forward` (the passes every rank runs together), `protocol`
(rank 0 broadcasts each batch as a command), `generation` and `lm` (the harness's model
interface on rank 0), `run` (the harness's task manager), `cli` (`bloomtrain eval`) and
`training` (the downstream evaluation of a training run). Only `lm`, `generation` and `run`
import lm_eval (the optional `eval` extra); ranks other than 0 never do.
"""
