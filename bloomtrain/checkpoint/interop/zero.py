"""DeepSpeed's ZeRO optimizer shards of one model-parallel rank, read back per parameter.

A DeepSpeed optimizer keeps each parameter group as one flat fp32 buffer (the masters) plus flat
Adam moments of the same layout, split over the data-parallel ranks; each dp rank saves its part
in `[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`. `param_shapes` (in the rank's
model-states file) lists every group's parameters in buffer order. Three layouts:

- ZeRO-1/2 and the BF16_Optimizer, with `param_slice_mappings` (DeepSpeed >= 0.7): for each
  dp rank and group, every parameter's `fragment_address(numel, start)` in that rank's part; a
  parameter is its fragments in dp-rank order.
- The same without `param_slice_mappings` (the DeepSpeed of BLOOM's training: Megatron-DeepSpeed
  issue 343's `KeyError: 'param_slice_mappings'`): the dp parts concatenated are the group's
  buffer, the parameters lie in it back to back in `param_shapes` order (plus any
  `param_alignment_paddings`), as DeepSpeed's zero_to_fp32 reads them.
- ZeRO-3 (`fp32_flat_groups`): every parameter is split on its own into dp parts of
  ceil(numel / dp) elements (the last padded); dp rank r's buffer holds part r of each
  parameter in order.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch

from bloomtrain.checkpoint.interop.safe_load import InteropError, load

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _numel(shape) -> int:
    return math.prod(tuple(shape))


def _state_groups(base, where: Path) -> list[dict]:
    """The per-group flat optimizer states of a shard: the torch state dict's `state` by group
    index, or the list an elastic ZeRO-1/2 checkpoint saves."""
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        state = base["state"]
        return [state[k] for k in sorted(state)]
    if isinstance(base, list) and all(isinstance(s, dict) for s in base):
        return base
    raise InteropError(f"{where}: its base optimizer state is neither a torch state dict nor "
                       f"a list of group states; not a DeepSpeed optimizer shard")


def _as_int(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return int(value)


class ZeroShards:
    """The optimizer state of one model-parallel rank (one pp stage and tp rank), from its dp
    shards (`files`, in dp-rank order) and the rank's `param_shapes`. `load(name, kind)` gives a
    parameter's full (tp-local) fp32 master or Adam moment."""

    def __init__(self, files: list[Path], param_shapes: list, label: str):
        self.files, self.label = files, label
        self.shards = [load(f, mmap=True) for f in files]
        self.states = []
        for f, shard in zip(files, self.shards):
            osd = shard.get("optimizer_state_dict") if isinstance(shard, dict) else None
            if not isinstance(osd, dict):
                raise InteropError(f"{f} has no optimizer_state_dict; not a DeepSpeed optimizer "
                                   f"shard")
            self.states.append(osd)
        self.groups = [OrderedDict((n, tuple(s)) for n, s in g.items()) for g in param_shapes]
        first = self.states[0]
        self.stage3 = "fp32_flat_groups" in first
        self._check_partition_count()
        if self.stage3:
            self._flat = [osd["fp32_flat_groups"] for osd in self.states]
            self._base = [_state_groups(osd.get("optimizer_state_dict"), f)
                          for f, osd in zip(files, self.states)]
        else:
            self._flat = [osd.get("single_partition_of_fp32_groups") for osd in self.states]
            self._base = [_state_groups(osd.get("base_optimizer_state"), f)
                          for f, osd in zip(files, self.states)]
        # Adam has not stepped yet (a save at step 0, or an fp16 run whose every step so far
        # overflowed): its state is empty, and its moments are zeros, as they start.
        self.unstepped = all(not base for base in self._base)
        if self.unstepped:
            self._base = [[{} for _ in self.groups] for _ in self._base]
        for f, flat, base in zip(files, self._flat, self._base):
            if not isinstance(flat, list) or len(flat) != len(self.groups) or \
                    len(base) != len(self.groups):
                raise InteropError(f"{f}: {len(self.groups)} parameter groups in param_shapes, "
                                   f"but the shard holds "
                                   f"{len(flat) if isinstance(flat, list) else 'no'} flat fp32 "
                                   f"groups and {len(base)} optimizer states; the files do not "
                                   f"belong together")
        self.has_moments = self.unstepped or all("exp_avg" in g and "exp_avg_sq" in g
                                                 for b in self._base for g in b)
        self._check_distinct()
        self._where = self._locate()

    # ---- layout ------------------------------------------------------------------------------
    def _check_partition_count(self) -> None:
        count = self.states[0].get("partition_count")
        counts = count if isinstance(count, list) else [count]
        counts = [_as_int(c) for c in counts if c is not None]
        if counts and max(counts) != len(self.files):
            raise InteropError(f"{self.label}: the optimizer shards say they are {max(counts)} "
                               f"data-parallel parts (partition_count), but {len(self.files)} "
                               f"shard file(s) are here ({', '.join(f.name for f in self.files)}); "
                               f"copy the missing zero_pp_rank_* files of this rank")

    def _check_distinct(self) -> None:
        """Two dp ranks' files holding the same fp32 partition are one file copied over the
        other (a shard fetched twice, a rank's file restored from its neighbour). Nothing else
        tells them apart: a ZeRO-3 shard, or a stage 1/2 one without param_slice_mappings,
        records no rank, and the import would stitch one rank's slices in twice as the model's
        weights. Two real ranks' partitions are never equal in every group once any group holds
        initialised matrices (a group of norms and biases alone can match at step 0, which is
        why all groups must agree). A strided sample of each partition finds the candidates;
        only those are compared in full, so a large save is not read twice."""
        def sample(flat: torch.Tensor) -> torch.Tensor:
            flat = flat.reshape(-1)
            step = max(1, flat.numel() // 1024)
            return flat[::step][:1024].clone()

        prints = {}
        for r, groups in enumerate(self._flat):
            key = tuple((tuple(t.shape), tuple(sample(t).tolist())) for t in groups)
            prints.setdefault(key, []).append(r)
        for ranks in prints.values():
            for i, a in enumerate(ranks):
                for b in ranks[i + 1:]:
                    if all(torch.equal(x, y) for x, y in zip(self._flat[a], self._flat[b])):
                        raise InteropError(
                            f"{self.files[a]} and {self.files[b]} hold the same fp32 "
                            f"partition: one is a copy of the other, not dp ranks {a} and {b} "
                            f"of one save; copy each rank's own file from the save")

    def _locate(self) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
        """name -> (group, [(dp rank, start, numel) in the rank's flat part, in order])."""
        where = {}
        mappings = [osd.get("param_slice_mappings") for osd in self.states]
        use_mappings = not self.stage3 and all(isinstance(m, list) for m in mappings)
        for g, shapes in enumerate(self.groups):
            if self.stage3:
                where.update(self._locate_stage3(g, shapes))
            elif use_mappings:
                where.update(self._locate_mapped(g, shapes, [m[g] for m in mappings]))
            else:
                where.update(self._locate_sequential(g, shapes))
        return where

    def _part_sizes(self, g: int) -> list[int]:
        return [int(flat[g].numel()) for flat in self._flat]

    def _locate_mapped(self, g, shapes, mappings) -> dict:
        out = {name: (g, []) for name in shapes}
        sizes = self._part_sizes(g)
        for r, mapping in enumerate(mappings):
            for name, addr in mapping.items():
                if name not in out:
                    raise InteropError(f"{self.files[r]}: param_slice_mappings names {name}, "
                                       f"which is not in group {g} of param_shapes; the files "
                                       f"do not belong together")
                start, numel = int(addr.start), int(addr.numel)
                if start < 0 or numel < 0 or start + numel > sizes[r]:
                    raise InteropError(f"{self.files[r]}: {name} at [{start}, {start + numel}) "
                                       f"lies outside the shard's {sizes[r]} elements")
                out[name][1].append((r, start, numel))
        self._check_covered(out, shapes)
        return out

    def _locate_sequential(self, g, shapes) -> dict:
        paddings = self.states[0].get("param_alignment_paddings")
        pads = paddings[g] if isinstance(paddings, list) and len(paddings) > g else None
        sizes = self._part_sizes(g)
        bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
        out, offset = {}, 0
        for i, (name, shape) in enumerate(shapes.items()):
            n, pieces = _numel(shape), []
            for r in range(len(sizes)):  # this parameter's overlap with each dp rank's part
                lo, hi = max(offset, bounds[r]), min(offset + n, bounds[r + 1])
                if lo < hi:
                    pieces.append((r, lo - bounds[r], hi - lo))
            out[name] = (g, pieces)
            offset += n + (int(pads[i]) if pads is not None and i < len(pads) else 0)
        if offset > bounds[-1]:
            raise InteropError(f"{self.label}: group {g}'s parameters need {offset} elements but "
                               f"its {len(sizes)} shard(s) hold {bounds[-1]}; a shard is "
                               f"truncated or from another checkpoint")
        self._check_covered(out, shapes)
        return out

    def _locate_stage3(self, g, shapes) -> dict:
        dp, sizes = len(self.files), self._part_sizes(g)
        out, offset = {}, 0
        for name, shape in shapes.items():
            part = math.ceil(_numel(shape) / dp)
            out[name] = (g, [(r, offset, part) for r in range(dp)])
            offset += part
        if any(offset > s for s in sizes):
            raise InteropError(f"{self.label}: group {g}'s ZeRO-3 parts need {offset} elements "
                               f"per rank, the shards hold {sizes}; a shard is truncated or "
                               f"from another checkpoint")
        return out

    def _check_covered(self, out: dict, shapes) -> None:
        for name, (g, pieces) in out.items():
            have, want = sum(p[2] for p in pieces), _numel(shapes[name])
            if have != want:
                raise InteropError(f"{self.label}: the optimizer shards hold {have} elements of "
                                   f"{name}, param_shapes says {want}; a shard is missing, "
                                   f"truncated or from another checkpoint")

    # ---- reading -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [n for shapes in self.groups for n in shapes]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.groups[self._where[name][0]][name]

    def group_of(self, name: str) -> int:
        return self._where[name][0]

    def _flat_of(self, r: int, g: int, kind: str) -> torch.Tensor:
        if kind == "fp32":
            return self._flat[r][g]
        if self.unstepped:
            return torch.zeros_like(self._flat[r][g])
        if kind not in self._base[r][g]:
            raise InteropError(f"{self.files[r]}: group {g} has no {kind} (the optimizer is not "
                               f"Adam); import with --weights-only")
        return self._base[r][g][kind]

    def load(self, name: str, kind: str) -> torch.Tensor:
        """`name`'s full (tp-local) tensor of `kind` (fp32, exp_avg, exp_avg_sq), fp32. The
        files are memory-mapped: this reads only that parameter's pages, so a converter holds
        one parameter at a time whatever the size of the model."""
        g, pieces = self._where[name]
        parts = [self._flat_of(r, g, kind).reshape(-1)[start:start + numel]
                 for r, start, numel in pieces]
        n = _numel(self.shape(name))
        flat = torch.cat(parts)[:n] if parts else torch.empty(0)
        return flat.detach().to(torch.float32).reshape(self.shape(name)).clone()

    def adam_step(self) -> int | None:
        """Adam's step count, the same in every group and shard (torch keeps it per group state,
        apex FusedAdam in the param groups); None when no shard records one."""
        steps = set()
        for osd, base in zip(self.states, self._base):
            for g, state in enumerate(base):
                step = _as_int(state.get("step"))
                if step is None:
                    groups = (osd.get("base_optimizer_state") or
                              osd.get("optimizer_state_dict") or {})
                    pg = groups.get("param_groups") if isinstance(groups, dict) else None
                    step = _as_int(pg[g].get("step")) if pg and len(pg) > g else None
                if step is None:
                    step = _as_int(osd.get("base_optimizer_state_step"))
                if step is not None:
                    steps.add(step)
        if len(steps) > 1:
            raise InteropError(f"{self.label}: the optimizer shards disagree on Adam's step "
                               f"({sorted(steps)}); they are from different checkpoints")
        return steps.pop() if steps else (0 if self.unstepped else None)

    def param_groups(self) -> list[dict]:
        """Each group's hyperparameters (lr, betas, eps, weight_decay) and parameter names."""
        osd = self.states[0]
        base = osd.get("optimizer_state_dict" if self.stage3 else "base_optimizer_state")
        groups = base.get("param_groups") if isinstance(base, dict) else None
        if not isinstance(groups, list):
            groups = osd.get("param_groups") or [{} for _ in self.groups]
        # ZeRO-3 splits a group whose partition exceeds sub_group_size (DeepSpeed's default
        # 1e9 elements: bloom-7b1 below dp 8) into sub-groups: param_shapes, the flat groups
        # and the moments are per sub-group, param_groups per group, each listing the indices
        # of its sub-groups in `params`. Each flat group takes the hyperparameters of the group
        # that lists it (one each without sub-groups: the pairing in order).
        owner = {i: pg for pg in groups if isinstance(pg, dict)
                 for i in (pg.get("params") or []) if isinstance(i, int)}
        if sorted(owner) != list(range(len(self.groups))):
            owner = dict(enumerate(groups))
        return [{**{k: v for k, v in owner[i].items() if k != "params"}, "names": list(shapes)}
                for i, shapes in enumerate(self.groups) if i in owner]

    def loss_scale(self) -> dict | None:
        return ds_scaler_fields(self.states[0].get("loss_scaler"))


def ds_scaler_fields(scaler) -> dict | None:
    """DeepSpeed's fp16 loss scaler (an optimizer shard's, or a universal checkpoint's
    zero/optimizer_state.pt's `loss_scaler`) as the fields the import keeps."""
    if scaler is None or not hasattr(scaler, "get"):
        return None
    return {"scale": scaler.get("cur_scale"), "dynamic": scaler.get("dynamic"),
            "hysteresis": scaler.get("cur_hysteresis"), "window": scaler.get("scale_window"),
            "iter": scaler.get("cur_iter"), "last_overflow": scaler.get("last_overflow_iter")}
