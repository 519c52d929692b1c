"""Pipeline parallelism (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, §2.2), with BLOOM's stage partitioning
(Megatron-DeepSpeed's `--pp-partition-method 'type:transformer|embedding'`, the config key
`parallel.pp_partition`; the partition rules and virtual stages are bloomtrain.layout's). In
reading order: `stage` (`build_pipeline_chunks`: this rank's chunks, the tied embedding copied
onto the last stage), `schedules` (GPipe, 1F1B, interleaved 1F1B and ZB-H1 as plain functions
listing a rank's ops in named warmup / steady / cooldown phases, and their replay under per-op
costs), `weightgrad` (ZB-H1's split backward), `runtime` (a rank's op list run with batched
isend/irecv, freeing each sent activation as Megatron's `deallocate_output_tensor`) and
`timeline` (a step's timeline). Everything public is re-exported here.
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
