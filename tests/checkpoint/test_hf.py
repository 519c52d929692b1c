"""HF interop: logits parity with transformers' BloomForCausalLM, bit-exact import/export, CLI.

Tolerance: 1e-4 max abs on fp32 logits. HF computes attention with baddbmm and an explicit fp32
softmax, bloomtrain with SDPA and a relative-position ALiBi bias; on these tiny models the two
orders of summation differ by ~1e-6, so 1e-4 leaves margin without hiding a real mismatch (a wrong
slope or a transposed QKV layout moves logits by >1e-2).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import bloomtrain
from bloomtrain import checkpoint
from bloomtrain.checkpoint import hf
from bloomtrain.cli import main
from bloomtrain.errors import UserError
from tests.hf_reference import ATOL, make_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_thread")

# name -> (BloomConfig kwargs, perturb biases and LayerNorms away from their init)
CONFIGS = {
    "h64_4heads": (dict(hidden_size=64, n_head=4, n_layer=3, vocab_size=256), False),
    "h96_12heads": (dict(hidden_size=96, n_head=12, n_layer=2, vocab_size=256), False),
    "h48_6heads": (dict(hidden_size=48, n_head=6, n_layer=2, vocab_size=256), False),
    "perturbed": (dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=256), True),
}


def save_bin(model, path, strip_prefix=False, num_shards=1):
    """pytorch_model.bin as transformers 4.x's save_pretrained(safe_serialization=False) wrote it
    (transformers 5 writes safetensors only). strip_prefix mimics old BloomModel checkpoints."""
    path.mkdir(parents=True)
    model.config.to_json_file(path / "config.json")
    state = model.state_dict()  # includes the tied lm_head.weight
    if strip_prefix:
        state = {k.removeprefix("transformer."): v for k, v in state.items()
                 if k != "lm_head.weight"}
    if num_shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return path
    names = list(state)
    weight_map = {}
    for i in range(num_shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        part = {n: state[n] for n in names[i::num_shards]}
        torch.save(part, path / shard)
        weight_map.update({n: shard for n in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def read_safetensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_bitwise_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        a_bytes, b_bytes = (t.reshape(-1).view(torch.uint8) for t in (a[k], b[k]))
        assert torch.equal(a_bytes, b_bytes), k


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logit_parity_safetensors_and_bin(name, ids, tmp_path, device):
    kwargs, perturb = CONFIGS[name]
    ref = make_hf_model(kwargs, perturb=perturb)
    want = hf_logits(ref, ids)  # HF on the CPU is the reference on every device
    ref.save_pretrained(tmp_path / "st")
    save_bin(ref, tmp_path / "bin")
    for fmt in ("st", "bin"):
        got = bloomtrain.load_model(tmp_path / fmt, device=device)(ids.to(device)).cpu()
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < ATOL, fmt
        ckpt = hf.import_hf(tmp_path / fmt, tmp_path / f"ckpt_{fmt}", log=lambda *_: None)
        # a root with `latest`
        got = bloomtrain.load_model(ckpt.parent, device=device)(ids.to(device)).cpu()
        assert (got - want).abs().max().item() < ATOL, fmt


@pytest.mark.parametrize("name", ["h64_4heads", "perturbed"])
def test_bf16_logits_as_close_to_fp32_as_hf(name, ids, tmp_path, device):
    """bf16 parity: HF's own bf16 model is the yardstick. Both sides run the same bf16 weights on
    `device`; each one's logits are compared with HF's fp32 logits on the CPU. Ours may be at
    most 1.5x HF's error plus 2^-8 of the largest logit (half to one bf16 ulp there): the two
    round in different places (HF: absolute ALiBi positions and baddbmm; ours: relative
    positions, SDPA), so neither is exact. Measured on the CPU: ours 0.0043 / 0.0052 vs HF's
    0.0046 / 0.0052 (bound 0.0125 / 0.013); a wrong cast (a bf16 softmax or bias) costs
    several times HF's error. The errors are in the assertion message."""
    kwargs, perturb = CONFIGS[name]
    ref = make_hf_model(kwargs, perturb=perturb)
    want = hf_logits(ref, ids)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf_bf16 = hf_logits(ref.to(device), ids.to(device)).float().cpu()
    ours = bloomtrain.load_model(tmp_path / "bf16", device=device)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = ours(ids.to(device)).float().cpu()
    hf_err = (hf_bf16 - want).abs().max().item()
    our_err = (got - want).abs().max().item()
    slack = 2.0 ** -8 * want.abs().max().item()
    assert our_err <= 1.5 * hf_err + slack, (our_err, hf_err, slack)


