"""Fuzzing of everything bloomtrain reads from disk or the command line (hypothesis): indexed
datasets, checkpoint manifests, configs and overrides, tokenizer text.

Each property draws 500 cases in the full suite, derandomized so that CI sees the same ones every
run (50 random ones in the fast tier: tests/conftest.py's hypothesis profiles).
The rule for all of them: bad input ends in our UserError (or its subclass for the file kind),
with a message that names the file or key, never in an IndexError, TypeError, struct.error or
the like, and good input still works. Where the oracle can tell which inputs are bad, the
property also checks that those are refused, so a validation that accepted everything would
fail here.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bloomtrain.checkpoint import CheckpointError  # noqa: E402
from bloomtrain.config import Config, UserError  # noqa: E402
from bloomtrain.data.indexed import (DTYPE_CODES, IndexedDatasetError,  # noqa: E402
                                     MMapIndexedDataset, write_dataset)
from bloomtrain.config import DOMAINS, Domain  # noqa: E402
from tests.domains import (base_type, config_with, assert_in_domains,  # noqa: E402
                           inside)

# The number of cases and their randomness come from the profile tests/conftest.py loads: `full`
# (500, derandomized) in the full suite, `fast` (50) in the fast tier.
FUZZ = settings()


def _put(path: Path, data: bytes) -> None:
    """Replace `path` by a new file (a new inode): a map of the previous example's file stays
    valid, where rewriting the file in place could make it fault. One directory serves every
    example; creating and removing one per example took most of the time on overlay file
    systems."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---- indexed datasets (.bin/.idx) ---------------------------------------------------------------

HEADER = struct.Struct("<9sQBQQ")
DOCS = [[[5, 6, 7], [8]], [[9, 10]], [[11, 12, 13, 14], [15, 16], [17]]]


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory):
    """(root, .idx bytes, .bin bytes) of a small valid uint16 dataset."""
    root = tmp_path_factory.mktemp("fuzz_indexed")
    write_dataset(root / "base", DOCS, dtype=np.uint16)
    return root, (root / "base.idx").read_bytes(), (root / "base.bin").read_bytes()


def _write_pair(root: Path, idx: bytes, bin_: bytes) -> str:
    _put(root / "data.idx", idx)
    _put(root / "data.bin", bin_)
    return str(root / "data")


def _consistent(idx: bytes, bin_size: int) -> bool:
    """The test's own reading of the format: does this .idx describe a readable dataset?"""
    if len(idx) < HEADER.size:
        return False
    magic, version, code, n, d = HEADER.unpack_from(idx)
    if magic != b"MMIDIDX\x00\x00" or version != 1 or code not in DTYPE_CODES or d == 0:
        return False
    if len(idx) != HEADER.size + 12 * n + 8 * d:
        return False
    itemsize = np.dtype(DTYPE_CODES[code]).itemsize
    sizes = np.frombuffer(idx, np.int32, n, HEADER.size).astype(np.int64)
    pointers = np.frombuffer(idx, np.int64, n, HEADER.size + 4 * n)
    doc_idx = np.frombuffer(idx, np.int64, d, HEADER.size + 12 * n)
    if (sizes < 0).any():
        return False
    ends = np.cumsum(sizes * itemsize)
    starts = ends - sizes * itemsize
    if not np.array_equal(pointers, starts) or (int(ends[-1]) if n else 0) != bin_size:
        return False
    # From 0 up to the sequence count: a sequence after the last document's end is in none
    # (Megatron's writer ends every document, so its doc_idx ends at the count).
    return doc_idx[0] == 0 and (np.diff(doc_idx) >= 0).all() and doc_idx[-1] == n


def _open_or_error(prefix: str):
    """The dataset with every sequence read back, or the IndexedDatasetError; anything else
    propagates and fails the property."""
    try:
        ds = MMapIndexedDataset(prefix)
    except IndexedDatasetError as e:
        assert prefix in str(e), f"the message does not name the file: {e}"
        return e
    for i in range(len(ds)):
        assert len(ds[i]) == ds.sizes[i]
    assert ds.num_docs == len(ds.doc_idx) - 1 >= 0
    return ds


@FUZZ
@given(field=st.sampled_from(["magic", "version", "code", "num_seqs", "num_doc_idx"]),
       data=st.data())
