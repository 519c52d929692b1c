"""Live tensor memory over a region of code, by category, measured independently of any formula.

`LiveMemory` is a TorchDispatchMode: after every op it notes the storages of the op's outputs and
sums the current size of every storage still alive (storages are held weakly, so a freed tensor
drops out; a storage resized to 0, as ZeRO-3 frees a gathered unit, counts 0). Peaks are taken over
that running total. Memory created outside the region counts only if `register`ed.

Categories come from where memory appears, not from the engine's own accounting:
- parameters: storages of the module parameters (ZeRO-3's gathered units included) and whatever is
  registered as parameters (a flat compute buffer);
- gradients: tensors autograd hands to a parameter (its compute-dtype gradient), everything
  allocated while a parameter's post-accumulate-grad hooks run (accumulation, staging and
  reduction buffers), and what is registered as gradients;
- optimizer: what is registered as optimizer state;
- activations: allocated in the forward phase;
- temporaries: anything else allocated in the backward or step phase.

    mem = LiveMemory()
    mem.watch_parameters(model)        # before the optimizer registers its own grad hooks
    opt = make_optimizer(model)
    mem.close_grad_window(model)        # after them
    mem.register(opt.master, "optimizer") ...
    with mem:
        with mem.phase("forward"): loss = model(x)
        with mem.phase("backward"): loss.backward()
        with mem.phase("step"): opt.step()
    mem.report()
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
_PHASE_CATEGORY = {"forward": "activations", "backward": "temporaries", "step": "temporaries",
                   "setup": "temporaries"}


class LiveMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._storages = WeakIdKeyDictionary()  # UntypedStorage -> category
        self._phase = "setup"
        self._in_grad_hooks = 0
        self.peak = 0
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_phase = "setup"
        self.category_peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        # Every update's per-category bytes and phase, and at which update each storage was
        # made. A gradient autograd hands to a parameter is filed under gradients only when
        # its hook runs, some ops after the one that made it (the node's other outputs first;
        # zb-h1's first stage hands its B's gradients at its W): it was one all along, so the
        # updates since are refiled and the peaks taken again.
        self._history: list[tuple[dict[str, int], str]] = []
        self._made_at: dict[int, int] = {}

    # ---- what is what --------------------------------------------------------------------------
    def register(self, tensors, category: str) -> None:
        assert category in CATEGORIES, category
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            self._storages[t.untyped_storage()] = category

    def watch_parameters(self, module: torch.nn.Module) -> None:
        """Call before any other hooks are put on the parameters: marks each gradient autograd
        produces for a parameter as gradients, and opens the window in which a parameter's
        post-accumulate-grad hooks allocate gradient memory."""
        for p in module.parameters():
            p.register_hook(self._mark_gradient)
            p.register_post_accumulate_grad_hook(self._open_window)

    def close_grad_window(self, module: torch.nn.Module) -> None:
        """Call after the optimizer has registered its hooks: closes the window, and marks the
        storages the parameters now live in (an optimizer may have moved them into flat
        buffers) as parameters."""
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._close_window)
            self.register(p, "parameters")

    def _mark_gradient(self, grad):
        if grad is not None:  # None: a gradient left for later (zb-h1's B defers the weights')
            st = grad.untyped_storage()
            was = self._storages.get(st)
            self._storages[st] = "gradients"
            if was not in (None, "gradients"):
                self._refile(id(st), was, st.nbytes())
        return grad

    def _refile(self, storage_id: int, was: str, nbytes: int) -> None:
        """Take the updates since `storage_id` was made again, its bytes under gradients."""
        start = self._made_at.get(storage_id)
        if start is None:
            return
        for now, _ in self._history[start:]:
            now[was] -= nbytes
            now["gradients"] += nbytes
        self.peak, self.at_peak, self.peak_phase = 0, dict.fromkeys(CATEGORIES, 0), "setup"
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)
        for now, phase in self._history:
            self._apply(now, phase)

    def _open_window(self, p):
        self._in_grad_hooks += 1

    def _close_window(self, p):
        self._in_grad_hooks -= 1

    @contextlib.contextmanager
    def phase(self, name: str):
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev
            self._update()

    # ---- measuring -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = "gradients" if self._in_grad_hooks else _PHASE_CATEGORY[self._phase]
        made = set()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self._storages:
                    self._storages[st] = category
                    made.add(id(st))
        self._update(made)
        return out

    def current(self) -> dict[str, int]:
        now = dict.fromkeys(CATEGORIES, 0)
        for st, category in list(self._storages.items()):
            now[category] += st.nbytes()
        return now

    def _update(self, made: frozenset | set = frozenset()) -> None:
        now = self.current()
        for storage_id in made:
            self._made_at[storage_id] = len(self._history)
        self._history.append((dict(now), self._phase))
        self._apply(now, self._phase)

    def _apply(self, now: dict[str, int], phase: str) -> None:
        total = sum(now.values())
        for c in CATEGORIES:
            self.category_peaks[c] = max(self.category_peaks[c], now[c])
        if total > self.peak:
            self.peak, self.at_peak, self.peak_phase = total, dict(now), phase

    def report(self) -> dict:
        return {"peak": self.peak, "peak_phase": self.peak_phase, "at_peak": dict(self.at_peak),
                "category_peaks": dict(self.category_peaks)}
