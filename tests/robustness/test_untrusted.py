"""Untrusted files: checkpoints, HF directories, tokenizers and dataset caches from elsewhere.

A manifest (or an HF weight map) must not make bloomtrain read files outside the directory it
came with, and loading anything must never run code from it: no unpickling, no
`trust_remote_code`, `weights_only=True` wherever torch reads a file. Each payload below would
create a marker file if it ran; every test checks the marker never appears.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import bloomtrain
from bloomtrain import checkpoint as ckpt
from bloomtrain.checkpoint import hf
from bloomtrain.model import BloomShape, build_model, expected_parameters
from bloomtrain.errors import UserError

SHAPE = BloomShape(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=32)
PACKAGE = Path(bloomtrain.__file__).parent


class _Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-was-executed"
    yield path
    assert not path.exists(), "a loader executed code from an untrusted file"


def _checkpoint(root: Path) -> Path:
    return ckpt.save_checkpoint(root, 3, build_model(SHAPE, seed=0).state_dict(), SHAPE)


def _rewrite(step: Path, edit) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    edit(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


def _rename_file(step: Path, new: str) -> None:
    """Point every reference to the model shard at `new` instead."""
    def edit(m):
        m["files"][new] = m["files"].pop("model-00000.safetensors")
        for t in m["tensors"].values():
            for fr in t["fragments"]:
                fr["files"]["model"] = new
    _rewrite(step, edit)


def _refused_everywhere(step: Path, match: str) -> None:
    """The reader, verify, find_latest_valid, resolve and load_model all refuse `step`."""
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.CheckpointReader(step)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.verify(step)
    logged = []
    assert ckpt.find_latest_valid(step.parent, log=logged.append) is None
    assert any(step.name in line for line in logged)
    with pytest.raises(ckpt.CheckpointError, match=match):
        bloomtrain.load_model(step)


# ---- names that leave the checkpoint ------------------------------------------------------------

@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked_dir"])
def test_manifest_file_outside_the_checkpoint_is_refused(tmp_path, how):
    """The shard the manifest names is a valid copy (size and checksum match), so only the
    location check stands between the manifest and a file outside the checkpoint."""
    step = _checkpoint(tmp_path / "run")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(step / "model-00000.safetensors", outside / "model-00000.safetensors")
    if how == "dotdot":
        _rename_file(step, "../../elsewhere/model-00000.safetensors")
    elif how == "absolute":
        _rename_file(step, str(outside / "model-00000.safetensors"))
    elif how == "symlink":
        (step / "model-00000.safetensors").symlink_to(outside / "model-00000.safetensors")
    else:
        (step / "shards").symlink_to(outside)
        _rename_file(step, "shards/model-00000.safetensors")
    _refused_everywhere(step, "outside|symlink leading out")


def test_manifest_tokenizer_outside_the_checkpoint_is_refused(tmp_path, tiny_tokenizer_dir):
    from bloomtrain.data.tokenizer import load_tokenizer

    step = ckpt.save_checkpoint(tmp_path / "run", 3, build_model(SHAPE, seed=0).state_dict(),
                                SHAPE, tokenizer=load_tokenizer(tiny_tokenizer_dir))
    _rewrite(step, lambda m: m.update(tokenizer="../../tok"))
    shutil.copytree(step / "tokenizer", tmp_path / "tok")
    _refused_everywhere(step, "outside")
    # The directory itself a symlink out, with the manifest's name unchanged.
    _rewrite(step, lambda m: m.update(tokenizer="tokenizer"))
    shutil.rmtree(step / "tokenizer")
    (step / "tokenizer").symlink_to(tmp_path / "tok")
    _refused_everywhere(step, "symlink leading out")


def test_latest_pointing_outside_the_root_is_refused(tmp_path):
    step = _checkpoint(tmp_path / "run")
    shutil.copytree(step, tmp_path / "other" / step.name)
    (tmp_path / "run" / "latest").write_text(f"../other/{step.name}\n")
    with pytest.raises(ckpt.CheckpointError, match="outside"):
        ckpt.resolve(tmp_path / "run")
    (tmp_path / "run" / "latest").write_text(step.name + "\n")
    assert ckpt.resolve(tmp_path / "run") == step


def _hf_dir(path: Path, shards: dict[str, list[str]] | None = None) -> dict:
    """An HF Bloom directory of SHAPE: one model.safetensors, or the given shards (file name ->
    tensor names) with a model.safetensors.index.json. Returns the state."""
    from safetensors.torch import save_file

    state = {k: v for k, v in build_model(SHAPE, seed=1).state_dict().items()
             if k != "lm_head.weight"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf.hf_config_from_shape(SHAPE)))
    if shards is None:
        save_file(state, path / "model.safetensors")
        return state
    weight_map = {}
    for fname, names in shards.items():
        save_file({n: state[n].contiguous() for n in names}, path / fname)
        weight_map.update({n: fname for n in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def _split(names):
    half = len(names) // 2
    return {"a.safetensors": names[:half], "b.safetensors": names[half:]}


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_hf_weight_map_outside_the_directory_is_refused(tmp_path, how):
    names = sorted(expected_parameters(SHAPE))
    state = _hf_dir(tmp_path / "hf", _split(names))
    assert set(hf.collect_hf_state(tmp_path / "hf")[1]) == set(state)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(tmp_path / "hf" / "b.safetensors", outside / "b.safetensors")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    target = {"dotdot": "../elsewhere/b.safetensors",
              "absolute": str(outside / "b.safetensors"), "symlink": "b.safetensors"}[how]
    if how == "symlink":
        (tmp_path / "hf" / "b.safetensors").symlink_to(outside / "b.safetensors")
    index.write_text(json.dumps({"weight_map": {
        n: target if f == "b.safetensors" else f for n, f in weight_map.items()}}))
    with pytest.raises(UserError, match="outside|symlink leading out"):
        hf.collect_hf_state(tmp_path / "hf")
    with pytest.raises(UserError, match="outside|symlink leading out"):
        hf.import_hf(tmp_path / "hf", tmp_path / "imported", log=lambda *_: None)
    assert not (tmp_path / "imported").exists()


def test_hf_hub_cache_snapshot_symlinks_still_load(tmp_path):
    """The HF hub cache keeps files in blobs/ and links them from snapshots/REV/: the one
    layout where a weight file leaves its directory legitimately."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    state = _hf_dir(tmp_path / "src")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in (tmp_path / "src").iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    _, loaded, _ = hf.collect_hf_state(snapshot)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


