"""The on-disk checkpoint format: names, the manifest, verification and finding checkpoints.

Everything here works on directories and JSON alone, so the writer and the reader both build on
it without depending on each other.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from bloomtrain.errors import UserError
from bloomtrain.model.presets import EMBEDDING, LM_HEAD, BloomShape
from bloomtrain.safetensors_io import DTYPES
from bloomtrain.files import PathOutside, path_inside

FORMAT = "bloomtrain-checkpoint"
FORMAT_VERSION = 2
# Beside manifest.json: its sha256 (check_manifest_digest).
MANIFEST_DIGEST = "manifest.sha256"
MODEL_KINDS = ("model",)
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
# parallel.grad_error_feedback's residuals, one kind per dp rank of the run that saved them, in the
# optim files (bloomtrain/parallel/zero/state.py: what they are and how a resume reshards them).
RESIDUAL_PREFIX = "grad_residual_dp"


def residual_kind(dp_rank: int) -> str:
    return f"{RESIDUAL_PREFIX}{dp_rank}"


def is_residual_kind(kind) -> bool:
    return (isinstance(kind, str) and kind.startswith(RESIDUAL_PREFIX)
            and kind[len(RESIDUAL_PREFIX):].isdigit())


def residual_kinds(manifest: dict) -> list[str]:
    """The residual kinds a checkpoint holds, by saving dp rank (every fragment holds the same
    kinds: check_manifest)."""
    for t in manifest.get("tensors", {}).values():
        found = [k for k in t["fragments"][0]["keys"] if is_residual_kind(k)]
        return sorted(found, key=lambda k: int(k[len(RESIDUAL_PREFIX):]))
    return []
TIED_ALIAS = {LM_HEAD: EMBEDDING}  # the tied LM head is stored once, as the embedding
_FRAGMENT_KEYS = ("files", "keys", "dtypes", "tp_dim", "tp_rank", "tp_size", "offset", "numel")
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


def member_path(root: Path, name: Any, what: str = "file") -> Path:
    """`root / name` for a name a manifest gives, refused unless it stays inside `root`: no
    absolute path, no `..`, and no symlink on the way that leads out. A checkpoint may come
    from anyone, and its manifest must not make us read (or hash, or copy) files elsewhere."""
    try:
        return path_inside(root, name)
    except PathOutside as e:
        reason, detail = e.reason, e.detail
    if reason == "not_a_name":
        raise CheckpointError(f"{root}: the manifest names {what} {name!r}, which is not a "
                              f"file name; the manifest is corrupt")
    if reason == "outside":
        raise CheckpointError(f"{root}: the manifest names {what} {name!r}, a path outside the "
                              f"checkpoint directory; refusing to read it (a checkpoint's files "
                              f"are relative names inside it)")
    if reason == "unresolvable":
        raise CheckpointError(f"{root}: {what} {name!r} cannot be resolved: {detail}")
    raise CheckpointError(f"{root}: {what} {name!r} is a symlink leading out of the "
                          f"checkpoint directory (to {detail}); refusing to read it")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_model_shape(bad, shape) -> None:
    if not isinstance(shape, dict):
        raise bad(f"model_shape must be an object, got {type(shape).__name__}")
    names = [f.name for f in dataclasses.fields(BloomShape)]
    if sorted(shape) != sorted(names):
        missing = sorted(set(names) - set(shape))
        extra = sorted(map(str, set(shape) - set(names)))
        raise bad(f"model_shape must have exactly the keys {names} (missing {missing}, "
                  f"unknown {extra})")
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size"):
        if not _is_int(shape[name]) or shape[name] <= 0:
            raise bad(f"model_shape.{name} must be a positive integer, got {shape[name]!r}")
    for name in ("layer_norm_epsilon", "hidden_dropout", "attention_dropout", "init_method_std"):
        v = shape[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise bad(f"model_shape.{name} must be a non-negative number, got {v!r}")
    for name in ("hidden_dropout", "attention_dropout"):
        if shape[name] >= 1:
            raise bad(f"model_shape.{name} must be below 1, got {shape[name]!r}")
    if shape["hidden_size"] % shape["num_heads"]:
        raise bad(f"model_shape.hidden_size ({shape['hidden_size']}) is not divisible by "
                  f"num_heads ({shape['num_heads']})")


def _check_fragments(bad, name: str, t, files: dict, file_bytes: dict[str, int]) -> None:
    """Types of every fragment entry, and that the fragments of each tp chunk tile it exactly:
    the reader copies each one into place, so an overlap or a gap would load silently wrong
    (or uninitialized) values. Adds each fragment's bytes to `file_bytes` under its file."""
    if not isinstance(t, dict) or not isinstance(t.get("shape"), list) or \
            not all(_is_int(d) and d >= 0 for d in t["shape"]):
        raise bad(f"tensor {name}: shape must be a list of non-negative integers")
    frags = t.get("fragments")
    if not isinstance(frags, list) or not frags or not all(isinstance(f, dict) for f in frags):
        raise bad(f"tensor {name}: fragments must be a non-empty list of objects")
    kinds = None
    for i, fr in enumerate(frags):
        where = f"tensor {name} fragment {i}"
        missing = [k for k in _FRAGMENT_KEYS if k not in fr]
        if missing:
            raise bad(f"{where} lacks {missing}")
        for key in ("tp_rank", "tp_size", "offset", "numel"):
            if not _is_int(fr[key]) or fr[key] < 0:
                raise bad(f"{where}: {key} must be a non-negative integer, got {fr[key]!r}")
        if fr["numel"] == 0 or fr["tp_size"] == 0 or fr["tp_rank"] >= fr["tp_size"]:
            raise bad(f"{where}: needs numel >= 1 and 0 <= tp_rank < tp_size >= 1")
        if (fr["tp_size"], fr["tp_dim"]) != (frags[0]["tp_size"], frags[0]["tp_dim"]):
            raise bad(f"tensor {name} mixes tp splits ({frags[0]['tp_size']} along "
                      f"{frags[0]['tp_dim']} and {fr['tp_size']} along {fr['tp_dim']})")
        if not all(isinstance(fr[k], dict) for k in ("files", "keys", "dtypes")):
            raise bad(f"{where}: files, keys and dtypes must be objects")
        here = set(fr["keys"])
        if here != set(fr["files"]) or here != set(fr["dtypes"]) or "model" not in here or \
                not all(k in MODEL_KINDS + OPTIM_KINDS or is_residual_kind(k) for k in here):
            raise bad(f"{where}: files, keys and dtypes must name the same kinds, 'model' and "
                      f"optionally {list(OPTIM_KINDS)}; got {sorted(map(str, here))}")
        if kinds is not None and here != kinds:
            raise bad(f"tensor {name}: its fragments hold different kinds of state")
        kinds = here
        for kind in here:
            file, dtype = fr["files"][kind], fr["dtypes"][kind]
            if not isinstance(fr["keys"][kind], str):
                raise bad(f"{where}: the {kind} key must be a string")
            if not isinstance(file, str) or file not in files:
                raise bad(f"{where}: the {kind} file {file!r} is not among the manifest's files")
            # Looked up on the torch module when read: anything else (say "load") must never
            # get that far.
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise bad(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
            if dtype != frags[0]["dtypes"][kind]:
                raise bad(f"tensor {name}: its fragments disagree on the {kind} dtype")
            file_bytes[file] = file_bytes.get(file, 0) + fr["numel"] * DTYPES[dtype][1]
    _check_tiling(bad, name, t["shape"], frags)


def _check_tiling(bad, name: str, shape: list[int], frags: list[dict]) -> None:
    """The fragments of each tp chunk tile it exactly, neither overlapping nor leaving a gap."""
    tp_size, tp_dim = frags[0]["tp_size"], frags[0]["tp_dim"]
    if tp_size > len(frags):  # also keeps a huge tp_size from costing anything below
        raise bad(f"tensor {name}: tp_size {tp_size} but only {len(frags)} fragment(s); the "
                  f"checkpoint is incomplete")
    if tp_size == 1:
        if tp_dim is not None:
            raise bad(f"tensor {name}: tp_dim must be null when tp_size is 1")
    elif not _is_int(tp_dim) or not 0 <= tp_dim < len(shape) or shape[tp_dim] % tp_size:
        raise bad(f"tensor {name}: tp_dim {tp_dim!r} must be a dim of its shape {shape} whose "
                  f"size divides by tp_size {tp_size}")
    chunk = math.prod(shape) // tp_size
    by_rank: dict[int, list[tuple[int, int]]] = {r: [] for r in range(tp_size)}
    for fr in frags:
        by_rank[fr["tp_rank"]].append((fr["offset"], fr["numel"]))
    for rank, pieces in by_rank.items():
        end = 0
        for offset, numel in sorted(pieces):
            if offset < end:
                raise bad(f"tensor {name}: fragments overlap at element {offset} of tp chunk "
                          f"{rank}")
            if offset > end:
                raise bad(f"tensor {name}: elements {end}-{offset - 1} of tp chunk {rank} are "
                          f"in no fragment; the checkpoint is incomplete")
            end = offset + numel
        if end != chunk:
            raise bad(f"tensor {name}: the fragments of tp chunk {rank} cover {end} elements, "
                      f"the shape {shape} gives {chunk}; the checkpoint is incomplete")


def check_manifest(path: str | os.PathLike, manifest: Any) -> None:
    """Structure and types of everything the reader follows in a manifest, and that every
    file it names stays inside the checkpoint directory `path`. Raises CheckpointError naming
    the manifest and what is wrong, so that nothing later fails with a KeyError or TypeError
    half-way through a load."""
    path = Path(path)
    mf = path / "manifest.json"

    def bad(message: str) -> CheckpointError:
        return CheckpointError(f"{mf}: {message}")

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if not _is_int(manifest.get("step")) or manifest["step"] < 0:
        raise bad(f"step must be a non-negative integer, got {manifest.get('step')!r}")
    _check_model_shape(bad, manifest.get("model_shape"))
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad("files must be an object of file name -> {sha256, bytes}")
    for name, info in files.items():
        member_path(path, name)
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) or \
                not _is_int(info.get("bytes")) or info["bytes"] < 0:
            raise bad(f"files[{name!r}] must be {{sha256: string, bytes: integer >= 0}}")
    tokenizer = manifest.get("tokenizer")
    if tokenizer is not None and not member_path(path, tokenizer, "tokenizer directory").is_dir():
        raise bad(f"the tokenizer directory {tokenizer!r} it names is missing")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors must be an object of tensor name -> {shape, fragments}")
    file_bytes: dict[str, int] = {}
    for name, t in tensors.items():
        _check_fragments(bad, name, t, files, file_bytes)
    # The reader allocates each tensor before it reads the files; this bounds that by what is
    # on disk (the file sizes are checked against `bytes` before anything is read).
    for file, needed in file_bytes.items():
        if needed > files[file]["bytes"]:
            raise bad(f"its fragments put {needed} bytes of tensors in {file}, which has "
                      f"{files[file]['bytes']}")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{path} is not a bloomtrain checkpoint (no manifest.json)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise CheckpointError(f"{mf} is corrupt: {e}") from None
    except OSError as e:  # a bad sector, permissions: this checkpoint is unusable, not the job
        raise CheckpointError(f"cannot read {mf}: {e.strerror or e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mf} is not a bloomtrain checkpoint manifest")
    version = manifest.get("format_version", 0)
    if not _is_int(version):
        raise CheckpointError(f"{mf}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer bloomtrain (format {version}); "
                              f"upgrade bloomtrain to load it")
    if version < FORMAT_VERSION:
        raise CheckpointError(f"{path} uses checkpoint format {version}, which this bloomtrain "
                              f"no longer reads; export it with the bloomtrain that wrote it")
    check_manifest(path, manifest)
    return manifest