def test_index_header_fields(dataset_files, field, data):
    """One header field replaced by any other value: refused, unless it is a dtype code of the
    same width (uint16 -> int16 reads the same bytes; the format cannot tell). Counts as large
    as 2**64-1 are refused before anything is allocated."""
    root, idx, bin_ = dataset_files
    header = dict(zip(["magic", "version", "code", "num_seqs", "num_doc_idx"],
                      HEADER.unpack_from(idx)))
    strategy = {"magic": st.binary(min_size=9, max_size=9),
                "code": st.integers(0, 255)}.get(field, st.integers(0, 2 ** 64 - 1))
    value = data.draw(strategy.filter(lambda v: v != header[field]), label=field)
    header[field] = value
    bad = HEADER.pack(*header.values()) + idx[HEADER.size:]
    prefix = _write_pair(root, bad, bin_)
    tracemalloc.start()
    try:
        outcome = _open_or_error(prefix)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), f"opening a {len(bad)}-byte index allocated {peak} bytes"
    same_width = field == "code" and value in DTYPE_CODES and \
        np.dtype(DTYPE_CODES[value]).itemsize == 2
    assert isinstance(outcome, IndexedDatasetError) != same_width


@FUZZ
@given(data=st.data())
def test_index_truncated_or_extended(dataset_files, data):
    """Either file cut at any byte (so every header field and array too) or grown: refused."""
    root, idx, bin_ = dataset_files
    which = data.draw(st.sampled_from(["idx", "bin"]))
    original = idx if which == "idx" else bin_
    if data.draw(st.booleans(), label="cut"):
        changed = original[:data.draw(st.integers(0, len(original) - 1), label="length")]
    else:
        changed = original + data.draw(st.binary(min_size=1, max_size=64), label="tail")
    prefix = _write_pair(root, changed if which == "idx" else idx,
                         changed if which == "bin" else bin_)
    assert isinstance(_open_or_error(prefix), IndexedDatasetError)


@FUZZ
@given(data=st.data())
def test_index_arrays_overwritten(dataset_files, data):
    """Random bytes over the sizes, pointers and doc_idx arrays (header intact): refused exactly
    when the arrays no longer describe the .bin (negative sizes, pointers outside it or out of
    order, a doc_idx that does not rise from 0 to N); otherwise every sequence reads."""
    root, idx, bin_ = dataset_files
    body = bytearray(idx)
    for _ in range(data.draw(st.integers(1, 4), label="patches")):
        at = data.draw(st.integers(HEADER.size, len(idx) - 1), label="at")
        patch = data.draw(st.binary(min_size=1, max_size=16), label="patch")
        body[at:at + len(patch)] = patch[:len(idx) - at]
    outcome = _open_or_error(_write_pair(root, bytes(body), bin_))
    assert isinstance(outcome, IndexedDatasetError) != _consistent(bytes(body), len(bin_))


@FUZZ
@given(n=st.integers(0, 6) | st.integers(0, 2 ** 64 - 1), d=st.integers(0, 6),
       code=st.sampled_from(sorted(DTYPE_CODES)), data=st.data())
def test_index_any_counts_and_bytes(dataset_files, n, d, code, data):
    """A valid magic and version with any counts, array bytes of the length they imply (or a
    little off) and any .bin: refused unless the bytes happen to be a consistent dataset.
    Small arrays of zeros are, so both outcomes occur."""
    root, _, _ = dataset_files
    exact = 12 * n + 8 * d
    length = max(0, (exact if exact <= 256 else 64) + data.draw(st.sampled_from([0, 0, 0, -1, 3])))
    byte = st.sampled_from([0, 0, 0, 1, 2, 4, 8, 255])  # small values make consistent arrays
    body = data.draw(st.binary(min_size=length, max_size=length)
                     | st.lists(byte, min_size=length, max_size=length).map(bytes), label="body")
    bin_ = data.draw(st.binary(max_size=16), label="bin")
    idx = HEADER.pack(b"MMIDIDX\x00\x00", 1, code, n, d) + body
    outcome = _open_or_error(_write_pair(root, idx, bin_))
    assert isinstance(outcome, IndexedDatasetError) != _consistent(idx, len(bin_))