# ---- nothing executes --------------------------------------------------------------------------

def test_pickled_checkpoint_shard_is_refused(tmp_path, marker):
    """A shard replaced by a pickle, with the manifest's size and checksum fixed to match."""
    step = _checkpoint(tmp_path / "run")
    # Protocol 2, the one torch.save writes, so that torch.load reads as far as the payload.
    payload = pickle.dumps({"transformer.word_embeddings.weight": _Payload(marker)}, protocol=2)
    (step / "model-00000.safetensors").write_bytes(payload)
    _rewrite(step, lambda m: m["files"].update({"model-00000.safetensors": {
        "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}}))
    with pytest.raises(ckpt.CheckpointError, match="safetensors"):
        bloomtrain.load_model(step)
    with pytest.raises(ckpt.CheckpointError):
        hf.export_hf(step, tmp_path / "export", log=lambda *_: None)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_pickled_hf_bin_is_refused(tmp_path, marker, sharded):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hf.hf_config_from_shape(SHAPE)))
    # Protocol 2, the one torch.save writes, so that torch.load reads as far as the payload.
    payload = pickle.dumps({"transformer.word_embeddings.weight": _Payload(marker)}, protocol=2)
    if sharded:
        (hf_dir / "pytorch_model-00001-of-00001.bin").write_bytes(payload)
        (hf_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
            "transformer.word_embeddings.weight": "pytorch_model-00001-of-00001.bin"}}))
    else:
        (hf_dir / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(UserError, match="weights_only"):
        hf.import_hf(hf_dir, tmp_path / "imported", log=lambda *_: None)
    with pytest.raises(UserError, match="weights_only"):
        bloomtrain.load_model(hf_dir)


def test_plain_torch_bin_still_loads(tmp_path):
    """weights_only=True refuses code, not tensors: a torch.save'd state dict imports."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hf.hf_config_from_shape(SHAPE)))
    state = {k: v for k, v in build_model(SHAPE, seed=2).state_dict().items()
             if k != "lm_head.weight"}
    torch.save(state, hf_dir / "pytorch_model.bin")
    _, loaded, _ = hf.collect_hf_state(hf_dir)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


def _tokenizer_with_remote_code(src: Path, dst: Path, marker: Path, with_json: bool) -> None:
    """A tokenizer directory whose tokenizer_config.json asks transformers to import a module
    shipped beside it (auto_map), as Hub repos with trust_remote_code do."""
    dst.mkdir()
    if with_json:
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    (dst / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass EvilTokenizer: pass\n")


def test_tokenizer_remote_code_is_never_run(tmp_path, tiny_tokenizer_dir, marker):
    from bloomtrain.data.tokenizer import load_tokenizer

    evil = tmp_path / "tok"
    _tokenizer_with_remote_code(tiny_tokenizer_dir, evil, marker, with_json=True)
    tok = load_tokenizer(evil)
    assert tok.decode(tok.encode("hello")) == "hello"
    # Through import-hf, which copies an HF directory's tokenizer into the checkpoint.
    _hf_dir(tmp_path / "hf")
    for f in evil.iterdir():
        shutil.copyfile(f, tmp_path / "hf" / f.name)
    step = hf.import_hf(tmp_path / "hf", tmp_path / "imported", log=lambda *_: None)
    assert (step / "tokenizer" / "tokenizer.json").is_file()
    # Without a tokenizer.json only the remote code could build it: refused instead.
    bare = tmp_path / "bare"
    _tokenizer_with_remote_code(tiny_tokenizer_dir, bare, marker, with_json=False)
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(bare)


def _gpt_dataset(tmp_path: Path):
    from bloomtrain.data.gpt_dataset import GPTDataset
    from bloomtrain.data.indexed import MMapIndexedDataset, write_dataset

    if not (tmp_path / "data.idx").exists():
        write_dataset(tmp_path / "data", [[list(range(i, i + 7))] for i in range(6)])
    ds = MMapIndexedDataset(tmp_path / "data")
    return GPTDataset("train", ds, np.arange(6), num_samples=8, seq_length=4, seed=1,
                      cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("form", ["npy_object_array", "raw_pickle"])
def test_pickled_index_cache_is_refused_and_rebuilt(tmp_path, marker, form):
    first = _gpt_dataset(tmp_path)
    expected = [first[i] for i in range(len(first))]
    target = first.paths["doc"]
    if form == "npy_object_array":
        with open(target, "wb") as f:
            np.save(f, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    else:
        target.write_bytes(pickle.dumps(_Payload(marker)))
    again = _gpt_dataset(tmp_path)
    assert [again[i].tolist() for i in range(len(again))] == [e.tolist() for e in expected]
    assert np.load(target, allow_pickle=False).dtype.kind in "iu"  # rebuilt as plain integers


def test_index_cache_with_wrong_values_is_a_clear_error(tmp_path):
    """Right shape and dtype, wrong values (the cache is keyed by a hash, but anyone can write
    the file): the sample that meets them names the cache instead of an IndexError."""
    first = _gpt_dataset(tmp_path)
    sample = np.load(first.paths["sample"], allow_pickle=False).copy()
    sample[:, 0] = 10 ** 6
    np.save(first.paths["sample"], sample, allow_pickle=False)
    again = _gpt_dataset(tmp_path)
    with pytest.raises(UserError, match="sample-index cache .* is corrupt"):
        again[0]


# ---- static: no code path that could unpickle or run remote code ---------------------------------

def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            keywords = {k.arg: k.value for k in node.keywords}
            yield node, owner, name, keywords


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def test_package_never_unpickles_or_trusts_remote_code():
    """Every module of the package: torch.load only with weights_only=True; no pickle, dill,
    marshal or shelve loads; no allow_pickle=True; no trust_remote_code=True; no unsafe YAML
    loader."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                bad = [n for n in names if n.split(".")[0] in ("pickle", "dill", "cloudpickle",
                                                                "marshal", "shelve", "joblib")]
                if bad:
                    problems.append(f"{where}:{node.lineno}: imports {bad}")
        for node, owner, name, keywords in _calls(tree):
            line = f"{where}:{node.lineno}"
            if owner == "torch" and name == "load" and not _is_true(keywords.get("weights_only")):
                problems.append(f"{line}: torch.load without weights_only=True")
            if _is_true(keywords.get("allow_pickle")):
                problems.append(f"{line}: allow_pickle=True")
            if _is_true(keywords.get("trust_remote_code")):
                problems.append(f"{line}: trust_remote_code=True")
            # yaml's SafeLoader (and ours, built on it) and BaseLoader, which builds strings,
            # lists and dicts only, construct no Python object a file names.
            loader = ast.unparse(keywords.get("Loader", node))
            if owner == "yaml" and (name in ("unsafe_load", "full_load") or (
                    name == "load" and "Safe" not in loader and
                    loader not in ("yaml.BaseLoader", "BaseLoader"))):
                problems.append(f"{line}: yaml.{name} without a safe loader")
            if name == "from_pretrained":
                problems.append(f"{line}: from_pretrained (transformers may run the "
                                f"directory's code)")
        for node in ast.walk(tree):
            ident = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else \
                node.name if isinstance(node, ast.alias) else ""
            if ident.startswith(("AutoTokenizer", "AutoModel", "AutoConfig")):
                problems.append(f"{where}:{getattr(node, 'lineno', '?')}: transformers' {ident}")
    assert not problems, "\n".join(problems)


def test_a_lone_weight_file_symlinked_elsewhere_loads_as_transformers_loads_it(tmp_path):
    """model.safetensors is a fixed name, not one an untrusted index gives: a link there is the
    directory's own layout (git-annex, DVC, weights on another disk), which transformers loads.
    It was refused, with no way out named."""
    state = _hf_dir(tmp_path / "src")
    (tmp_path / "hf").mkdir()
    shutil.copyfile(tmp_path / "src" / "config.json", tmp_path / "hf" / "config.json")
    (tmp_path / "store").mkdir()
    shutil.move(tmp_path / "src" / "model.safetensors", tmp_path / "store" / "w.safetensors")
    (tmp_path / "hf" / "model.safetensors").symlink_to(tmp_path / "store" / "w.safetensors")
    _, loaded, _ = hf.collect_hf_state(tmp_path / "hf")
    assert all(torch.equal(loaded[n], t) for n, t in state.items())
    from transformers import BloomForCausalLM
    BloomForCausalLM.from_pretrained(tmp_path / "hf")  # the reference loads it too