def manifest_digest(manifest_file: Path) -> str:
    """The line of MANIFEST_DIGEST for `manifest_file`, as `sha256sum` writes it (so that
    `sha256sum -c manifest.sha256` checks it too)."""
    return f"{sha256_file(manifest_file)}  manifest.json\n"


def check_manifest_digest(path: Path) -> None:
    """manifest.json against its MANIFEST_DIGEST: the data files have their sha256 in the
    manifest, and this covers the manifest itself, whose scalars (the train state, the loss
    scale, the RNG) resume reads. A checkpoint saved before the digest was has none."""
    side = path / MANIFEST_DIGEST
    if not side.exists():
        return
    try:
        want = side.read_text(encoding="ascii").split()[0]
        got = sha256_file(path / "manifest.json")
    except (OSError, UnicodeDecodeError, IndexError) as e:
        raise CheckpointError(f"{side} cannot be read ({e}); the checkpoint is damaged") \
            from None
    if want != got:
        raise CheckpointError(f"{path}: manifest.json fails its checksum ({MANIFEST_DIGEST}); "
                              f"it was altered or damaged")


def verify(path: str | os.PathLike, manifest: dict | None = None, check_sums: bool = True,
           files: list[str] | None = None) -> dict[str, Any]:
    """Check the manifest (check_manifest: its structure, that the fragment index tiles every
    tensor, that no file name leaves `path`) and files (all, or `files`) against it: present,
    right size and, with `check_sums`, right sha256. Raises CheckpointError."""
    path = Path(path)
    if manifest is None:
        manifest = read_manifest(path)
    else:
        check_manifest(path, manifest)
    if check_sums and files is None:  # a whole check (verify_shared checks it once a job)
        check_manifest_digest(path)
    for name in files if files is not None else manifest["files"]:
        info = manifest["files"].get(name)
        f = member_path(path, name)
        if info is None or not f.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        try:
            size, ok = f.stat().st_size, not check_sums or sha256_file(f) == info["sha256"]
        except OSError as e:  # unreadable (a bad sector, permissions): skipped like a corrupt one
            raise CheckpointError(f"{path}: file {name} cannot be read: {e.strerror or e}") \
                from None
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} is truncated or altered "
                                  f"({size} bytes, manifest says {info['bytes']})")
        if not ok:
            raise CheckpointError(f"{path}: file {name} fails its checksum")
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


