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

from bloomtrain.parallel import comm
from bloomtrain.devices import dtype_name, torch_dtype
from bloomtrain.serve.batch import StepBatch
from bloomtrain.serve.runner import MIN_ROWS, ModelRunner, batch_invariant_rows

COMM_NAME = "serve"
_STOP = -1


def _config(tp: int, precision: str = "fp32"):
    from bloomtrain.config import Config
    return Config.from_dict({"parallel": {"tp": tp}, "train": {"precision": precision}})


def serving_layout(tp: int):
    """The ParallelLayout of a served model: tp ranks, no pipeline, no data parallelism."""
    from bloomtrain.layout import ParallelLayout
    return ParallelLayout.from_config(_config(tp).parallel, tp)


def load_serving_model(checkpoint, topo=None, device="cpu", dtype=None, quantize=None):
    """A bloomtrain checkpoint or HF directory as an inference model: split over `topo`'s tp
    group when it has one (built with `serving_layout`), by the training path
    (`parallelize`: the tensor-parallel plan, one pipeline chunk, no ZeRO engine), then
    quantized when asked (after the split, with full-row scales; see
    bloomtrain.serve.quantize), then moved to `device`. From a bloomtrain checkpoint, HF
    safetensors or HF torch .bin files in the zip format each rank reads only its shards
    (`_load_tp_shards`); .bin files of the older pickle format are read whole, then cut."""
    from bloomtrain import load_model
    from bloomtrain.checkpoint.reader import open_model
    from bloomtrain.hf import is_hf_dir
    from bloomtrain.parallel.parallelize import parallelize
    from bloomtrain.serve.hf_slices import HFSliceReader, sliceable
    from bloomtrain.serve.quantize import quantize_model

    split = topo is not None and topo.tp_size > 1
    if split and not is_hf_dir(checkpoint):
        model = _load_tp_shards(open_model(checkpoint), topo, dtype)
    elif split and sliceable(checkpoint):
        model = _load_tp_shards(HFSliceReader(checkpoint), topo, dtype)
    else:
        model = load_model(checkpoint, device="cpu", dtype=dtype)
        if split:  # .bin weights of the pickle format: read whole, then cut
            # A loaded model's vocabulary is padded already; only its size has to split.
            topo.layout.check_tensor_parallel(model.shape, 1, topo.tp_size)
            precision = dtype_name(model.transformer.word_embeddings_layernorm.weight.dtype)
            # The modules of `model` are the chunk's: splitting them in place splits `model`.
            parallelize(model, topo, _config(topo.tp_size, precision), attention="sdpa",
                        device="cpu", engine=False)
    if quantize:
        quantize_model(model, quantize)
    model.to(device)
    return model.eval()


def _load_tp_shards(reader, topo, dtype):
    """The model that `reader` holds, split over `topo`'s tp group, each rank reading only its
    own shards, so that no rank ever holds the whole model: built on the meta device, split by
    the training plan, then each local parameter replaced by its shard. `reader` is a
    CheckpointReader (load_tp_shard: the fragments of that shard when the checkpoint was
    written with the same split, else one full parameter at a time, cut) or an
    HFSliceReader (safetensors slices, or slices of a memory-mapped torch .bin)."""
    import torch.nn as nn

    from bloomtrain.model import BloomForCausalLM, alibi_slopes, check_state
    from bloomtrain.model.presets import EMBEDDING, LM_HEAD
    from bloomtrain.parallel.parallelize import parallelize
    from bloomtrain.utils import replace_parameters

    shape = reader.shape
    check_state(shape, {n: reader.full_shape(n) for n in reader.names() if n != LM_HEAD},
                reader.path)
    dtype = torch_dtype(dtype) if dtype is not None else reader.dtype(EMBEDDING)
    precision = dtype_name(dtype)
    with torch.device("meta"):
        model = BloomForCausalLM(shape)
    topo.layout.check_tensor_parallel(shape, 1, topo.tp_size)
    parts = parallelize(model, topo, _config(topo.tp_size, precision), attention="sdpa",
                        device="meta", engine=False)
    new = {}
    for name, p in parts.named_parameters():
        spec = parts.specs[name]
        shard = reader.load_tp_shard(spec.name, "model", topo.tp_rank, topo.tp_size,
                                     spec.tp_dim)
        new[id(p)] = nn.Parameter(shard.to(dtype), requires_grad=False)
    reader.close()
    replace_parameters(parts.chunks, new)
    # fp32 whatever the weights' dtype, and this rank's heads only (as parallelize sets them).
    model.transformer.alibi_slopes = alibi_slopes(shape.num_heads).chunk(
        topo.tp_size)[topo.tp_rank].clone()
    return model


def build_runner(checkpoint, config, topo=None, device="cpu", dtype=None,
                 quantize=None) -> ModelRunner:
    """The model of `checkpoint` (as load_serving_model) with an empty KV cache of
    `config.num_blocks` blocks for this rank's heads, ready to run StepBatches; its decode
    steps from CUDA graphs on CUDA at tp=1 unless `config.enforce_eager`
    (bloomtrain.serve.graphs)."""
    from bloomtrain.serve.graphs import use_decode_graphs
    from bloomtrain.serve.kv_cache import PagedKVCache

    model = load_serving_model(checkpoint, topo, device, dtype, quantize)
    shape = model.shape
    tp = topo.tp_size if topo is not None else 1
    dtype = model.transformer.word_embeddings_layernorm.weight.dtype
    cache = PagedKVCache(shape.num_layers, config.num_blocks, config.block_size,
                         shape.num_heads // tp, shape.head_dim, dtype, device)
    group = topo.tp_group if topo is not None else None
    runner = ModelRunner(model, cache, group, min_rows=_min_rows(model, config, dtype, group))
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


def _broadcast_batch(payload: torch.Tensor | None, group) -> None:
    src = _group_src(group)
    head = torch.tensor([_STOP if payload is None else payload.numel()], dtype=torch.int64)
    comm.broadcast(head, src, group, COMM_NAME)
    if payload is not None:
        comm.broadcast(payload, src, group, COMM_NAME)


def _group_src(group) -> int:
    """The global rank of the group's first rank: the scheduler."""
    import torch.distributed as dist
    return dist.get_global_rank(group, 0)


class TensorParallelExecutor:
    """The engine's `execute` on rank 0: send the batch to the other ranks, run it here."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.closed = False

    def __call__(self, batch: StepBatch, sampling=None):
        _broadcast_batch(batch.pack(), self.runner.tp_group)
        return self.runner.forward(batch, sampling)

    def close(self) -> None:
        """Tell the other ranks to leave `worker_loop` (once)."""
        if not self.closed:
            self.closed = True
            _broadcast_batch(None, self.runner.tp_group)


def worker_loop(runner: ModelRunner) -> int:
    """Ranks other than the scheduler's: run every batch rank 0 sends until it says stop.
    Returns the number of steps run."""
    group = runner.tp_group
    src = _group_src(group)
    steps = 0
    while True:
        head = torch.empty(1, dtype=torch.int64)
        comm.broadcast(head, src, group, COMM_NAME)
        n = int(head.item())
        if n == _STOP:
            return steps
        payload = torch.empty(n, dtype=torch.int64)
        comm.broadcast(payload, src, group, COMM_NAME)
        runner.forward(StepBatch.unpack(payload))
        steps += 1
