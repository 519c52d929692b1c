"""Megatron-DeepSpeed pipeline checkpoints (BLOOM's own format) at any tp x pp x dp: the bf16
weights of every pipeline layer and tp rank in `layer_XX-model_TT-model_states.pt`, Megatron's
`args`, `iteration` and LR scheduler in each `mp_rank_*_model_states.pt` (`mp` = stage x tp + tp
rank), and the optimizer's dp shards of each mp rank (zero.py). Names and tp merges:
megatron.py.
"""
from __future__ import annotations

import torch

from bloomtrain.checkpoint.interop import megatron
from bloomtrain.checkpoint.interop.files import CheckpointFiles
from bloomtrain.checkpoint.interop.hf_zero import precision_of, zero_stage_of
from bloomtrain.checkpoint.interop.safe_load import InteropError, load
from bloomtrain.checkpoint.interop.source import WEIGHTS, Source, check_decay_groups
from bloomtrain.checkpoint.interop.zero import ZeroShards
from bloomtrain.devices import torch_dtype
from bloomtrain.model.params import base_spec



class PipelineCheckpoint:
    """The files of one Megatron-DeepSpeed step, indexed by HF name: which (mp rank, pipeline
    name) holds each tp piece, and in which layer file its weights are."""

    def __init__(self, files: CheckpointFiles):
        self.files, self.where = files, files.tag_dir
        self.metas = {mp: load(files.model_file(mp), mmap=True) for mp in range(files.num_mp)}
        meta = self.metas[0]
        if not isinstance(meta, dict) or "args" not in meta:
            raise InteropError(f"{files.model_file(0)} has no Megatron `args`; not a "
                               f"Megatron-DeepSpeed checkpoint")
        self.args = megatron.args_dict(meta["args"], files.model_file(0))
        self.shape = megatron.shape_from_args(self.args, files.model_file(0))
        self.tp = int(self.args.get("tensor_model_parallel_size") or 1)
        self.pp = int(self.args.get("pipeline_model_parallel_size") or 1)
        if self.tp * self.pp != files.num_mp:
            raise InteropError(f"{self.where}: args say tp {self.tp} x pp {self.pp} = "
                               f"{self.tp * self.pp} model-parallel ranks, but mp_rank files "
                               f"0..{files.num_mp - 1} are here")
        self._check_same_step()
        self.ds_config = meta.get("ds_config") if isinstance(meta.get("ds_config"), dict) else None
        self.dp = int(meta.get("dp_world_size") or 1)
        files.check_complete(self.dp if files.optim else None, files.num_mp)
        self._check_layer_grid()
        self._layer_cache: dict = {}
        self._zero: dict[int, ZeroShards] = {}
        self._index()

    def _check_same_step(self) -> None:
        steps = {mp: m.get("iteration", m.get("global_steps")) for mp, m in self.metas.items()}
        if len(set(steps.values())) > 1:
            odd = [f"{self.files.model_file(mp).name}: {s}" for mp, s in steps.items()]
            raise InteropError(f"{self.where}: the model-parallel ranks' files are from different "
                               f"iterations ({'; '.join(odd)}); they do not belong together")

    def _check_layer_grid(self) -> None:
        if not self.files.layers:
            raise InteropError(f"{self.where}: no layer_*-model_*-model_states.pt files; not a "
                               f"pipeline checkpoint")
        for layer in sorted({lay for lay, _ in self.files.layers}):
            for t in range(self.tp):
                if (layer, t) not in self.files.layers:
                    raise InteropError(f"{self.where}: layer_{layer:02d}-model_{t:02d}-model_states"
                                       f".pt is missing (tp {self.tp}: every layer has one file "
                                       f"per tp rank)")
        extra = sorted({t for _, t in self.files.layers if t >= self.tp})
        if extra:
            raise InteropError(f"{self.where}: layer files of tp ranks {extra}, but the run had "
                               f"tp {self.tp}; the directory mixes files of different runs")

    def _index(self) -> None:
        """self.pieces: HF name -> [(mp, pipeline name)] per tp rank, first stage holding it;
        self.local: HF name -> tp-local shape; self.layer_of: HF name -> (layer, key)."""
        names = {mp: [n for g in m["param_shapes"] for n in g] for mp, m in self.metas.items()}
        every = sorted({n for ns in names.values() for n in ns})
        to_hf = megatron.hf_names(every, self.where, self.shape.num_layers)
        self.pieces, self.local = {}, {}
        for stage in range(self.pp):
            for t in range(self.tp):
                mp = stage * self.tp + t
                shapes = {n: tuple(s) for g in self.metas[mp]["param_shapes"] for n, s in g.items()}
                for n, s in shapes.items():
                    hf = to_hf[n]
                    owner = self.pieces.setdefault(hf, {})
                    if t in owner and owner[t][0] // self.tp != stage:
                        continue  # the last stage's copy of the tied embedding
                    owner[t] = (mp, n)
                    if self.local.setdefault(hf, s) != s:
                        raise InteropError(f"{self.files.model_file(mp)}: {n} is {list(s)} on tp "
                                           f"rank {t}, {list(self.local[hf])} on another; the tp "
                                           f"files do not belong together")
        self.shapes = {hf: self._full_shape(hf) for hf in self.pieces}
        self._index_layer_files()

    def _index_layer_files(self) -> None:
        """self.layer_of: HF name -> (layer, key in its layer files). A block's or the final
        LayerNorm's optimizer name is `{layer}.{key}`; the embedding's is
        `tied_modules.embed.{key}`, in the first layer's files. Every layer file must hold
        exactly its layer's parameters, in the optimizer's shapes."""
        first = min(layer for layer, _ in self.files.layers)
        self.layer_of = {}
        for hf, owners in self.pieces.items():
            name = owners[0][1]
            layer, _, key = name.partition(".")
            if name.startswith("tied_modules.embed."):
                layer, key = first, name.removeprefix("tied_modules.embed.")
            self.layer_of[hf] = (int(layer), key)
        expected: dict[int, dict[str, str]] = {}
        for hf, (layer, key) in self.layer_of.items():
            expected.setdefault(layer, {})[key] = hf
        for (layer, t), path in sorted(self.files.layers.items()):
            state = self._layer(layer, t)
            want = expected.get(layer, {})
            if set(state) != set(want):
                raise InteropError(f"{path} holds {sorted(state)}, but layer {layer} of this "
                                   f"checkpoint has {sorted(want)}; the files do not belong "
                                   f"together")
            for key, hf in want.items():
                if tuple(state[key].shape) != self.local[hf]:
                    raise InteropError(f"{path}: {key} is {list(state[key].shape)}, the "
                                       f"optimizer says {list(self.local[hf])}; the files do "
                                       f"not belong together")

    def _full_shape(self, hf: str) -> tuple[int, ...]:
        if len(self.pieces[hf]) != self.tp:
            raise InteropError(f"{self.where}: {hf} is on tp ranks {sorted(self.pieces[hf])} "
                               f"only; a tp rank's files are missing")
        shape = list(self.local[hf])
        dim = base_spec(hf).tp_dim
        if dim is not None:
            shape[dim] *= self.tp
        return tuple(shape)

    def _layer(self, layer: int, t: int) -> dict:
        key = (layer, t)
        if key not in self._layer_cache:
            state = load(self.files.layers[key], mmap=True)
            if not isinstance(state, dict):
                raise InteropError(f"{self.files.layers[key]} is not a layer state dict")
            self._layer_cache[key] = state
        return self._layer_cache[key]

    def zero(self, mp: int) -> ZeroShards:
        if mp not in self._zero:
            self._zero[mp] = ZeroShards(self.files.dp_files(mp), self.metas[mp]["param_shapes"],
                                        f"{self.where} mp_rank_{mp:02d}")
        return self._zero[mp]

    def tp_pieces(self, hf: str, kind: str) -> list[torch.Tensor]:
        if kind == WEIGHTS:
            layer, key = self.layer_of[hf]
            out = []
            for t in range(self.tp):
                state = self._layer(layer, t)
                if key not in state:
                    raise InteropError(f"{self.files.layers[(layer, t)]} has no {key}")
                out.append(state[key].detach())
            return out
        return [self.zero(mp).load(n, kind) for mp, n in
                (self.pieces[hf][t] for t in range(self.tp))]

    def where_of(self, hf: str) -> str:
        layer, _ = self.layer_of[hf]
        return ", ".join(self.files.layers[(layer, t)].name for t in range(self.tp))


