"""bloomtrain checkpoints: sharded, topology-independent, atomic.

    CKPT_ROOT/
      latest                         name of the newest complete checkpoint (updated last)
      step_00000100/
        manifest.json                format, step, model shape, topology, train state, optimizer
                                     scalars, loss scaler, per-rank RNG, config, tokenizer
                                     reference, sha256 + size of every file, and the fragment
                                     index (below)
        model-00000.safetensors      fp32 master weights (or imported weights, in their dtype)
        optim-00000.safetensors      AdamW moments: exp_avg, exp_avg_sq
        ...                          one model-/optim- pair per rank that holds unique data
        tokenizer/                   the run's tokenizer files, when it had one

**Logical coordinates.** Every rank writes only what it holds, without gathering anything. Each
stored tensor is a *fragment* of a full (unsharded) parameter, and the manifest says which:
`tensors[NAME].fragments` lists `{file, keys, tp_dim, tp_rank, tp_size, offset, numel}`: the
fragment is elements [offset, offset + numel) of the flattened tp chunk number `tp_rank` of
`tp_size` along `tp_dim` of the full parameter (tp_size 1: the full parameter itself). That is
enough to rebuild every full parameter, and from it any other layout's shards, whatever tp, pp,
dp or ZeRO stage wrote it: there is no "universal checkpoint" conversion step.

**Atomicity.** All ranks write into `.step_N.tmp/`; rank 0 gathers the file checksums and the
fragment index, writes the manifest, renames the directory into place and only then updates
`latest`. A crash, a kill or a full disk at any moment leaves the previous checkpoint valid, and
`find_latest_valid` skips anything incomplete or corrupt (missing files, wrong sizes, checksums).

**Async saving** (`checkpoint.async_save`, on by default): the state is copied to CPU memory on the
training thread, then a background thread writes the files and commits. The commit's gather and
barrier run on a separate gloo process group, so they never interleave with training collectives
on the main groups; this is why it is safe with both gloo and NCCL. A later save, or the end of
training, waits for the previous one and re-raises its error, if any.

**Nothing is unpickled on load**: tensors come from safetensors and everything else from JSON.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors import safe_open

from bloomtrain.model.presets import BloomShape
from bloomtrain.safetensors_io import write_safetensors_streaming
from bloomtrain.utils import UserError, atomic_output, fsync_dir

FORMAT = "bloomtrain-checkpoint"
FORMAT_VERSION = 2
MODEL_KINDS = ("model",)
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
TIED_ALIAS = {"lm_head.weight": "transformer.word_embeddings.weight"}
_STEP_DIR = re.compile(r"^step_(\d+)$")
_DISPLACED_DIR = re.compile(r"^\.step_(\d+)\.old$")


class CheckpointError(UserError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---- fragments ---------------------------------------------------------------------------------

def full_fragments(state: dict[str, torch.Tensor], kind: str = "model") -> list[dict]:
    """Fragments for full (unsharded) tensors, as a single process writes them."""
    out = []
    for name, t in state.items():
        if name in TIED_ALIAS:
            continue  # the tied head is the embedding
        out.append({"name": name, "shape": list(t.shape), "tp_dim": None, "tp_rank": 0,
                    "tp_size": 1, "offset": 0, "numel": t.numel(),
                    "tensors": {kind: t.detach().reshape(-1)}})
    return out


def _write_shard(tmp: Path, rank: int, fragments: list[dict]) -> tuple[dict, list[dict]]:
    """Write this rank's fragments into model-/optim- files under `tmp`. Returns (file info,
    fragment index entries)."""
    groups = {"model": {}, "optim": {}}
    index = []
    for i, frag in enumerate(fragments):
        keys = {}
        for kind, t in frag["tensors"].items():
            key = f"{kind}/{frag['name']}/{rank}.{i}"
            groups["model" if kind in MODEL_KINDS else "optim"][key] = t.detach().reshape(-1)
            keys[kind] = key
        entry = {k: frag[k] for k in ("name", "shape", "tp_dim", "tp_rank", "tp_size", "offset",
                                      "numel")}
        entry["dtypes"] = {kind: str(t.dtype).removeprefix("torch.")
                           for kind, t in frag["tensors"].items()}
        entry["keys"] = keys
        index.append(entry)
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


# ---- writing -----------------------------------------------------------------------------------

class CheckpointWriter:
    """Writes checkpoints from every rank of a job. Collective: all ranks call `save` together.

    `group` is used for the commit (gather of file info, barriers). Created here as a separate
    gloo group when torch.distributed is initialized, so async commits never share a process
    group with training collectives."""

    def __init__(self, root: str | os.PathLike, async_save: bool = False, log=print):
        self.root = Path(root)
        self.async_save = async_save
        self.log = log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # Collective helpers on the checkpoint group.
    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _gather(self, obj) -> list | None:
        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def _broadcast(self, obj):
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, step: int, fragments: list[dict], shape: BloomShape, meta: dict,
             rank_meta: dict | None = None, tokenizer=None, keep_last: int | None = None,
             async_save: bool | None = None, owned: bool = False) -> Path:
        """Save `fragments` (this rank's unique pieces, see full_fragments / the trainer) for
        `step`. `meta` (JSON) comes from rank 0; `rank_meta` (JSON, e.g. RNG) from every rank.
        `owned`: the fragment tensors are private copies nobody else modifies (as the
        optimizer's sharded_state() returns), so an async save needs only move them to CPU."""
        self.wait()
        final = self.root / step_dir_name(step)
        use_async = self.async_save if async_save is None else async_save
        if use_async:
            # Snapshot now: training goes on changing the parameters while the thread writes.
            fragments = [{**f, "tensors": {k: t.detach().to("cpu", copy=not owned)
                                           for k, t in f["tensors"].items()}}
                         for f in fragments]
        args = (step, fragments, shape, meta, rank_meta or {}, tokenizer, keep_last)
        if use_async:
            def run():
                try:
                    self._save(*args)
                except BaseException as e:  # surfaced by the next wait()
                    self._error = e
            self._thread = threading.Thread(target=run, name="bloomtrain-ckpt", daemon=True)
            self._thread.start()
        else:
            self._save(*args)
        return final

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
            "model_shape": asdict(shape),
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
        by_name = {f["name"]: f for f in frags}
        for key, t in optim_state.items():
            kind, _, name = key.partition(".")
            if kind not in OPTIM_KINDS or name not in by_name:
                raise ValueError(f"unexpected optimizer state key {key}")
            by_name[name]["tensors"][kind] = t.detach().reshape(-1)
    writer = CheckpointWriter.__new__(CheckpointWriter)
    writer.root, writer.async_save, writer.log = Path(root), False, (lambda *_: None)
    writer.rank, writer.world, writer.group = 0, 1, None
    writer._thread, writer._error = None, None
    writer._save(step, frags, shape, meta or {}, {}, tokenizer, keep_last)
    return Path(root) / step_dir_name(step)


def prune(root: Path, keep_last: int) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


# ---- reading -----------------------------------------------------------------------------------

def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out, displaced = {}, {}
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
        m = _DISPLACED_DIR.match(p.name)
        if m and p.is_dir():
            displaced[int(m.group(1))] = p
    # A re-save killed between its two renames: the previous copy of the step is still whole.
    for step, p in displaced.items():
        out.setdefault(step, p)
    return sorted(out.items())


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{path} is not a bloomtrain checkpoint (no manifest.json)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf} is corrupt: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mf} is not a bloomtrain checkpoint manifest")
    version = manifest.get("format_version", 0)
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer bloomtrain (format {version}); "
                              f"upgrade bloomtrain to load it")
    if version < FORMAT_VERSION:
        raise CheckpointError(f"{path} uses checkpoint format {version}, which this bloomtrain "
                              f"no longer reads; export it with the bloomtrain that wrote it")
    return manifest