def test_load_model_contract(tmp_path, ids):
    ref = make_hf_model(CONFIGS["h64_4heads"][0])
    ref.save_pretrained(tmp_path / "st")
    model = bloomtrain.load_model(tmp_path / "st")
    assert not model.training
    assert model.lm_head.weight is model.transformer.word_embeddings.weight
    assert model.transformer.alibi_slopes.dtype == torch.float32
    bf16 = bloomtrain.load_model(tmp_path / "st", dtype="bf16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.lm_head.weight is bf16.transformer.word_embeddings.weight
    assert bf16(ids).shape == (2, 16, 256)
    assert bloomtrain.load_model(tmp_path / "st", device="auto").lm_head.weight.device.type == \
        ("cuda" if torch.cuda.is_available() else "cpu")
    # A device that is not there: the loader's one-line error, before the model is read
    # (torch's AssertionError or RuntimeError after it).
    import bloomtrain.checkpoint.load as load
    read = []
    real = load.load_sharded
    monkey = pytest.MonkeyPatch()
    monkey.setattr(load, "load_sharded", lambda *a, **k: read.append(1) or real(*a, **k))
    try:
        for bad, match in (("gpu0", "unknown device 'gpu0'"),
                           *([] if torch.cuda.is_available() else
                             [("cuda", "no CUDA device is visible")])):
            with pytest.raises(UserError, match=match):
                bloomtrain.load_model(tmp_path / "st", device=bad)
    finally:
        monkey.undo()
    assert not read
    # Our checkpoint, whole on one device: its files are hashed once (a partial reader, opened
    # and dropped first, hashed them all as well: half of a large load's time).
    import bloomtrain.checkpoint.reader as reader
    ckpt = hf.import_hf(tmp_path / "st", tmp_path / "ck", log=lambda *_: None)
    verified = []
    real_verify = reader.verify_shared
    monkey.setattr(reader, "verify_shared",
                   lambda *a, **k: verified.append(1) or real_verify(*a, **k))
    try:
        bloomtrain.load_model(ckpt)
    finally:
        monkey.undo()
    assert len(verified) == 1


def test_sharded_and_unprefixed_inputs(tmp_path, ids):
    ref = make_hf_model(CONFIGS["h64_4heads"][0], seed=3)
    original = read_safetensors(_save(ref, tmp_path / "orig"))
    ref.save_pretrained(tmp_path / "st_sharded", max_shard_size="40KB")
    assert (tmp_path / "st_sharded" / "model.safetensors.index.json").is_file()
    save_bin(ref, tmp_path / "bin_sharded", num_shards=3)
    save_bin(ref, tmp_path / "bin_bare", strip_prefix=True)
    for src in ("st_sharded", "bin_sharded", "bin_bare"):
        ckpt = hf.import_hf(tmp_path / src, tmp_path / f"ckpt_{src}", log=lambda *_: None)
        reader = checkpoint.CheckpointReader(ckpt)
        assert_bitwise_equal({n: reader.load(n) for n in reader.names()}, original)


def _save(model, path):
    model.save_pretrained(path)
    return path / "model.safetensors"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_import_export_roundtrip_bitwise(dtype, tmp_path, ids):
    ref = make_hf_model(CONFIGS["perturbed"][0], seed=5, perturb=True, dtype=dtype)
    original = read_safetensors(_save(ref, tmp_path / "hf"))
    ckpt = hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest["source"] == "hf" and manifest["step"] == 0
    out = hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)
    exported = read_safetensors(out / "model.safetensors")
    assert_bitwise_equal(exported, original)
    assert "lm_head.weight" not in exported

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == str(dtype).removeprefix("torch.")
    assert cfg["vocab_size"] == 256 and cfg["tie_word_embeddings"] is True
    reloaded, info = transformers.BloomForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert reloaded.lm_head.weight is reloaded.transformer.word_embeddings.weight
    assert reloaded.dtype == dtype
    # Same weights and the same HF code: identical logits in any dtype.
    assert torch.equal(hf_logits(reloaded.eval(), ids), hf_logits(ref, ids))
    if dtype == torch.float32:
        ours = bloomtrain.load_model(out)(ids)
        assert (ours - hf_logits(ref, ids)).abs().max().item() < ATOL