# ---- checkpoint manifests -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_base(tmp_path_factory, one_thread):
    """(step dir, work dir, manifest, paths) of a tiny single-process checkpoint with optimizer
    state. The work dir is a step directory holding the same data files (hard links: not
    symlinks, which the reader refuses) where each example writes its manifest; `paths` lists
    every location in the manifest."""
    import torch

    from bloomtrain import checkpoint
    from bloomtrain.model import BloomShape, build_model

    shape = BloomShape(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=32)
    state = build_model(shape, seed=0).state_dict()
    optim = {f"exp_avg.{n}": torch.randn_like(t) for n, t in state.items() if n != "lm_head.weight"}
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    step = checkpoint.save_checkpoint(root / "base", 7, state, shape, optim_state=optim)
    manifest = json.loads((step / "manifest.json").read_text())
    work = root / "work" / step.name
    work.mkdir(parents=True)
    for f in step.iterdir():
        if f.name != "manifest.json":
            os.link(f, work / f.name)
    return step, work, manifest, [p for p, _ in _paths(manifest) if p]


def _checkpoint_with(work: Path, manifest, extra: dict[str, bytes] | None = None) -> Path:
    for name, data in (extra or {}).items():
        _put(work / name, data)
    _put(work / "manifest.json", json.dumps(manifest).encode())
    return work


@functools.lru_cache(maxsize=None)
def _original(base: Path, name: str):
    from bloomtrain.checkpoint import CheckpointReader

    return CheckpointReader(base).load(name).reshape(-1)


def _load_all(step: Path):
    """What load_model and export do with a checkpoint: every parameter, checked. The loaded
    tensors, or the CheckpointError (naming the checkpoint)."""
    from bloomtrain.checkpoint.reader import open_model

    try:
        reader = open_model(step)
        out = {n: reader.load(n) for n in reader.names()}
        out.update({f"exp_avg.{n}": reader.load(n, "exp_avg") for n in reader.names()
                    if reader.has("exp_avg")})
        return out
    except CheckpointError as e:
        assert str(step) in str(e), f"the message does not name the checkpoint: {e}"
        return e


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree[k]
    if value is _DELETE:
        del tree[path[-1]]
    else:
        tree[path[-1]] = value


_DELETE = object()
SCALARS = {type(None): st.none(), bool: st.booleans(), int: st.integers(-2 ** 63, 2 ** 64),
           float: st.floats(allow_nan=False), str: st.text(max_size=12)}