def verify(path: str | os.PathLike, manifest: dict | None = None, check_sums: bool = True,
           files: list[str] | None = None) -> dict[str, Any]:
    """Check files (all, or `files`) against the manifest: present, right size and, with
    `check_sums`, right sha256; and that the fragment index covers every tensor. Raises
    CheckpointError."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    for name in files if files is not None else manifest["files"]:
        info = manifest["files"].get(name)
        f = path / name
        if info is None or not f.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} is truncated or altered "
                                  f"({f.stat().st_size} bytes, manifest says {info['bytes']})")
        if check_sums and sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"{path}: file {name} fails its checksum")
    for name, t in manifest.get("tensors", {}).items():
        numel = 1
        for d in t["shape"]:
            numel *= d
        sizes = {f["tp_size"] for f in t["fragments"]}
        if len(sizes) != 1:
            raise CheckpointError(f"{path}: {name} mixes tp sizes {sorted(sizes)}")
        (tp_size,) = sizes
        chunks: dict[int, int] = {}
        for f in t["fragments"]:
            chunks[f["tp_rank"]] = chunks.get(f["tp_rank"], 0) + f["numel"]
        if sorted(chunks) != list(range(tp_size)) or \
                any(n != numel // tp_size for n in chunks.values()):
            raise CheckpointError(f"{path}: the fragments of {name} do not cover it; the "
                                  f"checkpoint is incomplete")
    return manifest


def find_latest_valid(root: str | os.PathLike, log=print) -> Path | None:
    """The newest checkpoint under `root` that verifies. Incomplete or corrupt ones are reported
    and skipped, so a crash during a save falls back to the previous checkpoint."""
    for _, path in reversed(list_checkpoints(root)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            log(f"[checkpoint] skipping {path.name}: {e}")
    return None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from either itself or a root holding `latest` / step_* dirs."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if (path / "latest").is_file():
        cand = path / (path / "latest").read_text().strip()
        if (cand / "manifest.json").is_file():
            return cand
    found = find_latest_valid(path, log=lambda *_: None)
    if found is None:
        raise CheckpointError(f"no bloomtrain checkpoint found at {path}")
    return found


class CheckpointReader:
    """Reads full parameters (and optimizer moments) out of a checkpoint of any layout, one
    parameter at a time: `load(name, kind)` assembles the fragments of `name`."""

    def __init__(self, path: str | os.PathLike, kinds: tuple[str, ...] = MODEL_KINDS,
                 check_sums: bool = True):
        self.path = resolve(path)
        self.manifest = read_manifest(self.path)
        self.shape = BloomShape(**self.manifest["model_shape"])
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        needed = {fr["files"][k] for t in self.tensors.values() for fr in t["fragments"]
                  for k in kinds if k in fr.get("files", {})}
        verify(self.path, self.manifest, check_sums=check_sums, files=sorted(needed))
        self._handles: dict[str, Any] = {}

    def has(self, kind: str) -> bool:
        return any(kind in fr["keys"] for t in self.tensors.values() for fr in t["fragments"])

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str, kind: str = "model") -> torch.dtype:
        return getattr(torch, self.tensors[name]["fragments"][0]["dtypes"][kind])

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def _file(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
        return self._handles[fname]

    def load(self, name: str, kind: str = "model") -> torch.Tensor:
        name = TIED_ALIAS.get(name, name)
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        t = self.tensors[name]
        shape = tuple(t["shape"])
        full = torch.empty(shape, dtype=self.dtype(name, kind))
        frags = t["fragments"]
        tp_size = frags[0]["tp_size"]
        dim = frags[0]["tp_dim"]
        chunks = (full.chunk(tp_size, dim) if tp_size > 1 else (full,))
        locals_ = [torch.empty(c.numel(), dtype=full.dtype) for c in chunks]
        for fr in frags:
            if kind not in fr["keys"]:
                raise CheckpointError(f"{self.path}: {name} has no {kind} state")
            data = self._file(fr["files"][kind]).get_tensor(fr["keys"][kind])
            locals_[fr["tp_rank"]][fr["offset"]:fr["offset"] + fr["numel"]].copy_(data)
        for c, loc in zip(chunks, locals_):
            c.copy_(loc.view(c.shape))
        return full

    def load_tp_shard(self, name: str, kind: str, tp_rank: int, tp_size: int,
                      tp_dim: int | None) -> torch.Tensor:
        """This tp rank's chunk of `name` along `tp_dim`. When the checkpoint was written with
        the same split, only that chunk's fragments are read; otherwise the full parameter is
        assembled once and cut."""
        name = TIED_ALIAS.get(name, name)
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        if tp_dim is None or tp_size == 1:
            return self.load(name, kind)
        frags = t["fragments"]
        if frags[0]["tp_size"] == tp_size and frags[0]["tp_dim"] == tp_dim:
            shape = list(t["shape"])
            shape[tp_dim] //= tp_size
            flat = torch.empty(math.prod(shape), dtype=self.dtype(name, kind))
            for fr in frags:
                if fr["tp_rank"] == tp_rank:
                    data = self._file(fr["files"][kind]).get_tensor(fr["keys"][kind])
                    flat[fr["offset"]:fr["offset"] + fr["numel"]].copy_(data)
            return flat.view(shape)
        return self.load(name, kind).chunk(tp_size, tp_dim)[tp_rank].clone()

    def close(self) -> None:
        self._handles.clear()


class LazyState(Mapping):
    """A read-only mapping name -> tensor computed on access, so a consumer that walks the
    parameters one by one never holds more than one full parameter from the checkpoint."""

    def __init__(self, names: list[str], load: Callable[[str], torch.Tensor]):
        self._names, self._load = set(names), load
        self._last: tuple[str, torch.Tensor] | None = None  # consumers often read a name twice

    def __getitem__(self, name):
        if name not in self._names:
            raise KeyError(name)
        if self._last is None or self._last[0] != name:
            self._last = (name, self._load(name))
        return self._last[1]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def load_model_state(path: str | os.PathLike, verify_files: bool = True):
    """(shape, state_dict of full tensors, manifest) of the checkpoint at `path`."""
    reader = CheckpointReader(path, check_sums=verify_files)
    state = {n: reader.load(n) for n in reader.names()}
    return reader.shape, state, reader.manifest
