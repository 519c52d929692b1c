"""The one model loader for inference: `load_sharded(source, topo, dtype)` reads a bloomtrain
checkpoint or an HF Bloom directory into this rank's part of `topo`'s layout, each rank reading
only its own shards, as vLLM has one model loader for every engine. `bloomtrain.load_model`
(one device), the serving engine (tp ranks) and `bloomtrain eval` (any tp x pp layout) all
call it.

Sources and how much of them a rank reads:
- a bloomtrain checkpoint (CheckpointReader.load_tp_shard: the fragments of this rank's shard
  when the checkpoint was written with the same split, else one full parameter at a time, cut);
- HF safetensors, or torch .bin files of the zip format (HFSliceReader: slices of memory-mapped
  files);
- HF .bin files of the older pickle format cannot be read in part: read whole on each rank,
  then cut.
The model is built on the meta device and cut by `shard_model` (the tensor-parallel plan and the
pipeline's chunks, as training cuts it), then each local parameter is replaced by its shard, so
no rank holds the whole model unless it runs it whole. The ALiBi slopes are this rank's heads'
(bloomtrain.model.bloom.local_alibi_slopes), fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bloomtrain.checkpoint.format import SharedCheck
from bloomtrain.devices import torch_dtype
from bloomtrain.errors import UserError
from bloomtrain.model.bloom import BloomForCausalLM, check_state, local_alibi_slopes
from bloomtrain.model.presets import EMBEDDING, LM_HEAD, BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.parallelize import set_local_slopes, shard_model
from bloomtrain.topology import Topology
from bloomtrain.model.params import replace_parameters


@dataclass
class LoadedModel:
    """`model`: the full model object, whose modules are this rank's (split in place by the
    tensor-parallel plan; the pipeline's other stages dropped); `chunks`: this rank's pipeline
    chunks in virtual-stage order (pp = 1: one, holding `model`'s modules), or [model] when
    loaded whole for one device; `dtype`: the weights' dtype."""

    shape: BloomShape
    model: BloomForCausalLM
    chunks: list
    dtype: torch.dtype


def load_sharded(source, topo: Topology | None = None, dtype=None, *,
                 attention: str = "sdpa", device="cpu") -> LoadedModel:
    """`source` (a bloomtrain checkpoint, a step directory or a root holding `latest`, or an HF
    Bloom directory) as this rank's part of `topo`'s layout, in `dtype` (a torch dtype or a
    name; None: as stored). `topo` None: the whole model, for one device (as trainable as a
    built one), on the CPU; with a topo its parameters are frozen, and each goes to `device` as
    it is read, so the host holds one shard at a time (the 8 ranks of a node serving BLOOM-176B
    from its fp32 masters would otherwise hold 704 GB there). `attention`: the kernel its
    blocks run (bloomtrain.model.attention)."""
    if topo is None:  # one device: read whole, verified once (a partial reader verified too)
        model = _load_whole(source, dtype)
        return LoadedModel(model.shape, model, [model], _dtype_of(model))
    reader = _partial_reader(source, job_check())
    if reader is None:
        model = _load_whole(source, dtype)
        _check_layout(topo, model.shape)
        # The chunks copy their pieces out of the full weights.
        chunks, _ = shard_model(model, topo, attention, device="cpu")
        set_local_slopes(chunks, model.shape, topo, "cpu")
        for chunk in chunks:
            chunk.requires_grad_(False)
        return LoadedModel(model.shape, model, chunks, _dtype_of(model))
    try:
        return _load_shards(reader, topo, dtype, attention, torch.device(device))
    finally:
        reader.close()


def job_check() -> SharedCheck | None:
    """How the ranks of this job verify a checkpoint they all open (format.SharedCheck): each
    hashes its share of the files, and all come to the same verdict on the same candidates.
    None in a single process. Every rank must make the same calls with it."""
    group = comm.world_group()
    if group is None:
        return None

    def agree(error: str | None) -> str | None:
        return next((e for e in comm.all_gather_object(error, group, "checkpoint")
                     if e is not None), None)

    def common(value):
        return comm.broadcast_object(value, 0, group, "checkpoint")

    return SharedCheck(comm.group_rank(group), comm.group_size(group), agree, common)


def _partial_reader(source, shared: SharedCheck | None):
    """A reader that gives one tp shard of one parameter at a time, or None where the files
    cannot be read in part (HF .bin of the pickle format). `shared`: every rank of the job
    opens it (its checksums split over them)."""
    from bloomtrain.checkpoint.reader import open_model
    from bloomtrain.checkpoint.hf.convert import is_hf_dir
    from bloomtrain.checkpoint.hf.slices import HFSliceReader, sliceable

    if not is_hf_dir(source):
        return open_model(source, shared)
    return HFSliceReader(source) if sliceable(source) else None


def _check_layout(topo: Topology, shape: BloomShape) -> None:
    """The layout's rules on this model's shape (heads and vocabulary over tp, layers over pp),
    each a one-line error naming what to change."""
    layout = topo.layout
    if shape.vocab_size % layout.tp:
        # A stored vocabulary is what it is (training pads it with
        # model.make_vocab_size_divisible_by; a loaded model cannot be).
        fits = [t for t in range(1, layout.tp) if shape.vocab_size % t == 0 and
                shape.num_heads % t == 0]
        raise UserError(f"the model's vocabulary ({shape.vocab_size} rows) does not split over "
                        f"tp={layout.tp}; load it with a tp that divides it (tp={fits[-1]} "
                        f"here)")
    layout.check_tensor_parallel(shape, 1, layout.tp)
    if shape.num_layers < layout.pp:
        raise UserError(f"parallel.pp={layout.pp} needs at least {layout.pp} layers; the model "
                        f"has {shape.num_layers}")
    layout.check_pipeline(shape.num_layers)


def _load_shards(reader, topo: Topology, dtype, attention: str, device) -> LoadedModel:
    """Build on meta, cut by shard_model, then put each local parameter's shard in its place
    (the last stage's copy of the tied embedding, pp > 1, is read under the embedding's name:
    its spec's)."""
    shape = reader.shape
    check_state(shape, {n: reader.full_shape(n) for n in reader.names() if n != LM_HEAD},
                reader.path)
    _check_layout(topo, shape)
    dtype = torch_dtype(dtype) if dtype is not None else reader.dtype(EMBEDDING)
    with torch.device("meta"):
        model = BloomForCausalLM(shape)
    chunks, specs = shard_model(model, topo, attention, device="meta")
    new, seen = {}, set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            spec = specs[name]
            shard = reader.load_tp_shard(spec.name, "model", topo.tp_rank, topo.tp_size,
                                         spec.tp_dim)
            new[id(p)] = nn.Parameter(shard.to(device=device, dtype=dtype), requires_grad=False)
            del shard
    replace_parameters(chunks, new)
    set_local_slopes(chunks, shape, topo, device)
    model.transformer.alibi_slopes = chunks[0].transformer.alibi_slopes
    return LoadedModel(shape, model, chunks, dtype)


def _load_whole(source, dtype) -> BloomForCausalLM:
    """The whole model on the CPU: every tensor read (the one-device case, and files that cannot
    be read in part)."""
    from bloomtrain.checkpoint import hf
    from bloomtrain.checkpoint.reader import open_model

    if hf.is_hf_dir(source):
        shape, state, _ = hf.collect_hf_state(source)
    else:
        reader = open_model(source)
        try:
            shape = reader.shape
            state = {n: reader.load(n) for n in reader.names() if n != LM_HEAD}
            check_state(shape, {n: tuple(t.shape) for n, t in state.items()}, reader.path)
        finally:
            reader.close()
    dtype = torch_dtype(dtype) if dtype is not None else state[EMBEDDING].dtype
    # Built on the meta device and filled by assignment: no random init and no second copy of
    # the weights, which matters for the billion-parameter presets.
    with torch.device("meta"):
        model = BloomForCausalLM(shape)
    state = dict(state)
    state[LM_HEAD] = state[EMBEDDING]
    model.load_state_dict(state, strict=True, assign=True)
    # Assignment wraps each module's tensor in its own Parameter; re-tie so that the head *is*
    # the embedding, as in a freshly built model.
    model.lm_head.weight = model.transformer.word_embeddings.weight
    # The slopes were left on meta; they stay fp32 whatever the weights' dtype, so they are set
    # after the cast.
    model.transformer.alibi_slopes = None
    model.to(dtype=dtype)
    model.transformer.alibi_slopes = local_alibi_slopes(shape.num_heads)
    return model


def _dtype_of(model: BloomForCausalLM) -> torch.dtype:
    return model.transformer.word_embeddings_layernorm.weight.dtype