JSON = st.recursive(st.one_of(*SCALARS.values()),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
BY_TYPE = {**SCALARS, list: st.lists(JSON, max_size=3),
           dict: st.dictionaries(st.text(max_size=6), JSON, max_size=3)}


def _other_type(value):
    """JSON values of another type than `value`; a float's "type" includes int, since a JSON
    number written without a point reads back as one."""
    same = (int, float) if type(value) is float else (type(value),)
    return st.one_of(*(s for t, s in BY_TYPE.items() if t not in same))


# What the reader follows; `ranks` and the trainer's keys are the trainer's business.
CHECKED = ("format", "format_version", "step", "model_shape", "files", "tensors", "tokenizer")


@FUZZ
@given(data=st.data())
def test_manifest_damaged(checkpoint_base, data):
    """A key the reader follows deleted, or its value replaced by one of another type: no model
    loads from it, and the error is a CheckpointError naming the checkpoint."""
    base, work, manifest, paths = checkpoint_base
    candidates = [p for p in paths if p[0] in CHECKED]
    path = candidates[data.draw(st.integers(0, len(candidates) - 1), label="where")]
    value = _get(manifest, path)
    parent_is_list = isinstance(_get(manifest, path[:-1]), list)
    # Deleting `tokenizer` (null here) changes nothing: a checkpoint need not have one.
    delete = not parent_is_list and path != ("tokenizer",) and \
        data.draw(st.booleans(), label="delete")
    replacement = _DELETE if delete else data.draw(_other_type(value), label="value")
    bad = json.loads(json.dumps(manifest))
    _set(bad, path, replacement)
    outcome = _load_all(_checkpoint_with(work, bad))
    assert isinstance(outcome, CheckpointError), (path, replacement)


@FUZZ
@given(data=st.data())
def test_manifest_any_value(checkpoint_base, data):
    """Any JSON value anywhere (same type included, so offsets, sizes and counts that are merely
    wrong): a CheckpointError, or a checkpoint whose every tensor loads with its model shape."""
    from bloomtrain.checkpoint.reader import expected_shape
    from bloomtrain.model import BloomShape

    base, work, manifest, paths = checkpoint_base
    bad = json.loads(json.dumps(manifest))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        path = paths[data.draw(st.integers(0, len(paths) - 1), label="where")]
        value = data.draw(JSON | st.integers(0, 64), label="value")
        try:
            _set(bad, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit replaced a container on the way
    outcome = _load_all(_checkpoint_with(work, bad))
    if not isinstance(outcome, CheckpointError):
        shape = BloomShape(**bad["model_shape"])
        for name, t in outcome.items():
            assert tuple(t.shape) == expected_shape(shape, name.removeprefix("exp_avg."))


# ---- the trainer's manifest keys ----------------------------------------------------------------

TRAINER_KEYS = ("train_state", "loss_window", "optimizer", "topology", "ranks")


@pytest.fixture(scope="module")
def train_manifest(tmp_path_factory, one_thread):
    """(checkpoint dir, manifest) of a real 2-step fp16 training run's checkpoint (fp16: the
    optimizer scalars include the loss scaler), and the trainer keys' paths in it."""
    from bloomtrain.train import train
    from tests.synthetic import write_synthetic_dataset
    from tests.helpers import make_cfg

    root = tmp_path_factory.mktemp("fuzz_train")
    data = write_synthetic_dataset(root / "data" / "synth_text_document")
    cfg = make_cfg(data, root, train__train_iters=2, train__precision="fp16",
                   checkpoint={"dir": str(root / "ck"), "save_interval": 2,
                               "async_save": False})
    train(cfg, log=lambda *a, **k: None)
    from bloomtrain import checkpoint

    step = checkpoint.resolve(root / "ck")
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["train_state"]["step"] == 2 and manifest["optimizer"]["scaler"]
    return step, manifest, [p for p, _ in _paths(manifest) if p and p[0] in TRAINER_KEYS]


def _resume_pieces(manifest):
    """What a resume does with the trainer keys, short of a model: the train state, the
    optimizer scalars into a loss scaler, the RNG state of each rank (restored afterwards)."""
    import torch

    from bloomtrain.optim import DynamicLossScaler
    from bloomtrain.train.checkpointing import TrainState, set_rng_state

    if manifest.get("train_state"):
        state = TrainState.from_manifest(manifest)
        assert all(isinstance(v, int) and v >= 0
                   for v in (state.step, state.consumed_samples, state.skipped_steps))
        state.skipped_ranges()
    scalars = manifest.get("optimizer") or {}
    int(scalars.get("step_count", 0))
    if scalars.get("scaler"):
        DynamicLossScaler().load_state_dict(scalars["scaler"])
    saved = torch.get_rng_state()
    try:
        for meta in manifest.get("ranks", {}).values():
            if "rng" in meta:
                set_rng_state(meta["rng"])
    finally:
        torch.set_rng_state(saved)


@FUZZ
@given(data=st.data())
def test_train_manifest_keys_damaged(train_manifest, data):
    """A trainer key (train_state, loss_window, optimizer scalars, topology, per-rank RNG)
    deleted, replaced by another type, or set to any JSON value: check_train_manifest raises a
    CheckpointError naming the manifest, or everything a resume does with those keys works.
    A change of type where the schema admits one type only is always refused."""
    from bloomtrain.train.checkpointing import check_train_manifest

    step, manifest, paths = train_manifest
    path = paths[data.draw(st.integers(0, len(paths) - 1), label="where")]
    value = _get(manifest, path)
    how = data.draw(st.sampled_from(["delete", "type", "any"]), label="how")
    parent_is_list = isinstance(_get(manifest, path[:-1]), list) if len(path) > 1 else False
    if how == "delete" and parent_is_list:
        how = "type"
    replacement = (_DELETE if how == "delete" else
                   data.draw(_other_type(value), label="value") if how == "type" else
                   data.draw(JSON | st.integers(-3, 64), label="value"))
    bad = json.loads(json.dumps(manifest))
    _set(bad, path, replacement)
    try:
        check_train_manifest(step, bad)
    except CheckpointError as e:
        assert str(step / "manifest.json") in str(e)
        return
    _resume_pieces(bad)
    # Integers and strings the schema requires: another type can never pass.
    leaf = path[-1]
    if how == "type" and not isinstance(value, (dict, list)) and value is not None and (
            leaf in ("step", "consumed_samples", "skipped_steps", "step_count", "tp", "pp",
                     "dp", "growth_tracker", "hysteresis_tracker", "torch", "samples",
                     "train_samples", "sha256", "index")):
        raise AssertionError(f"{path} = {replacement!r} was accepted")


@pytest.mark.parametrize("replacement", [_DELETE, None, "x", -1, [], {}],
                         ids=["deleted", "null", "string", "negative", "list", "object"])
def test_train_manifest_every_key(train_manifest, replacement):
    """The property above for every trainer key, each deleted or set to a value of each kind:
    a sweep, so that no key depends on which ones the random draws reach."""
    from bloomtrain.train.checkpointing import check_train_manifest

    step, manifest, paths = train_manifest
    for path in paths:
        if replacement is _DELETE and isinstance(_get(manifest, path[:-1]), list):
            continue
        bad = json.loads(json.dumps(manifest))
        _set(bad, path, replacement)
        try:
            check_train_manifest(step, bad)
        except CheckpointError:
            continue
        _resume_pieces(bad)


def test_resume_from_damaged_train_state_is_refused(train_manifest, tmp_path):
    """End to end: a trainer resuming from a checkpoint whose train_state.step is a string
    stops with the manifest and the key named, before any state is loaded."""
    import shutil

    from bloomtrain.train import Trainer
    from tests.helpers import make_cfg

    step, manifest, _ = train_manifest
    ck = tmp_path / "ck"
    copy = ck / step.name
    shutil.copytree(step, copy)
    bad = json.loads(json.dumps(manifest))
    bad["train_state"]["step"] = "2"
    (copy / "manifest.json").write_text(json.dumps(bad))
    # As a faulty writer would leave it: the digest of what it wrote (else the digest refuses
    # it first, test_a_manifest_altered_after_its_save_is_skipped).
    from bloomtrain.checkpoint.format import MANIFEST_DIGEST, manifest_digest
    (copy / MANIFEST_DIGEST).write_text(manifest_digest(copy / "manifest.json"))
    data = manifest["config"]["data"]["paths"][0]
    cfg = make_cfg(data, tmp_path, train__train_iters=4, train__precision="fp16",
                   checkpoint={"dir": str(ck), "resume": str(copy)})
    with pytest.raises(CheckpointError, match=r"train_state\.step must be a non-negative "
                                              r"integer.*cannot resume"):
        Trainer(cfg, log=lambda *a, **k: None)


SHAPE_INTS = ("vocab_size", "hidden_size", "num_layers", "ffn_hidden_size")


@FUZZ
@given(data=st.data())
def test_manifest_shapes_disagree_with_model(checkpoint_base, data):
    """A tensor's shape, or a dimension of model_shape, changed: the tensors no longer fit the
    model the manifest describes, and nothing loads. (num_heads is left out: no parameter's
    shape depends on it.) A model_shape with a billion layers costs nothing to refuse."""
    base, work, manifest, _ = checkpoint_base
    bad = json.loads(json.dumps(manifest))
    if data.draw(st.booleans(), label="model_shape"):
        key = data.draw(st.sampled_from(SHAPE_INTS), label="key")
        bad["model_shape"][key] = data.draw(
            st.integers(1, 10 ** 9).filter(lambda v: v != manifest["model_shape"][key]))
    else:
        name = data.draw(st.sampled_from(sorted(bad["tensors"])), label="tensor")
        old = bad["tensors"][name]["shape"]
        new = data.draw(st.lists(st.integers(0, 64), min_size=1, max_size=3)
                        .filter(lambda s: s != old), label="shape")
        bad["tensors"][name]["shape"] = new
    assert isinstance(_load_all(_checkpoint_with(work, bad)), CheckpointError)


@FUZZ
@given(data=st.data())
def test_manifest_fragments_overlap_or_gap(checkpoint_base, data):
    """One tensor split into fragments at random cuts, stored in a new file, with the pieces
    then moved: exact tiles load the original values, overlaps and gaps are refused before any
    data is read."""
    import hashlib

    import torch
    from safetensors.torch import save

    base, work, manifest, _ = checkpoint_base
    name = data.draw(st.sampled_from(sorted(manifest["tensors"])), label="tensor")
    numel = math.prod(manifest["tensors"][name]["shape"])
    cuts = sorted(data.draw(st.sets(st.integers(1, numel - 1), max_size=4), label="cuts")) \
        if numel > 1 else []
    pieces = list(zip([0] + cuts, cuts + [numel]))
    moved = [(a, b) for a, b in pieces]
    for i in range(len(moved)):
        if data.draw(st.integers(0, 3), label="move?") == 0:  # shift start and/or end
            a, b = moved[i]
            a2 = data.draw(st.integers(max(0, a - 2), min(numel - 1, a + 2)), label="start")
            b2 = data.draw(st.integers(a2 + 1, min(numel, b + 2)), label="end")
            moved[i] = (a2, b2)
    if data.draw(st.booleans(), label="drop one") and len(moved) > 1:
        moved.pop(data.draw(st.integers(0, len(moved) - 1)))
    full = _original(base, name)
    tensors = {f"piece{i}": full[a:b].clone() for i, (a, b) in enumerate(moved)}
    blob = save(tensors, {"format": "pt"})
    bad = json.loads(json.dumps(manifest))
    bad["files"]["pieces.safetensors"] = {"sha256": hashlib.sha256(blob).hexdigest(),
                                          "bytes": len(blob)}
    template = bad["tensors"][name]["fragments"][0]
    bad["tensors"][name]["fragments"] = [
        {**template, "offset": a, "numel": b - a,
         "files": {"model": "pieces.safetensors"}, "keys": {"model": f"piece{i}"},
         "dtypes": {"model": template["dtypes"]["model"]}}
        for i, (a, b) in enumerate(moved)]
    for t in bad["tensors"].values():  # keep the kinds of all tensors alike
        for fr in t["fragments"]:
            for kind in ("exp_avg", "exp_avg_sq"):
                for key in ("files", "keys", "dtypes"):
                    fr[key].pop(kind, None)
    outcome = _load_all(_checkpoint_with(work, bad, {"pieces.safetensors": blob}))
    s = sorted(moved)
    tiles = s[0][0] == 0 and s[-1][1] == numel and all(x[1] == y[0] for x, y in zip(s, s[1:]))
    if tiles:
        assert torch.equal(outcome[name].reshape(-1), full)
    else:
        assert isinstance(outcome, CheckpointError)
        assert any(w in str(outcome) for w in ("overlap", "in no fragment", "cover")), outcome


# ---- config YAML and overrides ------------------------------------------------------------------

def _config_fields():
    import dataclasses

    out = {}
    for section in dataclasses.fields(Config):
        default = getattr(Config(), section.name)
        if dataclasses.is_dataclass(default):
            out[section.name] = [f.name for f in dataclasses.fields(default)]
    return out


FIELDS = _config_fields()
VALUES = (st.none() | st.booleans() | st.integers(-10, 10 ** 6) | st.integers()
          | st.floats() | st.text(max_size=8)
          | st.sampled_from(["1e-4", "nan", "inf", "-1", "0x10", "1_000", "true", "[1, 2]",
                             "9" * 5000, 10 ** 400, "[" * 5000, "{a: " * 2000])
          | st.lists(st.integers(-5, 5) | st.text(max_size=4), max_size=4)
          | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
KEYS = st.sampled_from(sorted(f"{s}.{k}" for s, ks in FIELDS.items() for k in ks)) \
    | st.text(max_size=12) | st.sampled_from(["run_dir", "model", "train.train_iters.x", "a..b"])


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_config")


def _accepted(cfg: Config) -> None:
    """A config that passed: checked per key, every key inside its domain by the table's own
    reading (tests/test_config.py: a check() that let a value through fails here), and written to
    and read back from config.yaml (what the run directory keeps) unchanged."""
    cfg.check()
    assert_in_domains(cfg)
    again = Config.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(sorted(FIELDS) + ["run_dir", "extra"]) | VALUES
                           .filter(lambda v: isinstance(v, (str, int, bool, type(None)))),
                           st.dictionaries(st.sampled_from(sorted({k for ks in FIELDS.values()
                                                                   for k in ks}))
                                           | st.text(max_size=6), VALUES, max_size=6) | VALUES,
                           max_size=5))
def test_config_yaml_of_random_types(config_dir, doc):
    """Sections and keys, known and not, holding values of every YAML type: a UserError, or a
    config that checks and survives a config.yaml round trip."""
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        assume(False)
    path = config_dir / "c.yaml"
    _put(path, text.encode())
    try:
        _accepted(Config.load(str(path)))
    except UserError:
        pass


@FUZZ
@given(overrides=st.lists(st.tuples(KEYS, VALUES | st.text(max_size=20)), max_size=6),
       raw=st.booleans())
def test_config_overrides_of_random_types(overrides, raw):
    """`key=value` overrides with any key and any value text (YAML-dumped values or raw
    text): a UserError, or a config that checks and round-trips."""
    args = []
    for key, value in overrides:
        text = value if raw and isinstance(value, str) else \
            yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
        args.append(f"{key}={text}")
    try:
        _accepted(Config.load(None, args + ["train.train_iters=1"]))
    except UserError:
        pass


@FUZZ
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
       | st.sampled_from([b"[" * 5000, b"a: " + b"1" * 5000, b"train: {train_iters: .nan}",
                          b"\xff\xfe", b"- 1\n- 2\n", b"model: !!python/object:os.system {}",
                          # well-formed, with a value outside its key's domain
                          b"model: {hidden_dropout: 5}", b"parallel: {tp: -2}",
                          b"train: {precision: fp8}", b"data: {split: '1,2,3,4'}",
                          b"optim: {min_lr: 1.0}"]))