@dataclasses.dataclass(frozen=True)
class SharedCheck:
    """The ranks of one job choosing a checkpoint together (find_latest_valid): rank `rank` of
    `world` hashes every world-th data file, so that the job reads each file once, not once per
    rank (at BLOOM-176B 2.1 TB per rank); `agree(error)` takes this rank's error (None: its
    files verified) and returns the first one any rank found, the same on every rank;
    `common(value)` returns the first rank's value on every rank."""
    rank: int
    world: int
    agree: Callable[[str | None], str | None]
    common: Callable[[Any], Any]


def find_latest_valid(root: str | os.PathLike, log=print, check_sums: bool = True,
                      shared: SharedCheck | None = None,
                      skipped: set[str] | None = None) -> Path | None:
    """The newest checkpoint under `root` that verifies. Incomplete or corrupt ones are reported
    and skipped, so a crash during a save falls back to the previous checkpoint. Without
    `check_sums` only the manifest, the fragment index and the file sizes are checked, no data
    file is read: a quick look at a large checkpoint (`bloomtrain status`). With `shared`, the
    checksums are split over the job's ranks (every rank still checks every file's size) and
    every rank takes the same checkpoint: the candidates are the first rank's (a rank that
    cannot see one fails it for all), each is judged by all. The names of those skipped are
    added to `skipped`."""
    paths = [path for _, path in reversed(list_checkpoints(root))]
    if shared is not None:
        paths = [Path(root) / name for name in shared.common([p.name for p in paths])]
    for path in paths:
        try:
            verify_shared(path, shared, check_sums)
            return path
        except CheckpointError as e:
            log(f"[checkpoint] skipping {path.name}: {e}")
            if skipped is not None:
                skipped.add(path.name)
    return None