def test_export_own_checkpoint_with_tokenizer(tmp_path, tiny_tokenizer_dir):
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.model import BloomShape, build_model

    tok = load_tokenizer(tiny_tokenizer_dir)
    shape = BloomShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    model = build_model(shape, seed=7)
    with torch.no_grad():  # move LayerNorms and biases off their init, as training would
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    checkpoint.save_checkpoint(tmp_path / "run", 100, model.state_dict(), shape, tokenizer=tok)
    out = hf.export_hf(tmp_path / "run", tmp_path / "export", log=lambda *_: None)

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 3)
    assert cfg["vocab_size"] == 512  # the padded size, not the tokenizer's

    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog.")])
    reloaded, info = transformers.BloomForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        want = model.eval()(ids)
    assert (hf_logits(reloaded.eval(), ids) - want).abs().max().item() < ATOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("héllo 数据").input_ids == tok.encode("héllo 数据")


def test_export_replaces_previous_export_only(tmp_path, monkeypatch):
    ref = make_hf_model(CONFIGS["h48_6heads"][0])
    ref.save_pretrained(tmp_path / "hf")
    hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)  # overwrites
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export", "hf"]  # no temp left
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a previous bloomtrain export"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "other", log=lambda *_: None)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    # The HF directory the checkpoint came from (save_pretrained's files: the very names an
    # export writes) is not taken for a previous export: it was replaced, its weights gone.
    weights = (tmp_path / "hf" / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="not a previous bloomtrain export"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "hf", log=lambda *_: None)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == weights
    # A previous export that has been added to (a model card, a hub clone's .git) is not
    # replaced either: that would delete them.
    (tmp_path / "export" / "README.md").write_text("model card")
    (tmp_path / "export" / ".git").mkdir()
    with pytest.raises(UserError, match=r"holds files an export does not write \(\.git, "
                                        r"README\.md\)"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)
    assert (tmp_path / "export" / "README.md").read_text() == "model card"
    # A link: replacing it moved the link and left its target as it was.
    (tmp_path / "link").symlink_to(tmp_path / "other")
    with pytest.raises(UserError, match="is a symbolic link; give the directory it points to"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "link", log=lambda *_: None)
    # --output . (the directory one is in) has no name to put the temporary beside.
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    inode = os.stat(".").st_ino
    hf.export_hf(tmp_path / "ckpt", ".", log=lambda *_: None)
    assert (tmp_path / "here" / "model.safetensors").is_file()
    # An existing directory (empty, or a previous export) is written into, never renamed: an
    # empty mount point (a container's volume) refused with EBUSY, and the shell inside
    # `--output .` was left in a deleted directory that listed empty.
    assert os.stat(".").st_ino == inode and "model.safetensors" in os.listdir(".")
    real_replace = os.replace

    def no_renaming_of(*dirs):
        def replace(src, dst):
            if Path(src).absolute() in dirs:
                raise OSError(errno.EBUSY, "Device or resource busy", str(src))
            return real_replace(src, dst)
        return replace
    (tmp_path / "mount").mkdir()
    monkeypatch.setattr(os, "replace", no_renaming_of(tmp_path / "mount", tmp_path / "export2"))
    hf.export_hf(tmp_path / "ckpt", tmp_path / "mount", log=lambda *_: None)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "mount", log=lambda *_: None)  # a previous one
    assert sorted(p.name for p in (tmp_path / "mount").iterdir()) == sorted(
        p.name for p in (tmp_path / "here").iterdir())
    assert (tmp_path / "mount" / "model.safetensors").read_bytes() == \
        (tmp_path / "here" / "model.safetensors").read_bytes()
    # Killed (Ctrl-C here) while a re-export renamed its files over the previous export's: the
    # marker had been removed first, and every later export refused the directory as "not a
    # previous bloomtrain export". The marker now stays, as the partial one, until the end.
    monkeypatch.setattr(os, "replace", real_replace)
    calls = []

    def interrupted(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "mount", log=lambda *_: None)
    assert calls == [".bloomtrain_export.partial.json", "config.json"]
    assert not (tmp_path / "mount" / ".bloomtrain_export.json").exists()
    monkeypatch.setattr(os, "replace", real_replace)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "mount", log=lambda *_: None)
    assert sorted(p.name for p in (tmp_path / "mount").iterdir()) == sorted(
        p.name for p in (tmp_path / "here").iterdir())