def read_megatron(files: CheckpointFiles, weights_only: bool, model_config=None) -> Source:
    from bloomtrain.model import check_state

    megatron.refuse_model_config(model_config, files.tag_dir)
    ckpt = PipelineCheckpoint(files)
    check_state(ckpt.shape, ckpt.shapes, ckpt.where)
    precision = "bf16" if ckpt.args.get("bf16") else "fp16" if ckpt.args.get("fp16") else \
        precision_of(ckpt.ds_config, files.optim_prefix)
    drift: dict[str, tuple[float, float]] = {}  # name -> (largest difference, its share of the
    # parameter's largest magnitude)

    def read(name: str, kind: str) -> torch.Tensor:
        return megatron.merge_tp(name, ckpt.tp_pieces(name, kind), drift, ckpt.where_of(name))

    optimizer = bool(files.optim) and not weights_only
    src = Source(label=f"Megatron-DeepSpeed GPTModelPipe, tp={ckpt.tp} pp={ckpt.pp} dp={ckpt.dp}, "
                       f"{precision}{', BF16_Optimizer' if files.optim_prefix == 'bf16_' else ''}",
                 path=files.root, shape=ckpt.shape, shapes=ckpt.shapes,
                 weight_dtype=torch_dtype(precision), read=read, optimizer=optimizer,
                 optimizer_found=bool(files.optim),
                 layout={"tp": ckpt.tp, "pp": ckpt.pp, "dp": ckpt.dp, "precision": precision,
                         "zero_stage": zero_stage_of(ckpt.ds_config)},
                 args=ckpt.args, ds_config=ckpt.ds_config)
    src.train_state = megatron.train_position(ckpt.args, ckpt.metas[0])
    src.checks.append(lambda: _check_replicas(ckpt, src, drift))
    if optimizer:
        steps = {ckpt.zero(mp).adam_step() for mp in range(files.num_mp)}
        if len(steps) > 1:
            raise InteropError(f"{ckpt.where}: the mp ranks' optimizer shards disagree on Adam's "
                               f"step ({sorted(steps, key=str)}); they are from different runs")
        src.adam_step = steps.pop()
        src.param_groups = _param_groups(ckpt)
        src.checks.append(lambda: check_decay_groups(src.param_groups, ckpt.where))
        src.checks.append(lambda: _check_weights_match(ckpt, src.weight_dtype))
    return src


