"""The on-disk checkpoint format: names, the manifest, verification and finding checkpoints.

Everything here works on directories and JSON alone, so the writer and the reader both build on
it without depending on each other.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from bloomtrain.model.params import EMBEDDING, LM_HEAD
from bloomtrain.utils import UserError

FORMAT = "bloomtrain-checkpoint"
FORMAT_VERSION = 2
MODEL_KINDS = ("model",)
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
TIED_ALIAS = {LM_HEAD: EMBEDDING}  # the tied LM head is stored once, as the embedding
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


def find_latest_valid(root: str | os.PathLike, log=print,
                      check_sums: bool = True) -> Path | None:
    """The newest checkpoint under `root` that verifies. Incomplete or corrupt ones are reported
    and skipped, so a crash during a save falls back to the previous checkpoint. Without
    `check_sums` only the manifest, the fragment index and the file sizes are checked, no data
    file is read: a quick look at a large checkpoint (`bloomtrain status`)."""
    for _, path in reversed(list_checkpoints(root)):
        try:
            verify(path, check_sums=check_sums)
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


def prune(root: Path, keep_last: int) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
