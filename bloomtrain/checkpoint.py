"""bloomtrain checkpoints: a directory of safetensors files plus a JSON manifest.

    CKPT_ROOT/
      latest                      name of the newest complete checkpoint (updated last)
      step_00000100/
        manifest.json             format, step, consumed samples, model shape, config, RNG,
                                  loss scaler, LR state, tokenizer reference, sha256 per file
        model.safetensors         weights by HF parameter name (the tied LM head is stored once,
                                  as transformer.word_embeddings.weight)
        optim.safetensors         AdamW moments by the same names: `exp_avg.NAME`, `exp_avg_sq.NAME`
        tokenizer/                a copy of the run's tokenizer files, when it had one

Nothing is unpickled on load: tensors come from safetensors and everything else from JSON.
A checkpoint is written under a temporary directory name, verified, and renamed into place; the
`latest` pointer is updated after that. A crash or a full disk at any moment therefore leaves the
previous checkpoint valid, and `find_latest_valid` skips anything incomplete or corrupt.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bloomtrain.model.presets import BloomShape
from bloomtrain.utils import UserError, atomic_output, fsync_dir

FORMAT = "bloomtrain-checkpoint"
FORMAT_VERSION = 1
TIED_ALIAS = {"lm_head.weight": "transformer.word_embeddings.weight"}
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def canonical_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the tied LM head (it is the embedding) and make every tensor contiguous on CPU."""
    out = {}
    for k, v in state_dict.items():
        if k in TIED_ALIAS:
            continue
        out[k] = v.detach().to("cpu").contiguous()
    return out


def save_checkpoint(root: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    shape: BloomShape, optim_state: dict[str, torch.Tensor] | None = None,
                    meta: dict[str, Any] | None = None, tokenizer=None,
                    keep_last: int | None = None) -> Path:
    """Write a complete checkpoint for `step` under `root` atomically and point `latest` at it.

    `model_state` maps HF names to full tensors; `optim_state` maps `exp_avg.NAME` /
    `exp_avg_sq.NAME` to fp32 tensors; `meta` is JSON-serializable extra state (consumed samples,
    RNG, scaler, config). `tokenizer` is a bloomtrain Tokenizer whose files are copied in.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        files = {}
        save_file(canonical_state_dict(model_state), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        files["model.safetensors"] = None
        if optim_state:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in optim_state.items()},
                      str(tmp / "optim.safetensors"), metadata={"format": "pt"})
            files["optim.safetensors"] = None
        tokenizer_ref = None
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
            tokenizer_ref = "tokenizer"
            for f in sorted((tmp / "tokenizer").iterdir()):
                files[f"tokenizer/{f.name}"] = None
        for name in files:
            files[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "model_shape": asdict(shape),
            "tokenizer": tokenizer_ref,
            "files": files,
            **(meta or {}),
        }
        with atomic_output(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        fsync_dir(tmp)
        if final.exists():
            # Re-saving the same step (e.g. after a resume): the old copy goes only once the new
            # one is complete.
            old = root / f".{final.name}.old.{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with atomic_output(root / "latest", "w") as f:
        f.write(final.name + "\n")
    if keep_last:
        prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    steps = sorted(list_checkpoints(root))
    for _, path in steps[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{path} is not a bloomtrain checkpoint (no manifest.json)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf} is corrupt: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mf} is not a bloomtrain checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer bloomtrain (format "
                              f"{manifest['format_version']}); upgrade bloomtrain to load it")
    return manifest


def verify(path: str | os.PathLike, manifest: dict | None = None) -> dict[str, Any]:
    """Check every file's size and sha256 against the manifest. Raises CheckpointError."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} is truncated or altered "
                                  f"({f.stat().st_size} bytes, manifest says {info['bytes']})")
        if sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"{path}: file {name} fails its checksum")
    return manifest


def find_latest_valid(root: str | os.PathLike, log=print) -> Path | None:
    """The newest checkpoint under `root` that verifies. Incomplete or corrupt ones are reported
    and skipped, so a crash during a save falls back to the previous checkpoint."""
    for step, path in reversed(list_checkpoints(root)):
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


def load_tensors(file: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(file), framework="pt") as f:
        for k in f.keys():
            if k.startswith(prefix):
                out[k[len(prefix):]] = f.get_tensor(k)
    return out


def load_model_state(path: str | os.PathLike, verify_files: bool = True):
    """(shape, state_dict, manifest) of the checkpoint at `path` (a step dir or a root)."""
    ckpt = resolve(path)
    manifest = verify(ckpt) if verify_files else read_manifest(ckpt)
    shape = BloomShape(**manifest["model_shape"])
    state = load_tensors(ckpt / "model.safetensors")
    return shape, state, manifest
