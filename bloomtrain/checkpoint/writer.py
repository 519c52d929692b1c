"""Writing checkpoints: every rank writes its own fragments, rank 0 commits the step.

The commit (manifest, renames, `latest`) is what makes a step visible, and it happens only once
every rank's files are complete; see the package docstring for the atomicity and async rules.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bloomtrain.checkpoint.format import (FORMAT, FORMAT_VERSION, MODEL_KINDS, OPTIM_KINDS,
                                          CheckpointError, prune, sha256_file, step_dir_name,
                                          verify)
from bloomtrain.checkpoint.fragments import Fragment, full_fragments
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.safetensors_io import write_safetensors_streaming
from bloomtrain.utils import atomic_output, fsync_dir


def _write_shard(tmp: Path, rank: int, fragments: list[Fragment]) -> tuple[dict, list[dict]]:
    """Write this rank's fragments into model-/optim- files under `tmp`. Returns (file info,
    fragment index entries)."""
    groups = {"model": {}, "optim": {}}
    index = []
    for i, frag in enumerate(fragments):
        keys = {}
        for kind, t in frag.tensors.items():
            key = f"{kind}/{frag.name}/{rank}.{i}"
            groups["model" if kind in MODEL_KINDS else "optim"][key] = t.detach().reshape(-1)
            keys[kind] = key
        index.append({
            "name": frag.name, "shape": list(frag.shape), "tp_dim": frag.tp_dim,
            "tp_rank": frag.tp_rank, "tp_size": frag.tp_size, "offset": frag.offset,
            "numel": frag.numel,
            "dtypes": {kind: str(t.dtype).removeprefix("torch.")
                       for kind, t in frag.tensors.items()},
            "keys": keys,
        })
    files = {}
    for prefix, tensors in groups.items():
        if not tensors:
            continue
        name = f"{prefix}-{rank:05d}.safetensors"
        entries = [(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), (lambda t=t: t))
                   for key, t in tensors.items()]
        # Straight to disk inside the temporary checkpoint directory, hashed on the way.
        sha, size = write_safetensors_streaming(tmp / name, entries, {"format": "pt"})
        files[name] = {"sha256": sha, "bytes": size}
        for entry in index:
            for kind, key in entry["keys"].items():
                if key in tensors:
                    entry.setdefault("files", {})[kind] = name
    return files, index


class CheckpointWriter:
    """Writes checkpoints from every rank of a job. Collective: all ranks call `save` together.

    `group` is used for the commit (gather of file info, barriers). Created here as a separate
    gloo group when torch.distributed is initialized, so async commits never share a process
    group with training collectives.

    `single_process`: write as rank 0 of 1 with no group even inside a distributed job, for a
    save one process makes alone (`save_checkpoint`); creating the group is itself collective
    and would wait for ranks that never come."""

    def __init__(self, root: str | os.PathLike, async_save: bool = False, log=print,
                 single_process: bool = False):
        self.root = Path(root)
        self.async_save = async_save
        self.log = log
        distributed = dist.is_initialized() and not single_process
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._thread: threading.Thread | None = None
        self._pinned: dict = {}  # reused pinned host buffers of async saves from CUDA
        self._error: BaseException | None = None

    # Collectives of the commit, on the checkpoint group, through comm like every other.
    def _barrier(self) -> None:
        comm.barrier(self.group, "checkpoint")

    def _gather(self, obj) -> list | None:
        return comm.gather_object(obj, 0, self.group, "checkpoint")

    def _broadcast(self, obj):
        return comm.broadcast_object(obj, 0, self.group, "checkpoint")

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, step: int, fragments: list[Fragment], shape: BloomShape, meta: dict,
             rank_meta: dict | None = None, tokenizer=None, keep_last: int | None = None,
             async_save: bool | None = None, owned: bool = False) -> Path:
        """Save `fragments` (this rank's unique pieces, see full_fragments / the trainer) for
        `step`. `meta` (JSON) comes from rank 0; `rank_meta` (JSON, e.g. RNG) from every rank.
        `owned`: the fragment tensors are private copies nobody else modifies (as the
        optimizer's sharded_state() returns), so an async save needs only move them to CPU."""
        self.wait()
        final = self.root / step_dir_name(step)
        use_async = self.async_save if async_save is None else async_save
        copied = None
        if use_async:
            # Snapshot now: training goes on changing the parameters while the thread writes.
            fragments, copied = self._snapshot(fragments, owned)
        args = (step, fragments, shape, meta, rank_meta or {}, tokenizer, keep_last)
        if use_async:
            def run():
                try:
                    if copied is not None:
                        copied.synchronize()  # the device->host copies have landed
                    self._save(*args)
                except BaseException as e:  # surfaced by the next wait()
                    self._error = e
            self._thread = threading.Thread(target=run, name="bloomtrain-ckpt", daemon=True)
            self._thread.start()
        else:
            self._save(*args)
        return final

    def _snapshot(self, fragments: list[Fragment], owned: bool):
        """Host copies of `fragments` for an async save, and a CUDA event that marks them done
        (None on CPU). From CUDA the copies go into pinned buffers kept from one save to the next
        (the previous save has finished: save() waits first) with non_blocking copies, so the
        step does not stall on them; later kernels on the stream cannot overtake the copies, and
        the writing thread waits for the event before it reads."""
        on_cuda = any(t.is_cuda for f in fragments for t in f.tensors.values())
        if not on_cuda:
            return [dataclasses.replace(f, tensors={k: t.detach().to("cpu", copy=not owned)
                                                    for k, t in f.tensors.items()})
                    for f in fragments], None
        pinned, out = {}, []
        for i, f in enumerate(fragments):
            tensors = {}
            for k, t in f.tensors.items():
                key = (i, f.name, k)
                buf = self._pinned.get(key)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t.detach(), non_blocking=True)
                tensors[k] = pinned[key] = buf
            out.append(dataclasses.replace(f, tensors=tensors))
        self._pinned = pinned
        event = torch.cuda.Event()
        event.record()
        return out, event

    def _save(self, step, fragments, shape, meta, rank_meta, tokenizer, keep_last) -> None:
        root = self.root
        final = root / step_dir_name(step)
        tmp = root / f".{final.name}.tmp"
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a previous, killed attempt
            tmp.mkdir()
        self._barrier()
        try:
            files, index = _write_shard(tmp, self.rank, fragments) if fragments else ({}, [])
            report = {"ok": True, "files": files, "index": index, "rank_meta": rank_meta}
        except OSError as e:
            report = {"ok": False, "error": f"rank {self.rank}: {e}"}
        reports = self._gather(report)
        status = None
        if self.rank == 0:
            try:
                status = self._commit(step, tmp, final, reports, shape, meta, tokenizer, keep_last)
            except OSError as e:
                status = f"rank 0: {e}"
            except CheckpointError as e:
                status = str(e)
            if status is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        status = self._broadcast(status)
        if status is not None:
            raise CheckpointError(f"saving checkpoint {final} failed ({status}); the previous "
                                  f"checkpoint is intact. Free disk space or fix "
                                  f"checkpoint.dir, then resume")

    def _commit(self, step, tmp, final, reports, shape, meta, tokenizer, keep_last) -> str | None:
        errors = [r["error"] for r in reports if not r["ok"]]
        if errors:
            return "; ".join(errors)
        files, tensors, ranks = {}, {}, {}
        for rank, r in enumerate(reports):
            files.update(r["files"])
            ranks[str(rank)] = r["rank_meta"]
            for entry in r["index"]:
                t = tensors.setdefault(entry["name"], {"shape": entry["shape"], "fragments": []})
                t["fragments"].append({k: v for k, v in entry.items()
                                       if k not in ("name", "shape")})
        tokenizer_ref = None
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
            tokenizer_ref = "tokenizer"
            for f in sorted((tmp / "tokenizer").iterdir()):
                files[f"tokenizer/{f.name}"] = {"sha256": sha256_file(f),
                                                "bytes": f.stat().st_size}
        manifest = {
            **meta,
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "model_shape": dataclasses.asdict(shape),
            "tokenizer": tokenizer_ref,
            "files": files,
            "ranks": ranks,
            "tensors": tensors,
        }
        with atomic_output(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        fsync_dir(tmp)
        verify(tmp, manifest, check_sums=False)  # every fragment present, every file complete
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            # Re-saving a step: the old copy goes only once the new one is in. A kill between
            # the two renames leaves `.step_N.old`, which list_checkpoints still offers.
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(final.parent)
        with atomic_output(final.parent / "latest", "w") as f:
            f.write(final.name + "\n")
        if keep_last:
            prune(final.parent, keep_last)
        self.log(f"[checkpoint] saved {final}")
        return None


def save_checkpoint(root: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    shape: BloomShape, optim_state: dict[str, torch.Tensor] | None = None,
                    meta: dict[str, Any] | None = None, tokenizer=None,
                    keep_last: int | None = None) -> Path:
    """Single-process save of full tensors: `model_state` by HF name, `optim_state` as
    `exp_avg.NAME` / `exp_avg_sq.NAME`. Used by import-hf and tests; training uses
    CheckpointWriter directly."""
    frags = full_fragments(model_state, "model")
    if optim_state:
        by_name = {f.name: f for f in frags}
        for key, t in optim_state.items():
            kind, _, name = key.partition(".")
            if kind not in OPTIM_KINDS or name not in by_name:
                raise ValueError(f"unexpected optimizer state key {key}")
            by_name[name].tensors[kind] = t.detach().reshape(-1)
    writer = CheckpointWriter(root, async_save=False, log=lambda *_: None, single_process=True)
    return writer.save(step, frags, shape, meta or {}, tokenizer=tokenizer, keep_last=keep_last)
