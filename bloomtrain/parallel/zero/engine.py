"""The ZeRO engine (Rajbhandari et al., arXiv 1910.02054), stages 0-3, with BLOOM's BF16Optimizer
layout: compute weights in bf16/fp16/fp32, fp32 master weights and Adam moments, gradients
accumulated and reduced in fp32. It holds the buffers and does the data-parallel work: the
stage table (stages.py), the flat-buffer layout (segments.py), the buffers (buffers.py), gradient
reduction (reduce.py), stage 3's gathers (gather.py), host copies under ZeRO-Offload
(offload.py), state in logical coordinates (state.py), memory accounting (memory.py) and the
clock of waits on dp peers (waits.py). The optimizer that steps its masters is
bloomtrain.optim's.
"""
from __future__ import annotations

import torch
from torch import nn

from bloomtrain.errors import UserError
from bloomtrain.model.bloom import BloomBlock
from bloomtrain.model.params import EMBEDDING
from bloomtrain.parallel import comm
from bloomtrain.parallel.zero import state
from bloomtrain.parallel.zero.buffers import FlatBuffers, Values
from bloomtrain.parallel.zero.gather import Stage3Gatherer, Unit, secondary_group
from bloomtrain.parallel.zero.memory import Counters, formula, state_bytes
from bloomtrain.parallel.zero.offload import HostCopies
from bloomtrain.parallel.zero.reduce import GradReducer, global_grad_norm
from bloomtrain.parallel.zero.segments import bucket_elements, build_layout
from bloomtrain.parallel.zero.stages import stage_rules
from bloomtrain.parallel.zero.waits import WaitClock
from bloomtrain.devices import torch_dtype


def find_units(modules: list[nn.Module], unit_types: tuple) -> list[nn.Module]:
    """Each `unit_types` module as a whole, and every other module that owns parameters
    directly, in module order."""
    units = []

    def visit(m):
        if isinstance(m, unit_types):
            units.append(m)
            return
        if any(True for _ in m.parameters(recurse=False)):
            units.append(m)
        for child in m.children():
            visit(child)
    for m in modules:
        visit(m)
    return units


def _group_units(modules, specs, unit_types):
    """(groups of (name, param, spec) in forward order, units with the groups they use). A
    parameter belongs to the first unit that holds it; a later user (the LM head of a tied
    embedding) uses that group."""
    names = {}
    for m in modules:
        for n, p in m.named_parameters():
            names.setdefault(id(p), n)
    groups, group_of, units = [], {}, []
    for m in find_units(modules, unit_types):
        params = list(m.parameters(recurse=isinstance(m, unit_types)))
        fresh = [p for p in params if id(p) not in group_of and p.requires_grad]
        if fresh:
            for p in fresh:
                group_of[id(p)] = len(groups)
            groups.append([(names[id(p)], p, specs[names[id(p)]]) for p in fresh])
        used = sorted({group_of[id(p)] for p in params if id(p) in group_of})
        units.append(Unit(m, used))
    return groups, units