def test_an_imported_vocabulary_off_the_default_multiple_is_told_how_to_resume(tmp_path,
                                                                               dataset):
    """An HF model of 320 rows (not a multiple of 128): the config's vocabulary is padded to
    384 whatever model.vocab_size says, and the refusal asked for the settings the checkpoint
    was saved with, which the user had given. It now names the multiple, and those settings
    fine-tune."""
    from bloomtrain.errors import UserError
    from bloomtrain.train import train
    from tests.helpers import make_cfg

    make_hf_model(dict(hidden_size=48, n_head=6, n_layer=2, vocab_size=320)).save_pretrained(
        tmp_path / "hf")
    imported = hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    model = {"preset": None, "hidden_size": 48, "num_layers": 2, "num_heads": 6,
             "vocab_size": 320}
    with pytest.raises(UserError, match=r"vocab_size 320 \(config: 384\).*padded to a multiple of "
                                        r"model.make_vocab_size_divisible_by, 128: for 320 rows "
                                        r"set model.vocab_size=320 "
                                        r"model.make_vocab_size_divisible_by=64"):
        train(make_cfg(dataset, tmp_path / "a", model=model, train__train_iters=1,
                       checkpoint={"resume": str(imported)}), log=lambda *_: None)
    result = train(make_cfg(dataset, tmp_path / "b", train__train_iters=1,
                            model={**model, "make_vocab_size_divisible_by": 64},
                            checkpoint={"resume": str(imported)}), log=lambda *_: None)
    assert result.state.step == 1


def test_an_imported_model_fine_tunes_with_its_own_dropout_and_init_std(tmp_path, dataset):
    """README's fine-tune of real BLOOM weights: `checkpoint.resume=IMPORTED` with the run's own
    dropout and init std (the bloom-* presets' 0.0048, where HF's configs say 0.02) resumes;
    a setting the weights fix (their shapes, the LayerNorm epsilon) must match."""
    from bloomtrain.train import train
    from tests.helpers import make_cfg

    make_hf_model(CONFIGS["h48_6heads"][0]).save_pretrained(tmp_path / "hf")
    imported = hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    shape = checkpoint.read_manifest(imported)["model_shape"]
    model = {"hidden_size": shape["hidden_size"], "num_layers": shape["num_layers"],
             "num_heads": shape["num_heads"], "ffn_hidden_size": shape["ffn_hidden_size"],
             "vocab_size": shape["vocab_size"], "hidden_dropout": 0.1,
             "init_method_std": 0.0048}
    result = train(make_cfg(dataset, tmp_path / "ft", model=model, train__train_iters=1,
                            checkpoint={"resume": str(imported)}), log=lambda *_: None)
    assert result.state.step == 1
    with pytest.raises(UserError, match="layer_norm_epsilon 1e-05 \\(config: 0.001\\)"):
        train(make_cfg(dataset, tmp_path / "eps", model={**model, "layer_norm_epsilon": 1e-3},
                       train__train_iters=1, checkpoint={"resume": str(imported)}),
              log=lambda *_: None)