def _param_groups(ckpt: PipelineCheckpoint) -> list[dict]:
    to_hf = {n: hf for hf, owners in ckpt.pieces.items() for _, n in owners.values()}
    groups: list[dict] = []
    for mp in range(ckpt.files.num_mp):
        for g in ckpt.zero(mp).param_groups():
            groups.append({**g, "names": [to_hf[n] for n in g["names"] if n in to_hf]})
    return groups


def _check_replicas(ckpt: PipelineCheckpoint, src: Source, drift: dict) -> list[str]:
    """Average the tp copies of every replicated parameter once (small: LayerNorms and biases),
    refusing copies too far apart to be one parameter; report the largest difference."""
    kind = "fp32" if src.optimizer else WEIGHTS
    for name in ckpt.shapes:
        if base_spec(name).tp_dim is None and ckpt.tp > 1:
            src.read(name, kind)
    if not drift:
        return []
    worst = max(drift, key=lambda n: drift[n][0])
    diff, share = drift[worst]
    return [f"tp copies of the replicated parameters (LayerNorms, row-parallel biases) averaged "
            f"over {ckpt.tp} tp ranks; largest difference {diff:.3g} ({worst}, {share:.2%} of "
            f"its largest magnitude; copies further apart than "
            f"{megatron.TP_COPY_TOLERANCE:.0%} are refused)"]


def _check_weights_match(ckpt: PipelineCheckpoint, dtype) -> list[str]:
    """Each tp rank's layer-file weights are its fp32 masters rounded to the run's dtype. Checked
    on the small parameters (biases, LayerNorms: they move visibly at every step), which tells
    apart layer files and optimizer shards of different steps or runs without reading the
    model twice."""
    for name, shape in ckpt.shapes.items():
        if len(shape) != 1:
            continue
        weights = ckpt.tp_pieces(name, WEIGHTS)
        masters = ckpt.tp_pieces(name, "fp32")
        for t, (w, m) in enumerate(zip(weights, masters)):
            if w.shape != m.shape or not torch.equal(w.to(dtype), m.to(dtype)):
                layer, _ = ckpt.layer_of[name]
                mp = ckpt.pieces[name][t][0]
                raise InteropError(
                    f"{ckpt.files.layers[(layer, t)]}: {name} (tp rank {t}) differs from its fp32 "
                    f"master in the optimizer shards of mp_rank_{mp:02d} by up to "
                    f"{float((w.float() - m.float()).abs().max()):.3g}: the layer file and the "
                    f"optimizer shards come from different checkpoints")
    return [f"every tp rank's layer weights match its fp32 masters (rounded to {dtype})"]