class ZeroEngine:
    """Per step: every micro-batch's backward (the gradients land in the fp32 accumulator),
    then `reduce_gradients()`, then the optimizer's update of the masters, then
    `refresh_compute()` (under offload: `host`'s copies, segment by segment). `waits.take()` is
    the time stalled on dp peers since the last take."""

    def __init__(self, modules: list[nn.Module], specs: dict, topo, precision: str,
                 zero_stage: int = 0, bucket_size_mb: float = 25, device=None,
                 values: Values | None = None, prefetch: bool = True,
                 unit_types: tuple = (BloomBlock,), offload: bool = False,
                 offload_pin_memory: bool = False, grad_reduce_dtype: str = "fp32",
                 error_feedback: bool = False,
                 weight_gather_dtype: str = "auto", secondary_per_node: int | None = None):
        self.topo, self.precision = topo, precision
        self.rules = stage_rules(zero_stage)
        self.compute_dtype = torch_dtype(precision)
        frozen = [n for m in modules for n, p in m.named_parameters() if not p.requires_grad]
        if frozen:
            raise UserError(f"parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} do not "
                            f"require grad; the engine trains every parameter of the model")
        groups, units = _group_units(modules, specs, unit_types)
        if not groups:
            raise UserError("the engine got no trainable parameters")
        bucket = bucket_elements(bucket_size_mb)
        layout = build_layout(groups, topo.dp_size, topo.tp_rank, bucket,
                              per_group=self.rules.shard_params)
        if device is None:
            device = groups[0][0][1].device
        self.bufs = FlatBuffers(layout, self.rules, topo.dp_size, topo.dp_rank,
                                self.compute_dtype, device, offload=offload,
                                error_feedback=error_feedback and topo.dp_size > 1,
                                bucket=bucket, pin_states=offload_pin_memory)
        # ZeRO-Offload's copies between the device and the host states (None without it).
        self.host_copies = HostCopies(self.bufs, topo) if offload else None
        if self.bufs.device.type != "meta":
            self.bufs.materialize(values or _copy_values)
        self.bufs.bind(modules)
        self.counters = Counters()
        self.waits = WaitClock(self.bufs.device)
        self.reducer = GradReducer(self.bufs, topo, self.counters, waits=self.waits,
                                   dtype=grad_reduce_dtype)
        self.gatherer = (Stage3Gatherer(self.bufs, topo, self.counters, units, prefetch,
                                        on_backward=self.reducer.queue_end_of_backward,
                                        waits=self.waits, wire=weight_gather_dtype,
                                        # At dp 1 too, where it refuses (nothing to hold).
                                        secondary=secondary_group(topo, secondary_per_node)
                                        if secondary_per_node else None)
                         if self.rules.shard_params else None)
        if self.gatherer is not None:
            self.reducer.on_group_done = self.gatherer.free
        self._hooks: list = []
        self.install_hooks()

    @property
    def stage(self) -> int:
        return self.rules.stage

    def zero_grad(self) -> None:
        self.bufs.grad.zero_()

    # ---- the step --------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """The sums the step needs after the last backward: over dp (stages 0-1; stages 2-3
        reduced during backward), over tp where gradients are partial, over the tied embedding's
        copies; then the average over dp."""
        self.reducer.reduce_for_step()

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the reduced gradients (reduce.global_grad_norm); a collective."""
        return global_grad_norm(self.bufs, self.topo)

    @torch.no_grad()
    def refresh_compute(self) -> None:
        """Cast the updated masters into the compute copy; where the masters are sharded,
        all-gather the cast shards, one collective per segment in the compute dtype. (Stage 3
        casts from the masters whenever it gathers; under offload `host.send` does this.)"""
        bufs = self.bufs
        if bufs.compute is None:
            return
        if not bufs.rules.shard_optimizer:
            bufs.compute.copy_(bufs.master)
            return
        for seg in bufs.layout.segments:
            shard = bufs.state_view(bufs.master, seg).to(bufs.compute_dtype)
            full = bufs.compute[seg.full_off:seg.full_off + seg.padded]
            comm.all_gather_into_tensor(full, shard, self.topo.dp_group, "dp")

    # ---- state -----------------------------------------------------------------------------------
    def fragments(self) -> list:
        return state.fragments(self.bufs, self.topo)

    def load_state(self, master, optim) -> None:
        state.load_state(self.bufs, master, optim)

    def master_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 masters by local name (tp-local); a collective over dp."""
        return state.full_state(self.bufs, self.bufs.master, self.topo)

    def optim_state(self) -> dict[str, torch.Tensor]:
        """Full Adam moments, keys `exp_avg.NAME` / `exp_avg_sq.NAME`; a collective over dp."""
        return {**state.full_state(self.bufs, self.bufs.exp_avg, self.topo, "exp_avg."),
                **state.full_state(self.bufs, self.bufs.exp_avg_sq, self.topo, "exp_avg_sq.")}

    # ---- accounting ------------------------------------------------------------------------------
    def num_local_parameters(self) -> int:
        return sum(s.numel for s in self.bufs.layout.slots)

    def memory_report(self) -> dict:
        """Model-state bytes on the training device by category from the buffers, next to
        formula(); plus the transient terms of the step's peak (memory.py). Under offload,
        `measured["host"]` holds the host's bytes by category (formula: `["host"]`, the states),
        and `measured["host_pinned"]` the bytes of them allocated page-locked (on CUDA; what a
        CUDA run would pin, on the CPU)."""
        measured = self.bufs.nbytes()
        measured["total"] = sum(measured.values())
        host = self.bufs.host_nbytes()
        measured["host"] = {**host, "total": sum(host.values())}
        measured["host_pinned"] = self.bufs.pinned
        measured["gathered_peak"] = self.counters.gathered_peak
        measured["grad_staging_peak"] = self.counters.staging_peak
        measured["compute_grads_held"] = self.compute_grads_held()
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        bufs = self.bufs
        return {"stage": self.stage, "dp": self.topo.dp_size, "offload": bufs.offload,
                "psi": self.num_local_parameters(), "measured": measured,
                # The memory model the planner uses, on this rank's padded layout: equal to
                # `measured` by category (tests/parallel/test_zero.py), so the plan is what runs.
                "model": state_bytes(self.rules, bufs.layout.full_numel,
                                     bufs.layout.shard_numel, c, bufs.offload,
                                     bufs.chunk if bufs.offload else 0),
                "formula": formula(self.stage, self.num_local_parameters(), self.topo.dp_size, c,
                                   offload=bufs.offload)}

    def compute_grads_held(self) -> int:
        """Bound on the compute-dtype parameter gradients alive at once before the engine takes
        them. One parameter's at a time, except for a tied LM head and embedding on one stage
        (one Parameter used twice): autograd holds the head's share of the embedding gradient
        from the head's backward to the embedding's, then adds the embedding's share to it, so
        three embedding-sized gradients exist at that moment."""
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        largest = max(s.numel for s in self.bufs.layout.slots)
        tied_here = [s.numel for s in self.bufs.layout.slots
                     if s.spec.name == EMBEDDING and not s.spec.tied]
        return c * max([largest] + [3 * n for n in tied_here])

    def working_set_bound(self) -> int:
        """Stage 3's gathered bytes can reach: the two largest units (current + prefetched) and
        the group of a tied embedding, which its LM head uses again."""
        if self.gatherer is None:
            return 0
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        size = {g.index: g.padded for g in self.bufs.layout.groups if g.segments}
        per_unit = sorted((sum(size[g] for g in u.groups) for u in self.gatherer.units),
                          reverse=True)
        used = [g for u in self.gatherer.units for g in u.groups]
        shared = sum(size[g] for g in set(used) if used.count(g) > 1)
        return c * (sum(per_unit[:2]) + shared)

    def install_hooks(self) -> None:
        """The gradient hooks on the parameters and stage 3's gather hooks on the units."""
        self.remove_hooks()
        self._hooks = self.reducer.hooks() + (self.gatherer.hooks() if self.gatherer else [])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _copy_values(param: nn.Parameter, spec, start: int, out: torch.Tensor) -> None:
    """Default first values: the parameter's own (a module built on a device)."""
    out.copy_(param.detach().reshape(-1)[start:start + out.numel()])