def test_import_rejects_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        hf.import_hf(tmp_path / "nope", tmp_path / "out")
    # A weights file given for the directory: said so, not "does not exist".
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="model.safetensors is a file; an HF model is a directory"):
        hf.import_hf(tmp_path / "model.safetensors", tmp_path / "out")
    ref = make_hf_model(CONFIGS["h48_6heads"][0])
    ref.save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())

    for patch, match in (({"model_type": "gpt2"}, "model_type 'gpt2'"),
                         ({"apply_residual_connection_post_layernorm": True}, "post_layernorm"),
                         ({"tie_word_embeddings": False}, "tie_word_embeddings"),
                         ({"n_layer": 3}, "missing"),
                         ({"hidden_size": 50}, "divisible"),
                         # HF's slow path drops the output biases: another model's logits.
                         ({"pretraining_tp": 2, "slow_but_exact": True},
                          "slow_but_exact=true with pretraining_tp=2 is not supported"),
                         # Two spellings of one setting that disagree: whichever transformers
                         # takes, one of them is wrong (the logits moved by 3.8 at 4 vs 8).
                         ({"n_head": 6, "num_attention_heads": 3},
                          "sets n_head=6 and num_attention_heads=3")):
        cfg_path.write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(UserError, match=match):
            hf.import_hf(tmp_path / "hf", tmp_path / "out")
    cfg_path.write_text(json.dumps(cfg))
    # Integer weights were imported (the manifest said int32) and loading the checkpoint then
    # failed inside torch's load_state_dict; the sliced reader already refused them.
    from safetensors.torch import load_file, save_file
    weights = tmp_path / "hf" / "model.safetensors"
    good = weights.read_bytes()
    state = load_file(weights)
    name = "transformer.h.0.input_layernorm.weight"
    save_file({**state, name: (state[name] * 100).to(torch.int32)}, weights,
              metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"{name} is stored as int32; expected float32, "
                                        f"bfloat16 or float16 weights"):
        hf.import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    weights.write_bytes(good)
    # An --output that is a file was "cannot create afile/.step_00000000.tmp (File exists)";
    # a save that failed (a full disk) left the empty root it had made.
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="--output .*afile exists and is not a directory"):
        hf.import_hf(tmp_path / "hf", tmp_path / "afile")
    real_save = checkpoint.save_checkpoint

    def full_disk(root, *a, **k):
        Path(root).mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device")
    checkpoint.save_checkpoint = full_disk
    try:
        with pytest.raises(UserError, match="No space left on device"):
            hf.import_hf(tmp_path / "hf", tmp_path / "new" / "ckpt")
    finally:
        checkpoint.save_checkpoint = real_save
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "ckpt").exists()

    untied = tmp_path / "untied"
    save_bin(ref, untied)
    state = torch.load(untied / "pytorch_model.bin", weights_only=True)
    state["lm_head.weight"] = state["lm_head.weight"].clone() + 1
    torch.save(state, untied / "pytorch_model.bin")
    with pytest.raises(UserError, match="untied"):
        hf.import_hf(untied, tmp_path / "out")

    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no weights"):
        hf.import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shape_config_roundtrip():
    from bloomtrain.model import BloomShape

    shape = BloomShape(vocab_size=250880, hidden_size=1024, num_layers=24, num_heads=16,
                       ffn_hidden_size=4096, init_method_std=0.0048)
    cfg = hf.hf_config_from_shape(shape, {"dtype": "bfloat16", "eos_token_id": 2})
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["BloomForCausalLM"]
    assert hf.shape_from_hf_config(cfg) == shape
    # bigscience/bloom's own config spells the width n_embed and heads num_attention_heads.
    old = {"model_type": "bloom", "n_embed": 14336, "num_attention_heads": 112, "n_layer": 70,
           "vocab_size": 250880, "pretraining_tp": 4, "slow_but_exact": False}
    big = hf.shape_from_hf_config(old)
    assert (big.hidden_size, big.num_heads, big.ffn_hidden_size) == (14336, 112, 57344)
    assert transformers.BloomConfig(**cfg).hidden_size == 1024