def test_config_file_of_random_bytes(config_dir, content):
    """Any bytes as a config file (invalid UTF-8, deep nesting, 5000-digit integers, NaN,
    Python tags): a UserError, or a config that checks and round-trips."""
    path = config_dir / "c.yaml"
    _put(path, content)
    try:
        _accepted(Config.load(str(path), ["train.train_iters=1"]))
    except UserError:
        pass


# ---- each config key's domain (config.DOMAINS; the oracle is tests/test_config.py's) -------------

def _numbers(key: str, d: Domain, want_inside: bool):
    """Numbers of the key's type inside or outside an interval domain."""
    if base_type(key) is int:
        lo = math.floor(d.low) + (1 if d.low_open and float(d.low).is_integer() else 0) \
            if d.low != -math.inf else None
        hi = math.ceil(d.high) - (1 if d.high_open and float(d.high).is_integer() else 0) \
            if d.high != math.inf else None
        if want_inside:
            return st.integers(lo, hi)
        sides = [st.integers(max_value=lo - 1)] if lo is not None else []
        sides += [st.integers(min_value=hi + 1)] if hi is not None else []
        return st.one_of(sides)
    finite = dict(allow_nan=False, allow_infinity=False)
    lo = None if d.low == -math.inf else d.low
    hi = None if d.high == math.inf else d.high
    if want_inside:
        return st.floats(lo, hi, exclude_min=d.low_open and lo is not None,
                         exclude_max=d.high_open and hi is not None, **finite)
    sides = [st.floats(max_value=lo, exclude_max=not d.low_open, **finite)] if lo is not None \
        else []
    sides += [st.floats(min_value=hi, exclude_min=not d.high_open, **finite)] if hi is not None \
        else []
    return st.one_of(sides)


