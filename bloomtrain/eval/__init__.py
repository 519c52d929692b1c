"""Evaluation with EleutherAI's lm-evaluation-harness, in any parallel layout and during
training (Megatron-DeepSpeed's tasks/eval_harness/evaluate.py, rewritten on bloomtrain's own
layout machinery).

One module per concern, in reading order:
1. `model`: a rank's pieces of the model (its pipeline chunks and tensor-parallel shards), read
   from a checkpoint or HF directory shard by shard, or a training run's live parts;
2. `forward`: the forward passes every rank runs together: scoring (log-probabilities and
   greedy flags of chosen tokens, the LM head only where needed, reduced over the vocabulary
   shards) and generation steps over a KV cache;
3. `protocol`: rank 0 broadcasts each batch as a command, the other ranks loop on them;
4. `generation` and `lm`: the harness's model interface on rank 0 (`BloomtrainLM`: the
   loglikelihood, loglikelihood_rolling and generate_until requests);
5. `run`: the harness's task manager, simple_evaluate and its results;
6. `cli`: `bloomtrain eval`; `training`: the downstream evaluation a training run does every
   train.eval_harness_interval steps.

Only `lm`, `generation` and `run` import lm_eval (the optional `eval` extra); ranks other than
0 never do.
"""
