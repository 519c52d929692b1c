"""Tensor-parallel inference (Megatron-LM's split, arXiv 1909.08053): the model is cut by the
training plan (`apply_tensor_parallel`: column-parallel query_key_value and dense_h_to_4h,
row-parallel dense and dense_4h_to_h, vocab-parallel embedding and LM head, ALiBi slopes cut to
each rank's heads), and every rank keeps the keys and values of its own heads.

Rank 0 runs the HTTP server and the scheduler. Each step it broadcasts the StepBatch (one int64
tensor, after a one-element header giving its length, or -1 for "stop") to the tp group; then
every rank runs the same forward, whose all-reduces sum the row-parallel partial products, and
the vocab-parallel logits are gathered on rank 0 alone, which samples (the other ranks never
hold the whole vocabulary). The other ranks only loop: receive a batch, run it.
"""
from __future__ import annotations

import torch

from bloomtrain.errors import UserError
from bloomtrain.parallel import comm
from bloomtrain.parallel.commands import Commands, follow
from bloomtrain.serve.batch import StepBatch
from bloomtrain.serve.runner import MIN_ROWS, ModelRunner, batch_invariant_rows

COMM_NAME = "serve"
STEP = 1  # a StepBatch to run (commands.STOP ends the loop)


def _config(tp: int, precision: str = "fp32"):
    from bloomtrain.config import Config
    return Config.from_dict({"parallel": {"tp": tp}, "train": {"precision": precision}})


def serving_layout(tp: int):
    """The ParallelLayout of a served model: tp ranks, no pipeline, no data parallelism."""
    from bloomtrain.layout import ParallelLayout
    return ParallelLayout.from_config(_config(tp).parallel, tp)


# A CPU's fp16 kernels round a row differently with the batch around it (the attention's
# padded keys): the same request gave other logits batched than alone.
FP16_ON_CPU = ("--dtype fp16 on a CPU is not batch invariant (its kernels round a request "
               "differently with others beside it): serve in bf16 or fp32 there (--dtype auto "
               "serves fp16 weights in fp32 on a CPU)")


def load_serving_model(checkpoint, topo=None, device="cpu", dtype=None, quantize=None):
    """A bloomtrain checkpoint or HF directory as an inference model, by the one loader
    (bloomtrain.checkpoint.load.load_sharded: each rank reads only its shards): split over
    `topo`'s tp group when it has one (built with `serving_layout`), then quantized when asked
    (after the split, with full-row scales; see bloomtrain.serve.quantize), then moved to
    `device`."""
    from bloomtrain.checkpoint.load import load_sharded
    from bloomtrain.serve.quantize import quantize_model

    from bloomtrain.devices import torch_dtype
    if dtype is not None and torch_dtype(dtype) == torch.float16 and \
            torch.device(device).type == "cpu":
        raise UserError(FP16_ON_CPU)
    split = topo is not None and topo.tp_size > 1
    # Split: each shard straight to the device as it is read (quantized: on the CPU first).
    model = load_sharded(checkpoint, topo if split else None, dtype,
                         device="cpu" if quantize else device).model
    if dtype is None and torch.device(device).type == "cpu" and \
            model.transformer.word_embeddings.weight.dtype == torch.float16:
        model.to(torch.float32)  # --dtype auto, fp16 weights: served in fp32 on a CPU
    if quantize:
        quantize_model(model, quantize)
    model.to(device)
    return model.eval()


def build_runner(checkpoint, config, topo=None, device="cpu", dtype=None,
                 quantize=None) -> ModelRunner:
    """The model of `checkpoint` (as load_serving_model) with an empty KV cache of
    `config.num_blocks` blocks for this rank's heads, ready to run StepBatches; its decode
    steps from CUDA graphs on CUDA at tp=1 unless `config.enforce_eager`
    (bloomtrain.serve.graphs)."""
    from bloomtrain.serve.graphs import use_decode_graphs
    from bloomtrain.serve.kv_cache import PagedKVCache
    from bloomtrain.serve.packed import pack_linears

    model = load_serving_model(checkpoint, topo, device, dtype, quantize)
    shape = model.shape
    tp = topo.tp_size if topo is not None else 1
    dtype = model.transformer.word_embeddings_layernorm.weight.dtype
    cache = PagedKVCache(shape.num_layers, config.num_blocks, config.block_size,
                         shape.num_heads // tp, shape.head_dim, dtype, device)
    group = topo.tp_group if topo is not None else None
    runner = ModelRunner(model, cache, group, min_rows=_min_rows(model, config, dtype, group))
    if tp == 1:  # small steps through MKL's packed GEMM where it keeps batch invariance
        runner.packed_bytes = pack_linears(model, runner.min_rows,
                                           max(config.max_batched_tokens, MIN_ROWS))
    use_decode_graphs(runner, config.max_num_seqs, config.max_model_len, config.enforce_eager)
    return runner


def _min_rows(model, config, dtype, group) -> int:
    """The rows a step's matmuls are padded to: measured on CPU (runner.batch_invariant_rows),
    the largest over the tp group, since every rank must pad its batch alike (the partial
    sums they reduce, the logits they gather). On CUDA batched and alone agree to rounding,
    not bitwise, whatever the padding (see runner's doc): MIN_ROWS there."""
    import warnings

    device = model.transformer.word_embeddings_layernorm.weight.device
    rows = MIN_ROWS
    if device.type == "cpu":
        found = batch_invariant_rows(model, max(config.max_batched_tokens, MIN_ROWS), dtype)
        if found is None:
            warnings.warn(f"this CPU's matrix multiplications round a row differently "
                          f"depending on how many rows are in the batch, even at "
                          f"{MIN_ROWS} rows and more: a request served beside others may "
                          f"differ from the same request alone in the last bits of its "
                          f"logits", RuntimeWarning, stacklevel=2)
        rows = found or MIN_ROWS
    if group is not None and comm.group_size(group) > 1:
        t = torch.tensor([rows], dtype=torch.int64, device=device)
        comm.all_reduce(t, group, COMM_NAME, op=comm.ReduceOp.MAX)
        rows = int(t.item())
    return rows


class TensorParallelExecutor:
    """The engine's `execute` on rank 0: send the batch to the other ranks, run it here."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.commands = Commands(runner.tp_group, COMM_NAME)
        self.closed = False

    def __call__(self, batch: StepBatch, sampling=None):
        self.commands.send(STEP, payload=batch.pack())
        return self.runner.forward(batch, sampling)

    def close(self) -> None:
        """Tell the other ranks to leave `worker_loop` (once)."""
        if not self.closed:
            self.closed = True
            self.commands.stop()


def worker_loop(runner: ModelRunner) -> int:
    """Ranks other than the scheduler's: run every batch rank 0 sends until it says stop.
    Returns the number of steps run."""
    return follow(Commands(runner.tp_group, COMM_NAME),
                  lambda op, sizes, payload: runner.forward(StepBatch.unpack(payload)))