NUMBER_TEXT = st.one_of(st.integers(0, 10 ** 6).map(str),
                        st.floats(0, 1e6, allow_nan=False).map(repr))


def _split(want_inside: bool):
    sep = st.sampled_from([",", "/"])
    if want_inside:
        parts = st.lists(NUMBER_TEXT, min_size=1, max_size=3).filter(
            lambda ps: float(ps[0]) > 0)  # training (the first part) gets a share
        return st.tuples(parts, sep).map(lambda t: t[1].join(t[0]))
    bad = st.one_of(
        st.lists(NUMBER_TEXT, min_size=4, max_size=6),                        # too many parts
        st.lists(st.just("0"), min_size=1, max_size=3),                      # sums to zero
        st.lists(NUMBER_TEXT, min_size=1, max_size=2).map(lambda ps: ["0"] + ps),  # no training
        st.tuples(st.lists(NUMBER_TEXT, max_size=2),
                  st.sampled_from(["-1", "nan", "inf", "a", "", "1e999"])).map(
            lambda t: t[0] + [t[1]]))                                         # a bad part
    return st.tuples(bad, sep).map(lambda t: t[1].join(t[0]))


PREFIX = st.text("abc_/.0123", min_size=1, max_size=8).filter(lambda p: p.strip() == p
                                                              and " " not in p)


