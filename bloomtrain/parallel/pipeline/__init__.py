"""Pipeline parallelism (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, §2.2), with BLOOM's stage partitioning
(Megatron-DeepSpeed's `--pp-partition-method 'type:transformer|embedding'`, the config key
`parallel.pp_partition`).

One module per concern, in reading order:
1. `stage`: `build_pipeline_chunks` keeps this rank's share of a full (possibly tensor-parallel)
   model, with the tied embedding copied onto the last stage;
2. `schedules`: GPipe, 1F1B (PipeDream-flush), interleaved 1F1B and ZB-H1 (zero bubble) as plain
   functions that list a rank's forward/backward ops in named warmup / steady / cooldown phases;
   `schedule_grid` replays those lists under per-op costs, which is where the bubble of a schedule
   is counted;
   `weightgrad`: ZB-H1's split backward, B (input gradient) now and W (weight gradients) later;
3. `runtime`: `pipeline_train_step` / `pipeline_eval_step` run a rank's op list with batched
   isend/irecv to the neighbouring stages, freeing each sent activation (Megatron's
   `deallocate_output_tensor`), with a timeout and a precise error on every wait;
4. `timeline`: the timeline of a step (forward, backward, send, recv wait and idle per
   micro-batch).
Everything public is re-exported here, so `from bloomtrain.parallel.pipeline import X` works for
every X of those modules.

Virtual stages: with `num_virtual_stages` v > 1 the model is cut into pp·v pieces and model chunk c
on pipeline rank r is virtual stage c·pp + r, as in Megatron, so activations go round the ring of
ranks v times. The embedding is on virtual stage 0 (rank 0, chunk 0) and the LM head on the last
(rank pp-1, chunk v-1) whatever v is.

With pp > 1 the tied word embedding exists twice, the embedding on the first stage and the LM
head's copy on the last; their specs (bloomtrain.model.params) mark them `tied`, and the optimizer
sums their gradients over the embedding group so that both take the same steps.
"""
from bloomtrain.parallel.pipeline.schedules import (SCHEDULES, SPLIT_BACKWARD, Op, gpipe_schedule,
                                                    grid_bubble, interleaved_schedule,
                                                    one_f_one_b_schedule, op_costs, op_p2p,
                                                    peak_in_flight, schedule_grid,
                                                    theoretical_bubble, zb_h1_schedule)
from bloomtrain.parallel.pipeline.timeline import TIMELINE_DIR, Timeline, summarize
from bloomtrain.utils import lazy_exports

# runtime and stage import torch; partitions and schedules (config validation, the planner,
# pipeline-timeline's parser) must not wait for it.
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["COMM_NAME", "PipelineCommError", "pipeline_eval_step",
                     "pipeline_train_step"], "runtime"),
    **dict.fromkeys(["PipelineChunk", "StageTransformer", "build_pipeline_chunks"], "stage"),
    **dict.fromkeys(["DeferWeightGrads", "WeightGradStore", "backward_input"], "weightgrad")})

__all__ = [
    "COMM_NAME",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "TIMELINE_DIR",
    "Op",
    "PipelineChunk",
    "PipelineCommError",
    "StageTransformer",
    "Timeline",
    "DeferWeightGrads",
    "WeightGradStore",
    "backward_input",
    "build_pipeline_chunks",
    "gpipe_schedule",
    "grid_bubble",
    "interleaved_schedule",
    "one_f_one_b_schedule",
    "op_costs",
    "op_p2p",
    "peak_in_flight",
    "pipeline_eval_step",
    "pipeline_train_step",
    "schedule_grid",
    "summarize",
    "theoretical_bubble",
    "zb_h1_schedule",
]