def verify_shared(path: str | os.PathLike, shared: SharedCheck | None,
                  check_sums: bool = True, files: list[str] | None = None,
                  manifest: dict | None = None) -> dict[str, Any]:
    """verify() the files (all, or `files`) of the checkpoint at `path`, their checksums split
    over the ranks of `shared` (None: all of them here), every rank checking every size; raises
    the same CheckpointError on every rank when any rank finds a problem. Returns the
    manifest."""
    error = None
    try:
        manifest = verify(path, manifest, check_sums=False, files=files)
        if check_sums:
            if files is None and (shared is None or shared.rank == 0):
                check_manifest_digest(Path(path))
            names = sorted(manifest["files"] if files is None else files)
            verify(path, manifest,
                   files=names if shared is None else names[shared.rank::shared.world])
    except CheckpointError as e:
        error = str(e)
    if shared is not None:
        error = shared.agree(error)
    if error is not None:
        raise CheckpointError(error)
    return manifest


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from either itself or a root holding `latest` / step_* dirs."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if (path / "latest").is_file():
        try:
            name = (path / "latest").read_text(encoding="utf-8").strip()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path / 'latest'}: {e}") from None
        # `latest` holds one step directory's name; anything else would point elsewhere.
        cand = member_path(path, name, "checkpoint (in `latest`)")
        if len(PurePosixPath(name).parts) != 1:
            raise CheckpointError(f"{path / 'latest'} names {name!r}, not a step directory of "
                                  f"{path}")
        if (cand / "manifest.json").is_file():
            return cand
    found = find_latest_valid(path, log=lambda *_: None)
    if found is None:
        raise CheckpointError(f"no bloomtrain checkpoint found at {path}")
    return found


def prune(root: Path, keep_last: int, newest: int | None = None,
          unusable: set[str] = frozenset()) -> None:
    """Remove all but the `keep_last` highest steps at or below `newest` (the step just
    committed; None: every step). Steps above it are left alone: they are not this run's
    (a save that resume=auto skipped as corrupt, or the history a run resumed from an older
    step left), and counting them would delete the save just made. Neither are those named in
    `unusable` (skipped as corrupt below it) counted or removed: counted, they kept a bad
    checkpoint in place of a good one."""
    ours = [(s, p) for s, p in list_checkpoints(root)
            if (newest is None or s <= newest) and p.name not in unusable]
    for _, path in ours[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