def test_cli_import_export(tmp_path, capsys, ids):
    ref = make_hf_model(CONFIGS["h64_4heads"][0])
    ref.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", "--input", str(tmp_path / "hf"), "--output",
                 str(tmp_path / "ckpt")]) == 0
    assert "no tokenizer.json" in capsys.readouterr().out
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                 str(tmp_path / "export")]) == 0
    assert_bitwise_equal(read_safetensors(tmp_path / "export" / "model.safetensors"),
                         read_safetensors(tmp_path / "hf" / "model.safetensors"))

    assert main(["import-hf", "--input", str(tmp_path / "missing"), "--output",
                 str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    shutil.copytree(tmp_path / "hf", tmp_path / "gpt2")
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert main(["import-hf", "--input", str(tmp_path / "gpt2"), "--output",
                 str(tmp_path / "x")]) == 2
    assert "model_type 'gpt2'" in capsys.readouterr().err
    assert main(["export-hf", "--checkpoint", str(tmp_path / "nothing"), "--output",
                 str(tmp_path / "y")]) == 2
    assert "no bloomtrain checkpoint" in capsys.readouterr().err


def test_export_ignores_optimizer_state_but_checks_weights(tmp_path):
    from bloomtrain.model import BloomShape, build_model

    shape = BloomShape(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2,
                       ffn_hidden_size=128)
    state = build_model(shape, seed=1).state_dict()
    optim = {f"exp_avg.{n}": torch.zeros_like(t) for n, t in state.items() if n != "lm_head.weight"}
    step = checkpoint.save_checkpoint(tmp_path / "run", 5, state, shape, optim_state=optim)
    (step / "optim-00000.safetensors").write_bytes(b"truncated")  # never read by export/load_model
    hf.export_hf(tmp_path / "run", tmp_path / "export", log=lambda *_: None)
    assert bloomtrain.load_model(tmp_path / "run")(torch.tensor([[1, 2, 3]])).shape == (1, 3, 256)

    weights = step / "model-00000.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum"):
        hf.export_hf(tmp_path / "run", tmp_path / "export2", log=lambda *_: None)
    assert not (tmp_path / "export2").exists()


def test_a_chat_template_file_is_served_and_carried_through_import_and_export(
        tmp_path, tiny_tokenizer_dir):
    # transformers 4.43+ saves the chat template as chat_template.jinja, not in
    # tokenizer_config.json: serve found none, and import -> export dropped the file.
    transformers = pytest.importorskip("transformers")
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.serve.chat import template_source
    make_hf_model(CONFIGS["h48_6heads"][0]).save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_tokenizer_dir / name).is_file():
            shutil.copyfile(tiny_tokenizer_dir / name, tmp_path / "hf" / name)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "hf" / "chat_template.jinja").write_text(template)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == template
    assert template_source(load_tokenizer(tmp_path / "hf"), None) == template
    ckpt = hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    hf.export_hf(ckpt, tmp_path / "export", log=lambda *_: None)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert exported.chat_template == template


