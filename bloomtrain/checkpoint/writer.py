"""Writing checkpoints: every rank writes its own fragments into `.step_N.tmp/`; rank 0 gathers
the file checksums and the fragment index, writes the manifest, renames the directory into place
and only then updates `latest`. A crash, a kill or a full disk at any moment leaves the previous
checkpoint valid, and `find_latest_valid` skips anything incomplete or corrupt.

A failed save (a full disk on any rank, most often) is collective: every rank ends in the same
broadcast of rank 0's verdict and raises the same CheckpointSaveError, the temporary directory
is removed, and `latest` keeps naming the previous checkpoint. What the trainer does next is
`checkpoint.on_save_error` (bloomtrain.train.checkpointing).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bloomtrain.checkpoint.format import (FORMAT, FORMAT_VERSION, MANIFEST_DIGEST, MODEL_KINDS,
                                          OPTIM_KINDS, CheckpointError, manifest_digest, prune,
                                          sha256_file, step_dir_name, verify)
from bloomtrain.checkpoint.fragments import Deferred, Fragment, full_fragments
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.memory import pinned_size
from bloomtrain.safetensors_io import write_safetensors_streaming
from bloomtrain.files import atomic_output, disk_space, fsync_dir, is_disk_full
from bloomtrain.planner.host import available_host_memory


class CheckpointSaveError(CheckpointError):
    """A save that failed on some rank; raised on every rank alike. Nothing of it is left
    behind and the previous checkpoint is still the latest."""


# The most of the host's available memory (its rank's share of it) an async save's snapshot may
# take; past it the save is synchronous (CheckpointWriter._snapshot_fits).
SNAPSHOT_HOST_SHARE = 0.8


def snapshot_bytes(fragments: list[Fragment], pinned: dict) -> int:
    """Host bytes an async save's snapshot of `fragments` would allocate: a copy of every
    tensor (from the GPU into page-locked memory, which torch's allocator rounds up to a power of
    two: pinned_size), less the `pinned` buffers kept from the previous save (by (index, name,
    kind)) that it reuses."""
    need = 0
    for i, f in enumerate(fragments):
        for k, t in f.tensors.items():
            if isinstance(t, Deferred):
                continue
            n = t.numel() * t.element_size()
            if t.is_cuda:
                buf = pinned.get((i, f.name, k))
                if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                    continue
                n = pinned_size(n)
            need += n
    return need


def _fmt_mib(num_bytes: int) -> str:
    return f"{num_bytes / 2 ** 20:.1f} MiB"


def _write_shard(tmp: Path, rank: int, fragments: list[Fragment]) -> tuple[dict, list[dict]]:
    """Write this rank's fragments into model-/optim- files under `tmp`. Returns (file info,
    fragment index entries)."""
    groups = {"model": {}, "optim": {}}
    index = []
    for i, frag in enumerate(fragments):
        keys = {}
        for kind, t in frag.tensors.items():
            key = f"{kind}/{frag.name}/{rank}.{i}"
            flat = t if isinstance(t, Deferred) else t.detach().reshape(-1)
            groups["model" if kind in MODEL_KINDS else "optim"][key] = flat
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
        entries = [(key, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                    t.materialize if isinstance(t, Deferred) else (lambda t=t: t))
                   for key, t in tensors.items()]
        # Straight to disk inside the temporary checkpoint directory, hashed on the way.
        try:
            sha, size = write_safetensors_streaming(tmp / name, entries, {"format": "pt"})
        except OSError as e:
            # A failed write() carries no file name; the report names it.
            raise OSError(e.errno, f"{e.strerror or e} writing {tmp / name}") from e
        files[name] = {"sha256": sha, "bytes": size}
        for entry in index:
            for kind, key in entry["keys"].items():
                if key in tensors:
                    entry.setdefault("files", {})[kind] = name
    return files, index


@contextlib.contextmanager
def _left_clean(root: Path, final: Path, alone: bool):
    """Alone (one process: an import), a Ctrl-C'd save leaves nothing behind: its temporary
    directory, and the root if the save made it. A job's ranks leave theirs to the next save."""
    existed = root.exists()
    try:
        yield
    except KeyboardInterrupt:
        if alone:
            shutil.rmtree(root / f".{final.name}.tmp", ignore_errors=True)
            if not existed:
                with contextlib.suppress(OSError):
                    root.rmdir()  # only if empty
        raise