def _data_paths(want_inside: bool):
    weight = st.floats(1e-6, 1e6, allow_nan=False).map(repr)
    weighted = st.tuples(weight, PREFIX).map(" ".join)
    if want_inside:
        return st.one_of(PREFIX.map(lambda p: [p]), st.lists(weighted, min_size=1, max_size=3))
    bad_weight = st.tuples(st.sampled_from(["0", "-1", "nan", "inf"]), PREFIX).map(" ".join)
    # A first word that is no number makes the whole entry a prefix (spaces and all): fine
    # alone, an entry without a weight beside weighted ones.
    return st.one_of(
        st.tuples(st.lists(weighted, min_size=1, max_size=2), PREFIX).map(
            lambda t: t[0] + [t[1]]),                                        # one without weight
        st.lists(weighted, min_size=1, max_size=2).map(lambda ws: ws + ["x a"]),  # likewise
        st.tuples(st.lists(weighted, max_size=2), bad_weight).map(lambda t: t[0] + [t[1]]))


def _of_type(key: str):
    tp = base_type(key)
    return {bool: st.booleans(), str: st.text(max_size=10), int: st.integers(),
            float: st.floats(allow_nan=False, allow_infinity=False),
            list: st.lists(st.integers(1, 100), max_size=3)}[tp]