def test_a_vocabulary_that_does_not_split_over_tp_names_a_tp_that_does(tmp_path):
    # Loading (serve, eval) cannot pad a stored vocabulary: the training advice
    # (model.make_vocab_size_divisible_by) was one `serve` refuses to take.
    from types import SimpleNamespace

    from bloomtrain.checkpoint.load import load_sharded
    from bloomtrain.layout import ParallelLayout
    make_hf_model(dict(hidden_size=48, n_head=6, n_layer=2, vocab_size=255)).save_pretrained(
        tmp_path / "hf")
    topo = SimpleNamespace(layout=ParallelLayout(tp=2))
    with pytest.raises(UserError, match=r"vocabulary \(255 rows\) does not split over tp=2; "
                                        r"load it with a tp that divides it \(tp=1 here\)"):
        load_sharded(tmp_path / "hf", topo)


def test_import_replaces_a_step_0_of_its_own_directory_only(tmp_path):
    """import-hf exempted step 0 from its "already holds a training run" refusal, so importing
    another model into the same --output replaced the first one's checkpoint without a word."""
    make_hf_model(CONFIGS["h48_6heads"][0]).save_pretrained(tmp_path / "a")
    make_hf_model(CONFIGS["h48_6heads"][0], seed=1).save_pretrained(tmp_path / "b")
    step = hf.import_hf(tmp_path / "a", tmp_path / "out", log=lambda *_: None)
    hf.import_hf(tmp_path / "a", tmp_path / "out", log=lambda *_: None)  # a retry: replaced
    before = {p.name: p.read_bytes() for p in step.iterdir() if p.is_file()}
    with pytest.raises(UserError, match=rf"already holds a step-0 checkpoint \(imported from "
                                        rf"{tmp_path / 'a'}\); import into a new directory"):
        hf.import_hf(tmp_path / "b", tmp_path / "out", log=lambda *_: None)
    assert {p.name: p.read_bytes() for p in step.iterdir() if p.is_file()} == before


def test_export_failures_are_one_line_and_a_killed_exports_staging_is_cleared(tmp_path,
                                                                             monkeypatch):
    """Only a full disk was one line: EFBIG (ulimit -f, FAT32's 4 GiB), EPERM or EROFS were a
    traceback. A killed export to a new directory left its staging folder beside it forever."""
    import subprocess
    import sys
    make_hf_model(CONFIGS["h48_6heads"][0]).save_pretrained(tmp_path / "hf")
    hf.import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda *_: None)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)
    before = (tmp_path / "export" / "model.safetensors").read_bytes()
    from bloomtrain.checkpoint.hf import convert

    def too_large(*a, **k):
        raise OSError(errno.EFBIG, "File too large")
    with monkeypatch.context() as m:
        m.setattr(convert, "_write_export", too_large)
        with pytest.raises(UserError, match=r"failed: File too large; nothing was written under "
                                            r"that name, and an export already there is "
                                            r"unchanged"):
            hf.export_hf(tmp_path / "ckpt", tmp_path / "export", log=lambda *_: None)
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".new.tmp.{dead.pid}").mkdir()  # a killed export's
    (tmp_path / f".new.tmp.{os.getppid()}").mkdir()  # a running one's (its process lives)
    hf.export_hf(tmp_path / "ckpt", tmp_path / "new", log=lambda *_: None)
    assert not (tmp_path / f".new.tmp.{dead.pid}").exists()
    assert (tmp_path / f".new.tmp.{os.getppid()}").is_dir()
    # A name glob would read as a pattern: its own staging goes, another output's stays.
    (tmp_path / f".m[v2].tmp.{dead.pid}").mkdir()
    (tmp_path / f".mv.tmp.{dead.pid}").mkdir()
    hf.export_hf(tmp_path / "ckpt", tmp_path / "m[v2]", log=lambda *_: None)
    assert not (tmp_path / f".m[v2].tmp.{dead.pid}").exists()
    assert (tmp_path / f".mv.tmp.{dead.pid}").is_dir()