class CheckpointWriter:
    """Writes checkpoints from every rank of a job. Collective: all ranks call `save` together.

    `async_save`: the state is copied to CPU memory on the training thread, then a background
    thread writes the files and commits; a later save, or `wait`, waits for the previous one and
    re-raises its error. `group` is used for the commit (gather of file info, broadcasts of the
    outcome). Created here as a separate gloo group when torch.distributed is initialized, so
    async commits never share a process group with training collectives.

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
        # Step directories resume=auto skipped as corrupt: not counted by keep_last, which
        # would otherwise keep them and delete a good one.
        self.unusable: set[str] = set()

    # Collectives of the commit, on the checkpoint group, through comm like every other.
    def _gather(self, obj) -> list | None:
        return comm.gather_object(obj, 0, self.group, "checkpoint")

    def _broadcast(self, obj):
        return comm.broadcast_object(obj, 0, self.group, "checkpoint")

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error."""
        if self._thread is not None:
            with comm.INFLIGHT.long_phase("checkpoint write"):
                self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, step: int, fragments: list[Fragment], shape: BloomShape, meta: dict,
             rank_meta: dict | None = None, tokenizer=None, keep_last: int | None = None,
             async_save: bool | None = None) -> Path:
        """Save `fragments` (this rank's unique pieces, see full_fragments / the trainer) for
        `step`. `meta` (JSON) comes from rank 0; `rank_meta` (JSON, e.g. RNG) from every rank.
        The fragments may be views of live training state: an async save copies them to the
        host before it returns (where the host has room, else it saves synchronously)."""
        self.wait()
        final = self.root / step_dir_name(step)
        use_async = self.async_save if async_save is None else async_save
        copied = None
        if use_async and not self._snapshot_fits(step, fragments):
            use_async = False
        if use_async:
            # Snapshot now: training goes on changing the parameters while the thread writes.
            fragments, copied = self._snapshot(fragments)
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
            with _left_clean(self.root, final, self.world == 1), \
                    comm.INFLIGHT.long_phase("checkpoint write"):
                self._save(*args)
        return final

    def _snapshot_fits(self, step: int, fragments: list[Fragment]) -> bool:
        """Whether the host can hold an async save's snapshot (up to SNAPSHOT_HOST_SHARE of its
        available memory). A rank whose cannot saves this step synchronously, from the live
        state, and says so: a snapshot of an offloaded optimizer's states is as large as the
        states (12 bytes per parameter), which a host sized for them does not have twice."""
        need = snapshot_bytes(fragments, self._pinned)
        if need == 0:
            return True
        avail, source = available_host_memory()
        # The node's ranks snapshot at once: each may take its share.
        avail //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if need <= SNAPSHOT_HOST_SHARE * avail:
            return True
        self.log(f"[checkpoint] step {step}: an async save's snapshot needs {_fmt_mib(need)} of "
                 f"host memory and {_fmt_mib(avail)} is available ({source}): rank {self.rank} "
                 f"saves this step synchronously instead (training waits for its write)")
        return False

    def _snapshot(self, fragments: list[Fragment]):
        """Host copies of `fragments` for an async save, and a CUDA event that marks them done
        (None on CPU). From CUDA the copies go into pinned buffers kept from one save to the next
        (the previous save has finished: save() waits first) with non_blocking copies, so the
        step does not stall on them; later kernels on the stream cannot overtake the copies, and
        the writing thread waits for the event before it reads."""
        on_cuda = any(t.is_cuda for f in fragments for t in f.tensors.values())
        if not on_cuda:
            return [dataclasses.replace(f, tensors={k: t.detach().to("cpu", copy=True)
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
        # Whatever fails, and on whichever rank, every rank goes through the same collectives
        # (broadcast, gather, broadcast) and raises the same error: a rank that failed alone
        # must neither leave the others waiting nor let them believe the step committed.
        status = None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                # Saves cut short (a kill, a second Ctrl-C) leave their temporary directories,
                # which no reader takes up; one save writes at a time, so any found is stale.
                for stale in root.glob(".step_*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                # Not a full disk (a file in the way, a read-only or missing place): no advice
                # to free space.
                status = (save_failure(final, tmp, f"rank 0: creating {tmp}: {e}")
                          if is_disk_full(e) else
                          f"saving checkpoint {final} failed: cannot create {tmp} "
                          f"({e.strerror or e}); write to a directory that can be created "
                          f"(training: checkpoint.dir; an import: its --output)")
        # Also the barrier: no rank writes before the directory exists.
        status = self._broadcast(status)
        if status is None:
            num_bytes = sum(t.numel() * t.element_size()
                            for f in fragments for t in f.tensors.values())
            try:
                files, index = _write_shard(tmp, self.rank, fragments) if fragments else ({}, [])
                report = {"ok": True, "files": files, "index": index, "rank_meta": rank_meta,
                          "bytes": num_bytes}
            except Exception as e:  # reported, so that the others do not wait for this rank
                report = {"ok": False, "error": f"rank {self.rank}: {e}", "bytes": num_bytes,
                          "errno": getattr(e, "errno", None)}
            reports = self._gather(report)
            if self.rank == 0:
                needed = sum(r["bytes"] for r in reports)
                status = self._commit(step, tmp, final, reports, shape, meta, tokenizer,
                                      keep_last, needed)
            status = self._broadcast(status)
        if status is not None:
            raise CheckpointSaveError(status)

    def _commit(self, step, tmp, final, reports, shape, meta, tokenizer, keep_last,
                needed) -> str | None:
        """Rank 0: make the step visible, or, if any rank failed or the commit itself fails,
        remove what was written and return the failure's message (never raise: the other
        ranks wait for it)."""
        errors = [r["error"] for r in reports if not r["ok"]]
        if errors:
            codes = {r.get("errno") for r in reports if not r["ok"]}
            return save_failure(final, tmp, "; ".join(errors), needed, codes)
        try:
            self._commit_files(step, tmp, final, reports, shape, meta, tokenizer)
        except Exception as e:
            return save_failure(final, tmp, f"rank 0: {e}", needed, {getattr(e, "errno", None)})
        self.unusable.discard(final.name)  # saved again: good now
        if keep_last:
            prune(final.parent, keep_last, step, unusable=self.unusable)
        self.log(f"[checkpoint] saved {final}")
        return None

    def _commit_files(self, step, tmp, final, reports, shape, meta, tokenizer) -> None:
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
        with atomic_output(tmp / MANIFEST_DIGEST, "w") as f:
            f.write(manifest_digest(tmp / "manifest.json"))
        fsync_dir(tmp)
        verify(tmp, manifest, check_sums=False)  # every fragment present, every file complete
        old = final.with_name(f".{final.name}.old")
        displaced = final.exists()
        if displaced:
            # Re-saving a step: the old copy goes only once the new one is in. A kill between
            # the two renames leaves `.step_N.old`, which list_checkpoints still offers.
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        try:
            fsync_dir(final.parent)
            with atomic_output(final.parent / "latest", "w") as f:
                f.write(final.name + "\n")
        except BaseException:
            # `latest` could not be written (a disk full to the last block): take the new step
            # back out, so that no reader, find_latest_valid included, takes up a step this
            # save reports as failed; a re-saved step gets its previous copy back.
            shutil.rmtree(final, ignore_errors=True)
            if displaced:
                os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)


def save_failure(final: Path, tmp: Path, error: str, needed: int | None = None,
                 codes: set | None = None) -> str:
    """Rank 0, after a failed save: remove its partial files, then say what failed, where,
    how much space is left (after the removal: what a retry has) and which checkpoint is
    still the latest. The advice follows the errors' `codes` (errno values): free space
    for a full disk, else what those errors ask for."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        latest = (f"the latest checkpoint is still "
                  f"{final.parent / (final.parent / 'latest').read_text().strip()}")
    except OSError:
        latest = "there is no earlier checkpoint"
    size = "" if needed is None else f"; its tensors take {_fmt_mib(needed)}"
    where = "(training: checkpoint.dir; an import: its --output)"
    codes = codes or {None}
    if errno.EFBIG in codes:
        fix = (f"A file was over the file-size limit of this process or filesystem "
               f"(`ulimit -f`; FAT32 ends at 4 GiB): raise the limit, or write to "
               f"another filesystem {where}")
    elif codes <= {None, errno.ENOSPC, errno.EDQUOT}:
        fix = f"Free disk space, or write to a writable filesystem with room for it {where}"
    else:
        fix = f"Fix what the error says, or write to another place {where}"
    return (f"saving checkpoint {final} failed ({error}); {disk_space(final.parent)}{size}. "
            f"Its partial files were removed and {latest}. {fix}")


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