def _wrong_type(key: str):
    tp = base_type(key)
    words = st.text(min_size=1, max_size=4).filter(lambda s: not s.strip().isdigit())
    return {bool: st.integers(2, 9) | st.sampled_from(["maybe", "2"]),
            int: words | st.booleans(), float: words | st.booleans(),
            str: st.booleans() | st.lists(st.integers(), min_size=1, max_size=2),
            list: st.text(min_size=1, max_size=4).filter(lambda s: not s.strip().isdigit())
            | st.booleans()}[tp]


@st.composite
def key_and_value(draw):
    key = draw(st.sampled_from(sorted(DOMAINS)))
    d = DOMAINS[key]
    want_inside = draw(st.booleans())
    if d.kind == "interval":
        value = draw(_numbers(key, d, want_inside))
    elif d.kind == "choice":
        others = (st.integers() if isinstance(d.choices[0], int) else st.text(max_size=8))
        value = draw(st.sampled_from(d.choices) if want_inside
                     else others.filter(lambda v: v not in d.choices))
    elif key == "data.split":
        value = draw(_split(want_inside))
    elif key == "data.paths":
        value = draw(_data_paths(want_inside))
    else:  # free: anything of the type is inside, another type is outside
        value = draw(_of_type(key) if want_inside else _wrong_type(key))
    return key, value, want_inside


@FUZZ
@given(case=key_and_value())
def test_each_key_accepts_its_domain_and_refuses_the_rest(case):
    key, value, want_inside = case
    if want_inside:
        cfg = config_with(key, value)
        assert cfg.get(key) == value or (isinstance(value, list) and key == "data.paths")
        assert inside(key, cfg.get(key))
    else:
        with pytest.raises(UserError) as e:
            config_with(key, value)
        assert key.split(".")[-1] in str(e.value), (key, value, str(e.value))


# ---- tokenizer text -----------------------------------------------------------------------------

# Every code point, lone surrogates included (hypothesis' text() never draws them).
ANY_TEXT = st.lists(st.characters() | st.integers(0xD800, 0xDFFF).map(chr)
                    | st.sampled_from(["</s>", "<pad>", "\r\n", "\x00", "\ufeff"]),
                    max_size=20).map("".join)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from bloomtrain.data.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@FUZZ
@given(text=ANY_TEXT | st.binary(max_size=40).map(
    lambda b: b.decode("utf-8", errors="surrogateescape")))
def test_tokenizer_round_trip_or_clear_error(tok, text):
    """Any Unicode round-trips exactly; text UTF-8 cannot encode (lone surrogates, as JSON's
    "\\ud800" or invalid UTF-8 read with surrogateescape give) is a UserError saying so."""
    if _has_surrogate(text):
        with pytest.raises(UserError, match="lone surrogate"):
            tok.encode(text)
        with pytest.raises(UserError, match="text 1 of the batch"):
            tok.encode_batch(["ok", text])
    else:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, text]) == [ids, ids]


@FUZZ
@given(ids=st.lists(st.integers(-2 ** 70, 2 ** 70) | st.integers(0, 600), max_size=20))
def test_tokenizer_decode_any_ids(tok, ids):
    """Ids inside the vocabulary decode (to valid Unicode even when they cut a character);
    any other id is a UserError that names it, not an OverflowError or a silent drop."""
    if all(0 <= i < tok.vocab_size for i in ids):
        tok.decode(ids).encode("utf-8")
    else:
        with pytest.raises(UserError, match="outside the vocabulary"):
            tok.decode(ids)


@FUZZ
@given(line=st.binary(max_size=60) | ANY_TEXT.map(lambda t: json.dumps({"text": t}).encode())
       | st.text(max_size=20).map(lambda t: b'{"text": "' + t.encode() + b'\\ud800"}'))
def test_jsonl_records_of_any_bytes(tok, line):
    """A JSON-lines record of any bytes, as preprocess reads it: skipped with a reason (lone
    surrogates spelled as JSON escapes too, as not UTF-8), or text that round-trips."""
    from bloomtrain.data.sources import SKIP_REASONS, parse_record

    text, reason = parse_record("json", line, "text")
    if text is None:
        assert reason in SKIP_REASONS
        return
    assert not _has_surrogate(text)
    assert tok.decode(tok.encode(text)) == text


