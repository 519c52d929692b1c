"""`bloomtrain import-deepspeed` against files written by DeepSpeed's own engine
(tests/fixtures/deepspeed/, see make_fixtures.py there): the imported fp32 masters and Adam
moments equal DeepSpeed's own extraction of them bit for bit (zero_to_fp32 where DeepSpeed has it,
its universal conversion for everything), the run's weights are the checkpoint's, and bad inputs
get an error naming the file with nothing written.

The references are DeepSpeed's outputs, read here with plain torch.load; the names of
Megatron-DeepSpeed's pipeline are mapped to HF's by this file's own table, not the importer's.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.checkpoint.interop.importer import import_deepspeed
from bloomtrain.checkpoint.interop.safe_load import InteropError
from bloomtrain.model.params import base_spec

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepspeed"
HF = ["hf_zero2_fp32", "hf_zero3_fp32", "hf_bf16_zero1"]
MEGATRON = "megatron_pp2_tp2_dp2_bf16"
# 6 heads, 3 layers over pp 2, 300 tokens padded to 512, tp copies bf16 ulps apart, by iterations
AWKWARD = "megatron_awkward_pp2_tp2_bf16"
# (fixture, what is imported: its DeepSpeed checkpoint or its universal conversion)
CASES = [(f, "checkpoint") for f in HF + [MEGATRON, AWKWARD]] + \
    [("hf_bf16_zero1", "universal"), (MEGATRON, "universal")]
KINDS = {"model": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def reference(fixture: str) -> dict:
    return torch.load(FIXTURES / fixture / "reference.pt", weights_only=True)


def info(fixture: str) -> dict:
    """The fixture's reference.json: its shape, layout and the run's counters."""
    import json
    return json.loads((FIXTURES / fixture / "reference.json").read_text())


def consumed(fixture: str) -> int:
    """The samples the run consumed in its 3 steps: 3 global batches (of 8, the awkward
    fixture's of 4)."""
    return info(fixture).get("consumed_samples", 24)


def hf_name(name: str, layers: int = 2) -> str:
    """GPTModelPipe's names for a fixture's BLOOM of `layers` blocks (blocks are layers 3 to
    layers + 2, the final LayerNorm layer layers + 4), HF names unchanged."""
    final = layers + 4
    fixed = {"tied_modules.embed.word_embeddings.weight": "transformer.word_embeddings.weight",
             "tied_modules.embed.word_embeddings.norm.weight":
                 "transformer.word_embeddings_layernorm.weight",
             "tied_modules.embed.word_embeddings.norm.bias":
                 "transformer.word_embeddings_layernorm.bias",
             f"{final}.weight": "transformer.ln_f.weight", f"{final}.bias": "transformer.ln_f.bias"}
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"(\d+)\.(.+)", name)
    if m and 3 <= int(m.group(1)) < 3 + layers:
        return f"transformer.h.{int(m.group(1)) - 3}.{m.group(2)}"
    return name


def imported(tmp_path, fixture: str, what: str = "checkpoint", **kw) -> ckpt.CheckpointReader:
    out = tmp_path / f"{fixture}-{what}{'-weights' if kw.get('weights_only') else ''}"
    import_deepspeed(FIXTURES / fixture / what, out, log=lambda *a: None, **kw)
    kinds = ckpt.MODEL_KINDS + (ckpt.OPTIM_KINDS if not kw.get("weights_only") else ())
    return ckpt.CheckpointReader(out, kinds=kinds)


@pytest.mark.parametrize("fixture,what", CASES)
def test_masters_and_moments_equal_deepspeeds_extraction(tmp_path, fixture, what):
    ref, layers = reference(fixture), info(fixture).get("layers", 2)
    reader = imported(tmp_path, fixture, what)
    # DeepSpeed's universal conversion of an HF model also copies the tied lm_head.weight (the
    # embedding, no moments of its own); bloomtrain stores the tied head once.
    universal = {k: {hf_name(n, layers): t for n, t in v.items() if n != "lm_head.weight"}
                 for k, v in ref["universal"].items()}
    assert sorted(reader.names()) == sorted(universal["fp32"])
    for name in reader.names():
        for kind, uni in KINDS.items():
            got = reader.load(name, kind)
            assert got.dtype == torch.float32
            # ZeRO-3's universal files are flat; every other file has the parameter's shape.
            assert torch.equal(got.reshape(-1), universal[uni][name].reshape(-1)), (name, kind)
        if "zero_to_fp32" in ref:
            assert torch.equal(reader.load(name, "model"), ref["zero_to_fp32"][name]), name
    m = reader.manifest
    assert m["optimizer"]["step_count"] == ref["step"] == 3
    # Megatron's scheduler position, where its checkpoint records one (AnnealingLR.num_steps:
    # the samples of applied steps, all of them here).
    lr = {"lr_samples": consumed(fixture)} if fixture.startswith("megatron") else {}
    assert m["train_state"] == {"step": 3, "consumed_samples": consumed(fixture),
                                "skipped_steps": 0, **lr}
    assert reader.path.name == "step_00000003"
    reader.check_complete()


def _megatron_weights(fixture_dir: Path) -> dict[str, list[torch.Tensor]]:
    """HF name -> the bf16 pieces of each tp rank, from the layer files (layer_01: embedding,
    03/04: blocks, 06: final LayerNorm)."""
    out: dict[str, list] = {}
    step = fixture_dir / "checkpoint" / "global_step3"
    for layer in (1, 3, 4, 6):
        for tp in (0, 1):
            # The Megatron fixtures' storages are tagged cuda:N, as BLOOM's saves were.
            state = torch.load(step / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt",
                               map_location="cpu", weights_only=True)
            for key, t in state.items():
                name = hf_name(f"tied_modules.embed.{key}" if layer == 1 else f"{layer}.{key}")
                out.setdefault(name, []).append(t.detach())
    return out


def test_bf16_weights_are_the_checkpoints(tmp_path):
    # The masters rounded to bf16 are the run's bf16 weights (DeepSpeed copies them after every
    # step), and --weights-only imports those weights themselves.
    hf = imported(tmp_path, "hf_bf16_zero1")
    module = torch.load(FIXTURES / "hf_bf16_zero1/checkpoint/global_step3/"
                                   "mp_rank_00_model_states.pt", weights_only=True)["module"]
    only = imported(tmp_path, "hf_bf16_zero1", weights_only=True)
    for name in hf.names():
        assert torch.equal(hf.load(name).to(torch.bfloat16), module[name]), name
        assert only.load(name).dtype == torch.bfloat16
        assert torch.equal(only.load(name), module[name]), name
    assert not only.has("exp_avg") and "train_state" not in only.manifest

    meg = imported(tmp_path, MEGATRON)
    meg_only = imported(tmp_path, MEGATRON, weights_only=True)
    for name, pieces in _megatron_weights(FIXTURES / MEGATRON).items():
        dim = base_spec(name).tp_dim
        if dim is None:
            # Replicated over tp: the copies drift apart (make_fixtures.py starts tp rank 1's
            # 1e-3 off) and are averaged, as DeepSpeed's universal conversion does.
            want = (pieces[0].float() + pieces[1].float()) / 2
            assert (meg.load(name).float() - want).abs().max() <= 2 ** -8 * want.abs().max() + 1e-6
        else:
            want = torch.cat(pieces, dim=dim)
            assert torch.equal(meg.load(name).to(torch.bfloat16), want), name
            assert torch.equal(meg_only.load(name), want), name
    # Megatron pads the vocabulary to 128 rows (100 tokens, multiple of 64 x tp 2): the padding
    # rows of both tp ranks end the full embedding, 64 rows from each rank.
    emb = meg.load("transformer.word_embeddings.weight")
    assert emb.shape == (128, 32)


def test_vocab_padding_cut_by_the_converter_comes_back_as_zeros(tmp_path):
    # A universal conversion with a vocabulary pattern keeps only the tokenizer's rows (DeepSpeed's
    # loader pads them again with zeros); the importer restores the padded shape the same way.
    src = FIXTURES / MEGATRON / "universal"
    copy = tmp_path / "uni"
    shutil.copytree(src, copy)
    emb_dir = copy / "global_step3_universal/zero/tied_modules.embed.word_embeddings.weight"
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        d = torch.load(emb_dir / f"{kind}.pt", weights_only=True)
        torch.save({"param": d["param"][:100].clone(), "vocab_tensor": True}, emb_dir / f"{kind}.pt")
    reader = imported(tmp_path, MEGATRON, "universal")  # the untouched one
    out = tmp_path / "cut"
    lines = []
    import_deepspeed(copy, out, log=lines.append)
    assert any("vocabulary padding was cut" in line for line in lines), lines
    cut = ckpt.CheckpointReader(out, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    for kind in KINDS:
        full, got = reader.load("transformer.word_embeddings.weight", kind), \
            cut.load("transformer.word_embeddings.weight", kind)
        assert got.shape == (128, 32)
        assert torch.equal(got[:100], full[:100]) and not got[100:].any()


# ---- bad input -----------------------------------------------------------------------------------

def _copy(tmp_path, fixture: str) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture / "checkpoint", dst)
    return dst


@pytest.mark.parametrize("how", ["tp pieces joined on the wrong dimension", "transposed"])
def test_a_universal_file_of_the_right_size_in_another_shape_is_refused(tmp_path, how):
    """A converter that joins a row-parallel matrix's tp pieces on dim 0 (no row-parallel
    pattern) or stores a matrix transposed writes the parameter's elements in another shape;
    the importer compared counts only and reshaped them: the import succeeded, the weights
    (and moments) scrambled. Now the file's shape must be the parameter's (or flat)."""
    copy = tmp_path / "uni"
    shutil.copytree(FIXTURES / MEGATRON / "universal", copy)
    tp = how.startswith("tp")
    layer = copy / "global_step3_universal/zero" / (
        "3.self_attention.dense.weight" if tp else "3.mlp.dense_h_to_4h.weight")
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        d = torch.load(layer / f"{kind}.pt", weights_only=False)
        full = d["param"]
        d["param"] = torch.cat(full.chunk(2, dim=1), dim=0) if tp else full.t().contiguous()
        torch.save(d, layer / f"{kind}.pt")
    got = list(d["param"].shape)
    assert got != list(full.shape) and d["param"].numel() == full.numel()
    _refused(copy, tmp_path / "out", re.escape(f"holds a {got} tensor, a 2-layer BLOOM's "),
             "is \\[", "another merge of its tensor-parallel pieces")


def _refused(src: Path, out: Path, *patterns: str) -> str:
    with pytest.raises(InteropError) as e:
        import_deepspeed(src, out, log=lambda *a: None)
    text = str(e.value)
    for p in patterns:
        assert re.search(p, text), (p, text)
    # Nothing written: no checkpoint, no temporary directory, no config.
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    return text


def test_truncated_shard_is_named(tmp_path):
    src = _copy(tmp_path, "hf_zero2_fp32")
    shard = src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:50_000])
    _refused(src, tmp_path / "out", re.escape(str(shard)), "truncated or damaged")


def test_missing_rank_file_is_named(tmp_path):
    src = _copy(tmp_path, MEGATRON)
    (src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt").unlink()
    _refused(src, tmp_path / "out", r"bf16_zero_pp_rank_1_mp_rank_02_optim_states\.pt is missing",
             "2 data-parallel ranks")
    src2 = _copy(tmp_path / "b", MEGATRON)
    (src2 / "global_step3" / "layer_04-model_01-model_states.pt").unlink()
    _refused(src2, tmp_path / "out2", r"layer_04-model_01-model_states\.pt is missing")


class Intruder:
    """A class no DeepSpeed file names: the importer must refuse to build it."""


def test_class_outside_the_allow_list_is_refused(tmp_path):
    src = _copy(tmp_path, "hf_zero2_fp32")
    f = src / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=True)
    state["extra"] = Intruder()
    torch.save(state, f)
    _refused(src, tmp_path / "out", re.escape(str(f)), r"names the class .*Intruder",
             "refusing to load it")


def test_mismatched_tp_files_are_named(tmp_path):
    # tp rank 1's layer 3 replaced by its layer 4 (same shapes, another layer's values).
    src = _copy(tmp_path, MEGATRON)
    step = src / "global_step3"
    shutil.copyfile(step / "layer_04-model_01-model_states.pt",
                    step / "layer_03-model_01-model_states.pt")
    _refused(src, tmp_path / "out", r"layer_03-model_01-model_states\.pt",
             "different checkpoints")
    # A tp rank's file of another shape (tp rank 0's final LayerNorm in place of a block's).
    src2 = _copy(tmp_path / "b", MEGATRON)
    shutil.copyfile(src2 / "global_step3" / "layer_06-model_00-model_states.pt",
                    src2 / "global_step3" / "layer_03-model_00-model_states.pt")
    _refused(src2, tmp_path / "out2", r"layer_03-model_00-model_states\.pt")


def test_another_architecture_is_refused(tmp_path):
    import json
    src = _copy(tmp_path, "hf_zero2_fp32")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    _refused(src, tmp_path / "out", re.escape(str(src / "config.json")), "model_type 'gpt2'")

    src2 = _copy(tmp_path / "b", MEGATRON)
    for f in sorted((src2 / "global_step3").glob("mp_rank_*_model_states.pt")):
        from bloomtrain.checkpoint.interop.safe_load import load
        state = load(f)
        state["args"].position_embedding_type = "absolute"
        torch.save(state, f)
    _refused(src2, tmp_path / "out2", r"mp_rank_00_model_states\.pt", "absolute",
             "not BLOOM's ALiBi")


def test_an_existing_checkpoint_root_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    import_deepspeed(FIXTURES / "hf_zero2_fp32" / "checkpoint", out, log=lambda *a: None)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(InteropError, match="already holds checkpoints"):
        import_deepspeed(FIXTURES / "hf_zero3_fp32" / "checkpoint", out, log=lambda *a: None)
    assert sorted(p.name for p in out.iterdir()) == before


def test_the_deepspeed_checkpoints_own_directory_is_refused_as_output(tmp_path):
    """Its `latest` (global_step3) was replaced by the import's (step_00000003): DeepSpeed could
    no longer resume there, nor the import run again."""
    src = _copy(tmp_path, "hf_zero2_fp32")
    latest = (src / "latest").read_text()
    for given, out in ((src / "global_step3", src), (src, src), (src / "global_step3", src)):
        with pytest.raises(InteropError, match="own directory"):
            import_deepspeed(given, out, log=lambda *a: None)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "latest").write_text("global_step9")
    with pytest.raises(InteropError, match="holds its `latest`"):
        import_deepspeed(src, other, log=lambda *a: None)
    assert (src / "latest").read_text() == latest and not list(src.glob("step_*"))


# ---- continuation ----------------------------------------------------------------------------------

# (fixture, what, layout overrides): one process, and another layout than the run's.
ONE, TP2 = {"parallel.tp": 1, "parallel.pp": 1}, {"parallel.tp": 2, "parallel.pp": 1}
PP2 = {"parallel.tp": 1, "parallel.pp": 2, "parallel.pp_partition": "uniform"}
CONTINUE = [(f, "checkpoint", layout) for f in HF + [MEGATRON, AWKWARD] for layout in (ONE, TP2)] \
    + [(MEGATRON, "checkpoint", PP2), (MEGATRON, "universal", ONE),
       ("hf_bf16_zero1", "universal", ONE)]


def _continue(rank, world, yaml_path, overrides, batch, out_dir):
    """Resume the imported run as `bloomtrain train` does (its YAML, checkpoint.resume) and take
    one step on the fixture's batch; the loss, the lr and the checkpoint saved after it."""
    from bloomtrain.config import Config
    from bloomtrain.data.loader import get_micro_batches
    from bloomtrain.train import Trainer

    cfg = Config.load(yaml_path, overrides)
    trainer = Trainer(cfg, log=lambda *a: None)
    state = trainer.state
    start = (state.step, state.consumed_samples)
    t = cfg.train
    micro = get_micro_batches([row.numpy() for row in batch], 0, t.global_batch_size,
                              t.micro_batch_size, trainer.topo.dp_rank, trainer.topo.dp_size)
    loss, result, lr = trainer.train_step(micro)
    state.step += 1
    state.consumed_samples += t.global_batch_size
    path = trainer.checkpoints.save_final(state)
    trainer.checkpoints.wait()
    trainer.data.stream.close()
    trainer.metrics.close()
    trainer.watchdog.stop()
    return {"loss": loss, "lr": lr, "start": start, "skipped": result.skipped, "path": str(path)}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Documents of the fixtures' first 100 token ids (the Megatron fixture's vocabulary); the
    continuation steps take the fixture's batch instead, `bloomtrain train` reads these."""
    import numpy as np

    from bloomtrain.data.indexed import write_dataset
    rng = np.random.RandomState(0)
    docs = [[rng.randint(0, 100, size=rng.randint(20, 60)).tolist()] for _ in range(200)]
    prefix = tmp_path_factory.mktemp("data") / "tiny_text_document"
    write_dataset(prefix, docs, dtype=np.uint16)
    return str(prefix)


def _overrides(layout: dict, dataset: str, tmp_path: Path, imported_step: Path) -> list[str]:
    return [f"data.paths=[{dataset}]", "data.tokenizer=null", "data.seq_length=16",
            "data.split=90,10,0", f"run_dir={tmp_path / 'run'}", "train.train_iters=4",
            "train.train_samples=null", "train.eval_interval=null", "train.log_interval=1",
            "train.device=cpu", "train.grad_stats_interval=0", "run.tensorboard=false",
            f"checkpoint.resume={imported_step}", f"checkpoint.dir={tmp_path / 'after'}",
            "checkpoint.async_save=false"] + [f"{k}={v}" for k, v in layout.items()]


# Why these tolerances. fp32: both sides compute the same fp32 math in other orders (HF's eager
# attention and DeepSpeed's reductions against bloomtrain's): measured, the loss agrees to 2.4e-7
# (5e-8 relative) and the masters after the step to 1.4e-8, well inside the 1e-6. bf16:
# each side rounds its activations to bf16 (unit roundoff 2^-8 = 3.9e-3) in other places; the
# loss, an fp32 mean over 128 tokens, agrees to 2.4e-6 relative (bound 1e-4), and the masters
# after one AdamW step differ where bf16 gradients differ (Adam's update is lr x m / sqrt(v), so
# a gradient element that differs in sign or size moves by up to about lr): bound half the
# step's lr (measured up to 9.6e-5 at BLOOM's layout's lr of 9.4e-4, 7.0e-4 at the awkward
# fixture's 2.0e-3, where the padding rows' tiny gradients differ most after bf16 rounding). A
# step from wrong moments or with a wrong Adam step count moves masters by about a whole lr.
LOSS_TOL = {"fp32": 1e-6, "bf16": 1e-4}
MASTER_TOL = {"fp32": 1e-6, "bf16": 0.5}  # bf16: a fraction of the step's lr


def _case_id(case) -> str:
    fixture, what, layout = case
    where = {id(ONE): "one", id(TP2): "tp2", id(PP2): "pp2"}[id(layout)]
    return f"{fixture}-{what}-{where}"


@pytest.mark.parametrize("fixture,what,layout", CONTINUE, ids=[_case_id(c) for c in CONTINUE])
def test_resumed_run_continues_as_deepspeed(tmp_path, dataset, fixture, what, layout):
    from tests.dist import run_ranks

    ref = reference(fixture)
    out = tmp_path / "imported"
    import_deepspeed(FIXTURES / fixture / what, out, log=lambda *a: None)
    world = layout.get("parallel.tp", 1) * layout.get("parallel.pp", 1)
    over = _overrides(layout, dataset, tmp_path, ckpt.resolve(out))
    res = run_ranks(world, _continue, str(out / "bloomtrain.yaml"), over, ref["batch"],
                    str(tmp_path))[0]
    precision = "bf16" if "bf16" in fixture else "fp32"
    # The run's position: iteration 3, its samples (24; 12 for the awkward one's batch of 4);
    # the LR of the next step is the source's (Megatron's AnnealingLR at those samples for the
    # Megatron fixtures, the constant 1e-3 else).
    assert res["start"] == (3, consumed(fixture)) and not res["skipped"]
    assert res["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    assert abs(res["loss"] - ref["loss"]) <= LOSS_TOL[precision] * \
        (ref["loss"] if precision == "bf16" else 1.0), (res["loss"], ref["loss"])
    after = ckpt.CheckpointReader(res["path"])
    worst = 0.0
    for name, want in ref["next_fp32"].items():
        name = hf_name(name, info(fixture).get("layers", 2))
        if name == "lm_head.weight":
            continue
        got = after.load(name)
        worst = max(worst, float((got.reshape(-1) - want.reshape(-1).detach()).abs().max()))
    bound = MASTER_TOL[precision] * (ref["lr"] if precision == "bf16" else 1.0)
    assert worst <= bound, (worst, bound)


def test_cli_import_and_train_continue_megatrons_schedule(tmp_path, dataset, capsys):
    # The three commands as a user runs them: import, then `bloomtrain train --config` on the
    # YAML the import wrote. The run starts at iteration 4 with 24 + 8 samples consumed after it,
    # and its first LR is Megatron's AnnealingLR at 24 samples (what DeepSpeed's optimizer held).
    import json

    from bloomtrain.cli import main

    out = tmp_path / "imported"
    assert main(["import-deepspeed", "--input", str(FIXTURES / MEGATRON / "checkpoint"),
                 "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "largest difference" in text and "iteration 3, 24 consumed samples" in text
    assert f"bloomtrain train --config {out / 'bloomtrain.yaml'}" in text
    run = tmp_path / "run"
    assert main(["train", "--config", str(out / "bloomtrain.yaml"), f"data.paths=[{dataset}]",
                 "data.tokenizer=null", "parallel.tp=1", "parallel.pp=1", "train.train_iters=5",
                 "train.train_samples=null", "train.eval_interval=null", f"run_dir={run}",
                 "train.device=cpu", "run.tensorboard=false"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [4, 5]
    assert [r["consumed_samples"] for r in steps] == [32, 40]
    assert steps[0]["lr"] == pytest.approx(reference(MEGATRON)["lr"], rel=1e-12)
    assert ckpt.resolve(out).name == "step_00000005"  # the run saved into the imported root


def _word_tokenizer(directory: Path, size: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(size - 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_tokenizer_is_kept_and_checked_against_the_vocabulary(tmp_path):
    out = tmp_path / "out"
    tok = _word_tokenizer(tmp_path / "tok", 100)
    path = import_deepspeed(FIXTURES / MEGATRON / "checkpoint", out, tokenizer=str(tok),
                            log=lambda *a: None)
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    import yaml
    cfg = yaml.safe_load((out / "bloomtrain.yaml").read_text())
    assert cfg["data"]["tokenizer"] == str(path / "tokenizer")
    # A tokenizer with more tokens than the embedding has rows is not this model's.
    big = _word_tokenizer(tmp_path / "big", 300)
    _refused_with(FIXTURES / MEGATRON / "checkpoint", tmp_path / "out2", str(big),
                  "300 tokens, more than the model's 128 embedding rows")


def _refused_with(src: Path, out: Path, tokenizer: str, pattern: str) -> None:
    with pytest.raises(InteropError, match=pattern):
        import_deepspeed(src, out, tokenizer=tokenizer, log=lambda *a: None)
    assert not out.exists() or not any(out.iterdir())


def test_fp16_loss_scaler_state_continues_deepspeeds():
    # No fp16 fixture (the fixtures predate DeepSpeed's fp16 on this CPU): DeepSpeed's
    # DynamicLossScaler rule written out here. It doubles the scale when (cur_iter - last_overflow_iter) % window == 0
    # after a clean step, from last_overflow_iter -1; bloomtrain's scaler doubles on the window-th
    # clean step since the last overflow or growth. Both must next double at the same step.
    from bloomtrain.checkpoint.interop.importer import loss_scaler_state
    from bloomtrain.optim import DynamicLossScaler

    for cur_iter, last_overflow in ((0, None), (7, None), (10, 3), (2004, 3), (1503, 1500)):
        window = 500
        state = loss_scaler_state({"dynamic": True, "scale": 4096.0, "iter": cur_iter,
                                   "last_overflow": last_overflow, "window": window,
                                   "hysteresis": 2})
        ours = DynamicLossScaler(initial_scale=1.0, window=window, hysteresis=2)
        ours.load_state_dict(state)
        it, last = cur_iter, -1 if last_overflow is None else last_overflow
        for step in range(2 * window):
            theirs_grows = (it - last) % window == 0
            before = ours.scale
            ours.update(found_inf=False)
            assert (ours.scale > before) == theirs_grows, (cur_iter, last_overflow, step)
            it += 1
    assert loss_scaler_state({"dynamic": False, "scale": 1.0}) is None


def _fake_deepspeed_scaler(monkeypatch, **fields):
    """An object that pickles as DeepSpeed's DynamicLossScaler does (its module path and its
    attributes), without DeepSpeed installed: the import must read it through its allow-list."""
    import sys
    import types

    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
             "deepspeed.runtime.fp16.loss_scaler"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cls = type("DynamicLossScaler", (), {"__module__": names[-1]})
    sys.modules[names[-1]].DynamicLossScaler = cls
    obj = cls()
    obj.__dict__.update(fields)
    return obj


def test_a_universal_checkpoint_of_an_fp16_run_keeps_its_loss_scaler(tmp_path, monkeypatch):
    """DeepSpeed's universal conversion keeps an fp16 run's loss scaler in zero/
    optimizer_state.pt; the import dropped it, so the resumed run started from the initial scale
    (2^16 here for 2^11, overflowing for many steps). The bf16 fixture turned fp16 in its
    ds_config, with a scaler as DeepSpeed pickles it, now continues DeepSpeed's scale and growth
    count."""
    from bloomtrain.checkpoint.interop.importer import loss_scaler_state

    src = tmp_path / "universal"
    shutil.copytree(FIXTURES / "hf_bf16_zero1" / "universal", src)
    step = src / "global_step3_universal"
    models = step / "mp_rank_00_model_states.pt"
    meta = torch.load(models, weights_only=False)
    meta["ds_config"]["fp16"] = {"enabled": True, "loss_scale": 0}
    del meta["ds_config"]["bf16"]
    torch.save(meta, models)
    fields = dict(cur_scale=2048.0, cur_iter=1203, last_overflow_iter=1100, scale_factor=2.0,
                  scale_window=500, min_scale=1.0, delayed_shift=2, cur_hysteresis=1,
                  consecutive_hysteresis=False, raise_error_at_min_scale=True, dynamic=True)
    opt = step / "zero" / "optimizer_state.pt"
    state = torch.load(opt, weights_only=False)
    state["loss_scaler"] = _fake_deepspeed_scaler(monkeypatch, **fields)
    torch.save(state, opt)
    # The converter's copy of the tied head is the module's weight: the embedding in fp16 now.
    emb = torch.load(step / "zero" / "transformer.word_embeddings.weight" / "fp32.pt")["param"]
    torch.save({"param": emb.half().float()}, step / "zero" / "lm_head.weight" / "fp32.pt")
    out = tmp_path / "out"
    import_deepspeed(src, out, log=lambda *a: None)
    manifest = ckpt.CheckpointReader(out, kinds=ckpt.MODEL_KINDS).manifest
    want = loss_scaler_state({"scale": 2048.0, "dynamic": True, "hysteresis": 1, "window": 500,
                              "iter": 1203, "last_overflow": 1100})
    assert want == {"scale": 2048.0, "growth_tracker": 102, "hysteresis_tracker": 1}
    assert manifest["optimizer"]["scaler"] == want
    assert manifest["source"]["layout"]["precision"] == "fp16"


def test_zero3_weights_only_come_from_the_shards(tmp_path):
    # ZeRO-3's model-states files hold empty placeholders: the weights are the fp32 masters in
    # the optimizer shards, as DeepSpeed's zero_to_fp32 consolidates them.
    ref = reference("hf_zero3_fp32")
    reader = imported(tmp_path, "hf_zero3_fp32", weights_only=True)
    assert not reader.has("exp_avg")
    for name in reader.names():
        assert torch.equal(reader.load(name), ref["zero_to_fp32"][name]), name


# ---- Megatron-DeepSpeed saves as Megatron wrote them ---------------------------------------------
# The Megatron fixtures' `args` come from Megatron-DeepSpeed's own parse_args (bigscience's
# 8387ae17) plus the fields it sets while training; their optimizers have Megatron's three
# parameter groups; their storages are tagged cuda:N and their numpy RNG state names numpy.core,
# as BLOOM's 2022 saves (make_fixtures.py, megatron_pipe.py).
MEGATRONS = [MEGATRON, AWKWARD]

# transformers' convert_bloom_original_checkpoint_to_pytorch.py (in releases up to 4.4x; removed
# since), its rules written out: the names ending so are averaged over the tp ranks (summed in
# the file's dtype, then divided); the row-parallel weights are concatenated on dim 1, every
# other tensor on dim 0; layer file layer_XX holds block h.(XX - 3) but for the embedding's and
# the final LayerNorm's keys, which it renames.
HF_AVERAGED = ("word_embeddings_layernorm.weight", "word_embeddings_layernorm.bias",
               "input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
               "post_attention_layernorm.bias", "self_attention.dense.bias",
               "mlp.dense_4h_to_h.bias", "ln_f.weight", "ln_f.bias")
HF_ROW_PARALLEL = ("mlp.dense_4h_to_h.weight", "self_attention.dense.weight")
HF_RENAMED = {"word_embeddings.weight": "word_embeddings.weight",
              "word_embeddings.norm.weight": "word_embeddings_layernorm.weight",
              "word_embeddings.norm.bias": "word_embeddings_layernorm.bias",
              "weight": "ln_f.weight", "bias": "ln_f.bias"}


def hf_converter_state(step: Path, tp: int) -> dict[str, torch.Tensor]:
    """BloomModel's state dict (no `transformer.` prefix) from a step's layer files, by HF's
    converter's rules."""
    out = {}
    for first in sorted(step.glob("layer_*-model_00-model_states.pt")):
        layer = int(re.match(r"layer_(\d+)", first.name)[1])
        states = [torch.load(str(first).replace("model_00", f"model_{t:02d}"), map_location="cpu",
                             weights_only=True) for t in range(tp)]
        for key in states[0]:
            name = HF_RENAMED.get(key, f"h.{layer - 3}.{key}")
            tensors = [s[key] for s in states]
            if name.endswith(HF_AVERAGED):
                total = tensors[0].clone()
                for t in tensors[1:]:
                    total += t
                out[name] = total / tp
            else:
                dim = 1 if any(r in name for r in HF_ROW_PARALLEL) else 0
                out[name] = torch.cat(tensors, dim=dim)
    return out


def hf_bloom(fixture: str, state: dict[str, torch.Tensor]):
    """transformers' BloomForCausalLM of the fixture's shape in fp32 holding `state` (BloomModel
    names), every weight given (the converter's own check)."""
    from transformers import BloomConfig, BloomForCausalLM

    i = info(fixture)
    cfg = BloomConfig(vocab_size=i["padded_vocab_size"], hidden_size=i["hidden"],
                      n_layer=i["layers"], n_head=i["heads"], hidden_dropout=0.0,
                      attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = BloomForCausalLM(cfg).eval()
    missing, unexpected = model.transformer.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.mark.parametrize("fixture", MEGATRONS)
def test_hf_converter_rules_give_the_same_state_dict(tmp_path, fixture):
    # HF's own mapping (averaged, dim-1 and dim-0 concatenations, the layer-number offset) run on
    # the layer files, against bloomtrain's import of the run's weights: bit for bit.
    step = FIXTURES / fixture / "checkpoint" / "global_step3"
    theirs = hf_converter_state(step, info(fixture)["tp"])
    ours = imported(tmp_path, fixture, weights_only=True)
    assert sorted(ours.names()) == sorted(f"transformer.{n}" for n in theirs)
    for name, want in theirs.items():
        got = ours.load(f"transformer.{name}")
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.equal(got, want), name
    i = info(fixture)
    assert theirs["word_embeddings.weight"].shape == (i["padded_vocab_size"], i["hidden"])


@pytest.mark.parametrize("fixture", MEGATRONS)
@pytest.mark.parametrize("weights_only", [False, True], ids=["optimizer", "weights-only"])
def test_cli_import_gives_the_runs_model(tmp_path, capsys, fixture, weights_only):
    # `bloomtrain import-deepspeed` as a user runs it. The model it writes gives the logits of
    # transformers' BloomForCausalLM holding the run's weights: the layer files by HF's converter
    # rules (--weights-only), or DeepSpeed's own universal extraction of the fp32 masters.
    import bloomtrain
    from bloomtrain.cli import main

    out = tmp_path / "imported"
    argv = ["import-deepspeed", "--input", str(FIXTURES / fixture / "checkpoint"),
            "--output", str(out)] + (["--weights-only"] if weights_only else [])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "UNSUPPORTED" not in text and "WARNING" not in text, text
    i = info(fixture)
    if weights_only:
        state = hf_converter_state(FIXTURES / fixture / "checkpoint" / "global_step3", i["tp"])
        assert "OPTIMIZER STATE NOT IMPORTED (--weights-only)" in text
    else:
        universal = reference(fixture)["universal"]["fp32"]
        state = {hf_name(n, i["layers"]).removeprefix("transformer."): t
                 for n, t in universal.items()}
        assert f"iteration 3, {i['consumed_samples']} consumed samples" in text
    theirs = hf_bloom(fixture, state)
    ours = bloomtrain.load_model(out, dtype=torch.float32)
    ids = torch.randint(0, i["original_vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)
    # fp32 rounding: the same weights through two implementations of the same math (HF's eager
    # attention against bloomtrain's kernel); logits of size ~1, agreeing to ~1e-6.
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    # The run's length and schedule as Megatron's args have them: a sample-based run keeps
    # train_samples (train_iters is Megatron's derivation of it), an iteration-based one
    # train_iters.
    import yaml
    cfg = yaml.safe_load((out / "bloomtrain.yaml").read_text())
    kind, length = i["length"]
    assert cfg["train"].get(kind) == length
    assert set(cfg["train"]) & {"train_iters", "train_samples"} == {kind}
    assert (cfg["optim"]["warmup_samples"], cfg["optim"]["decay_samples"]) == \
        (i["schedule"]["warmup_samples"], i["schedule"]["decay_samples"])


def _saved_args(fixture: str) -> dict:
    from bloomtrain.checkpoint.interop.megatron import args_dict
    from bloomtrain.checkpoint.interop.safe_load import load

    f = FIXTURES / fixture / "checkpoint" / "global_step3" / "mp_rank_00_model_states.pt"
    return args_dict(load(f)["args"], f)


# Fields that Megatron-DeepSpeed sets while it trains (no option gives them), as the issue that
# found them named them, and as the fixtures' saved args hold them.
SET_WHILE_TRAINING = ("do_train", "do_valid", "do_test", "pretrain_causal_attention",
                      "parameters_in_billions_no_embedding", "iteration",
                      "consumed_train_samples", "consumed_train_tokens", "gigaflos_no_embeds",
                      "padded_vocab_size", "deepspeed_configuration", "data_parallel_size",
                      "world_size", "rank", "params_dtype", "curriculum_learning",
                      "virtual_pipeline_model_parallel_size", "consumed_valid_samples")


@pytest.mark.parametrize("fixture", MEGATRONS)
def test_fields_megatron_sets_are_not_unsupported(fixture):
    from bloomtrain.import_config import megatron_to_config
    from bloomtrain.import_config.megatron_args import BY_DEST, SET_BY_MEGATRON

    args = _saved_args(fixture)
    # Megatron's full Namespace: every parse_args field (195 with DeepSpeed's) and the training's.
    assert len(args) >= 200
    assert set(SET_WHILE_TRAINING) <= set(args)
    assert set(SET_WHILE_TRAINING) <= set(SET_BY_MEGATRON)
    unknown = [k for k in args if k not in BY_DEST and k not in SET_BY_MEGATRON]
    assert not unknown, unknown
    config, report = megatron_to_config(args, args["deepspeed_configuration"], saved=True)
    assert report.unsupported == [] and report.warnings == []
    if fixture == MEGATRON:  # sample-based: Megatron derived train_iters = 800 // 8 before saving
        assert (args["train_samples"], args["train_iters"]) == (800, 100)
        assert config["train"]["train_samples"] == 800 and "train_iters" not in config["train"]
        assert any("update_train_iters" in s.reason for s in report.ignored)
    # A field neither an option nor set by Megatron is still reported.
    _, report = megatron_to_config({**args, "no_such_field": 3}, args["deepspeed_configuration"],
                                   saved=True)
    assert [s.source for s in report.unsupported] == ["--no-such-field 3"]


def test_train_iters_that_megatron_would_not_derive_is_a_warning(tmp_path):
    from bloomtrain.import_config import megatron_to_config

    args = _saved_args(MEGATRON)
    config, report = megatron_to_config({**args, "train_iters": 90},
                                        args["deepspeed_configuration"], saved=True)
    assert config["train"]["train_samples"] == 800 and "train_iters" not in config["train"]
    assert len(report.warnings) == 1
    assert "args.train_iters is 90" in report.warnings[0]
    assert "derives 100 from args.train_samples (train_samples 800 // global_batch_size 8)" in \
        report.warnings[0]


def test_awkward_fixture_reports_the_tp_drift(tmp_path):
    # tp rank 1's copies of the LayerNorms and row-parallel biases are a few bf16 ulps off rank
    # 0's: imported as their average, with the largest difference reported (computed here from
    # the layer files).
    step = FIXTURES / AWKWARD / "checkpoint" / "global_step3"
    worst = 0.0
    for first in step.glob("layer_*-model_00-model_states.pt"):
        a = torch.load(first, map_location="cpu", weights_only=True)
        b = torch.load(str(first).replace("model_00", "model_01"), map_location="cpu",
                       weights_only=True)
        for key in a:
            if a[key].shape == b[key].shape and HF_RENAMED.get(key, key).endswith(HF_AVERAGED):
                worst = max(worst, float((a[key].float() - b[key].float()).abs().max()))
    assert worst > 0
    lines = []
    import_deepspeed(step.parent, tmp_path / "out", weights_only=True, log=lines.append)
    report = next(line for line in lines if "largest difference" in line)
    assert f"largest difference {worst:.3g} " in report, report
    # Up to 3 bf16 ulps of values near 1 (make_fixtures.py): 2-3% of the LayerNorm's scale.
    share = float(re.search(r"([\d.]+)% of its largest magnitude", report).group(1))
    assert 0.5 <= share <= 5, report


# ---- the config an import writes: what it knows, where from, and what the user must choose -----

def _with_ds_config(tmp_path, fixture: str, **changes) -> Path:
    """A copy of an HF fixture's checkpoint whose saved ds_config has `changes`."""
    src = _copy(tmp_path, fixture)
    f = src / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=True)
    state["ds_config"] = {**state["ds_config"], **changes}
    torch.save(state, f)
    return src


def test_hf_import_yaml_names_its_sources_and_what_to_choose(tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    import_deepspeed(FIXTURES / "hf_zero2_fp32" / "checkpoint", "ckpt", log=lambda *a: None)
    text = (tmp_path / "ckpt" / "bloomtrain.yaml").read_text()
    body = [line for line in text.splitlines() if not line.startswith("#")]
    comment = {line.split(":")[0].strip(): line.split("#", 1)[1].strip()
               for line in body if "#" in line}
    # HF's config.json fields, the optimizer's groups and the ds_config, not Megatron's flags.
    assert comment["num_layers"] == "config.json n_layer"
    assert comment["num_heads"] == "config.json n_head"
    assert comment["vocab_size"] == "config.json vocab_size"
    assert comment["lr"] == "the optimizer's param_groups lr"
    assert comment["micro_batch_size"] == "ds_config train_micro_batch_size_per_gpu"
    assert not any(c.startswith("--") for c in comment.values()), comment
    # What the checkpoint does not record is said plainly at the top: the length (no key is
    # written for it), the sequence length and the LR schedule.
    header = text.split("\nmodel:")[0]
    assert "TO CHOOSE before training" in header
    for what in ("train.train_iters or train.train_samples", "data.seq_length",
                 "the LR schedule", "data.tokenizer"):
        assert f"#   - {what}" in header, (what, header)
    cfg = yaml.safe_load(text)
    assert not {"train_iters", "train_samples"} & set(cfg["train"])
    # The import's directory as it was given, relative to where import-deepspeed ran.
    assert cfg["checkpoint"]["dir"] == "ckpt"


def test_ds_scheduler_becomes_the_schedule_and_length(tmp_path):
    # DeepSpeed's WarmupDecayLR (linear warm-up) is Megatron's linear schedule in steps: the
    # imported config's LR at step i equals DeepSpeed's formula at its scheduler's iteration i
    # (lr_schedules.py, written out here), and total_num_steps is the run's length. DeepSpeed
    # runs its optimizer step i at iteration i - 1 (it steps the scheduler after the
    # optimizer): one step behind, which no key of ours shifts, and the import says so.
    import yaml

    from bloomtrain.config import Config
    from bloomtrain.optim.schedule import LRSchedule

    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 10,
              "total_num_steps": 100, "warmup_type": "linear"}
    src = _with_ds_config(tmp_path, "hf_zero2_fp32",
                          scheduler={"type": "WarmupDecayLR", "params": params})
    lines = []
    import_deepspeed(src, tmp_path / "out", log=lines.append)
    cfg = Config.from_dict(yaml.safe_load((tmp_path / "out" / "bloomtrain.yaml").read_text()))
    gbs = cfg.train.global_batch_size
    assert cfg.train.train_iters == 100 and cfg.train.train_samples is None
    o = cfg.optim
    schedule = LRSchedule(o.lr, o.min_lr, o.warmup_samples, o.decay_samples, o.decay_style)

    def deepspeed_lr(step):  # WarmupDecayLR._get_gamma with warmup_type linear
        w, t = params["warmup_num_steps"], params["total_num_steps"]
        gamma = step / w if step < w else max(0.0, (t - step) / max(1.0, t - w))
        return params["warmup_min_lr"] + (params["warmup_max_lr"] - params["warmup_min_lr"]) * gamma

    for step in range(0, 130):
        assert schedule(step * gbs) == pytest.approx(deepspeed_lr(step), rel=1e-12, abs=1e-15), step
    assert not any("to choose: the LR schedule" in line or "train.train_iters or" in line
                   for line in lines), lines
    assert any("bloomtrain's schedule is one step ahead of it" in line for line in lines), lines
    # Its log warm-up (DeepSpeed's default) has no counterpart: imported as linear, and said.
    src2 = _with_ds_config(tmp_path / "b", "hf_zero2_fp32",
                           scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    lines = []
    import_deepspeed(src2, tmp_path / "out2", log=lines.append)
    cfg = yaml.safe_load((tmp_path / "out2" / "bloomtrain.yaml").read_text())
    assert cfg["optim"]["decay_style"] == "constant" and cfg["optim"]["lr"] == 1e-3
    assert cfg["optim"]["warmup_samples"] == 5 * gbs
    assert any("its warm-up is log" in line for line in lines), lines


def test_model_config_stands_in_for_a_missing_config_json(tmp_path):
    # A plain DeepSpeed script saves no config.json: --model-config gives the shape, as the
    # model's HF config or a bloomtrain model section, instead of copying files into the
    # checkpoint.
    import yaml

    from bloomtrain.cli import main

    src = _copy(tmp_path, "hf_zero2_fp32")
    hf_config = tmp_path / "bloom-config.json"
    shutil.move(src / "config.json", hf_config)
    _refused(src, tmp_path / "none", "no config.json beside the checkpoint",
             "--model-config FILE")
    reader = imported(tmp_path, "hf_zero2_fp32")  # with its config.json
    section = tmp_path / "model.yaml"
    section.write_text("model: {num_layers: 2, hidden_size: 32, num_heads: 4}\n")
    for i, given in enumerate((hf_config, section)):
        out = tmp_path / f"out{i}"
        assert main(["import-deepspeed", "--input", str(src), "--output", str(out),
                     "--model-config", str(given)]) == 0
        got = ckpt.CheckpointReader(out, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
        for name in reader.names():
            for kind in KINDS:
                assert torch.equal(got.load(name, kind), reader.load(name, kind)), (name, kind)
        cfg = yaml.safe_load((out / "bloomtrain.yaml").read_text())
        assert cfg["model"]["vocab_size"] == 120 and cfg["model"]["num_heads"] == 4
    text = (tmp_path / "out1" / "bloomtrain.yaml").read_text()
    assert "# model.yaml model.num_layers" in text
    # A shape the checkpoint does not have, or a Megatron checkpoint (its args give the shape).
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: {num_layers: 3, hidden_size: 32, num_heads: 4}\n")
    from bloomtrain.errors import UserError
    with pytest.raises(UserError, match="missing for a 3-layer BLOOM"):
        import_deepspeed(src, tmp_path / "wrong", model_config=wrong, log=lambda *a: None)
    assert not (tmp_path / "wrong").exists() or not any((tmp_path / "wrong").iterdir())
    with pytest.raises(InteropError, match="drop --model-config"):
        import_deepspeed(FIXTURES / MEGATRON / "checkpoint", tmp_path / "meg",
                         model_config=section, log=lambda *a: None)
    typo = tmp_path / "typo.yaml"
    typo.write_text("model: {num_layer: 2, hidden_size: 32, num_heads: 4}\n")
    with pytest.raises(InteropError, match="num_layer"):
        import_deepspeed(src, tmp_path / "typo", model_config=typo, log=lambda *a: None)


def test_shards_without_param_slice_mappings_are_read_from_param_shapes(tmp_path):
    # BLOOM's 2022 DeepSpeed saved no param_slice_mappings (Megatron-DeepSpeed issue 343): the
    # parameters lie back to back in param_shapes order across the dp parts, as zero_to_fp32
    # reads them. The fixture's shards without their mappings import the same, bit for bit.
    from bloomtrain.checkpoint.interop.safe_load import load

    src = _copy(tmp_path, MEGATRON)
    for f in sorted((src / "global_step3").glob("bf16_zero_pp_rank_*_optim_states.pt")):
        state = load(f)
        osd = state["optimizer_state_dict"]
        assert "param_slice_mappings" in osd
        del osd["param_slice_mappings"]
        torch.save(state, f)
    old = imported(tmp_path, MEGATRON)
    out = tmp_path / "old-format"
    import_deepspeed(src, out, log=lambda *a: None)
    got = ckpt.CheckpointReader(out, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    for name in old.names():
        for kind in KINDS:
            assert torch.equal(got.load(name, kind), old.load(name, kind)), (name, kind)


def test_a_rank_file_copied_over_another_is_refused(tmp_path):
    """A ZeRO-3 shard (and a stage 1/2 shard without param_slice_mappings, as BLOOM's 2022 saves
    are) records no dp rank: rank 0's file copied over rank 1's imported rank 0's slice of every
    parameter twice, as the model's weights, without a word. Now it names both files."""
    from bloomtrain.checkpoint.interop.safe_load import load

    src = _copy(tmp_path, "hf_zero3_fp32")
    step = src / "global_step3"
    for kind in ("optim", "model"):
        shutil.copy(step / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt",
                    step / f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt")
    for weights_only in (False, True):
        out = tmp_path / f"out{weights_only}"
        with pytest.raises(InteropError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt and "
                           r".*zero_pp_rank_1_mp_rank_00_optim_states\.pt hold the same fp32 "
                           r"partition"):
            import_deepspeed(src, out, weights_only=weights_only, log=lambda *a: None)
        assert not out.exists() or not any(out.iterdir())
    src2 = _copy(tmp_path / "b", MEGATRON)
    files = sorted((src2 / "global_step3").glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    for f in files:
        state = load(f)
        del state["optimizer_state_dict"]["param_slice_mappings"]
        torch.save(state, f)
    shutil.copy(files[0], files[1])
    _refused(src2, tmp_path / "out2", "hold the same fp32 partition")


def test_zero3_sub_groups_import_as_their_groups(tmp_path):
    """ZeRO-3 cuts a parameter group whose partition exceeds zero_optimization.sub_group_size
    (DeepSpeed's default 1e9 elements: bloom-7b1 below dp 8) into sub-groups (stage3.py
    _create_fp16_sub_groups): param_shapes, fp32_flat_groups and the moments are per
    sub-group, param_groups per group, each listing its sub-groups' indices in `params`. The
    fixture's ZeRO-3 shards rewritten so, the same data, import bit for bit as the original
    (paired in order, the sub-groups took other groups' weight decay and the import failed)."""
    import math
    from collections import OrderedDict

    from bloomtrain.checkpoint.interop.safe_load import load

    sub, dp = 5000, 2  # sub_group_size, in partition elements
    src = _copy(tmp_path, "hf_zero3_fp32")
    step = src / "global_step3"
    groups = load(step / "zero_pp_rank_0_mp_rank_00_model_states.pt")["param_shapes"]
    shapes, owners = [], []  # each sub-group's shapes, and its group
    for g, group in enumerate(groups):
        cut, size = [], 0
        items = list(group.items())
        for i, (name, shape) in enumerate(items):
            cut.append((name, shape))
            size += math.ceil(math.prod(shape) / dp)
            if size >= sub or i == len(items) - 1:
                shapes.append(OrderedDict(cut))
                owners.append(g)
                cut, size = [], 0
    assert len(shapes) > len(groups) and owners.count(0) > 1

    def split(flats):  # per group -> per sub-group, in order
        out = []
        for g, flat in enumerate(flats):
            at = 0
            for s, owner in zip(shapes, owners):
                if owner == g:
                    n = sum(math.ceil(math.prod(x) / dp) for x in s.values())
                    out.append(flat[at:at + n].clone())
                    at += n
            assert at == flat.numel()
        return out

    for r in range(dp):
        f = step / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        states = load(f)
        states["param_shapes"] = shapes
        torch.save(states, f)
        f = step / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        states = load(f)
        osd = states["optimizer_state_dict"]
        # The loader's stand-ins for DeepSpeed's classes, as plain values to save again.
        osd["zero_stage"] = int(osd["zero_stage"])
        scaler = osd.get("loss_scaler")
        osd["loss_scaler"] = None if scaler is None else dict(vars(scaler))
        osd["fp32_flat_groups"] = split(osd["fp32_flat_groups"])
        base = osd["optimizer_state_dict"]
        per_group = [base["state"][k] for k in sorted(base["state"])]
        moments = {k: split([s[k] for s in per_group]) for k in ("exp_avg", "exp_avg_sq")}
        base["state"] = {i: {"step": per_group[owners[i]]["step"],
                             **{k: v[i] for k, v in moments.items()}}
                         for i in range(len(shapes))}
        for g, pg in enumerate(base["param_groups"]):
            pg["params"] = [i for i, owner in enumerate(owners) if owner == g]
        torch.save(states, f)
    want = imported(tmp_path, "hf_zero3_fp32")
    out = tmp_path / "sub-groups"
    import_deepspeed(src, out, log=lambda *a: None)
    got = ckpt.CheckpointReader(out, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    assert sorted(got.names()) == sorted(want.names())
    for name in want.names():
        for kind in KINDS:
            assert torch.equal(got.load(name, kind), want.load(name, kind)), (name, kind)


# ---- saves the review found refused or mis-read (real DeepSpeed 0.19 writes each so) ---------
def test_a_zero_stage_0_save_imports_its_weights_and_names_what_it_does_not(tmp_path):
    # Stage 0 saves param_shapes null and keeps its weights in the module, its optimizer a plain
    # torch one in the same file. It was a TypeError traceback, even with --weights-only.
    from bloomtrain.checkpoint.interop.safe_load import load
    src = _copy(tmp_path, "hf_zero2_fp32")
    for f in (src / "global_step3").glob("*_optim_states.pt"):
        f.unlink()
    f = src / "global_step3" / "mp_rank_00_model_states.pt"
    state = load(f)
    state["param_shapes"] = None
    state["ds_config"] = {**state["ds_config"], "zero_optimization": {"stage": 0}}
    torch.save(state, f)
    _refused(src, tmp_path / "out", "a DeepSpeed ZeRO stage 0 save", "pass --weights-only")
    import_deepspeed(src, tmp_path / "w", weights_only=True, log=lambda *a: None)
    got = ckpt.CheckpointReader(tmp_path / "w")
    module = state["module"]
    for name in got.names():
        key = name if name in module else f"transformer.{name}"
        assert torch.equal(got.load(name), module[key].float()), name


def test_a_save_before_adams_first_step_imports_with_zero_moments(tmp_path, monkeypatch):
    # A save at step 0, or an fp16 run whose every step so far overflowed: DeepSpeed's Adam
    # state is empty. It was refused as "files that do not belong together". (The shards are
    # read with their Adam state emptied: rewritten, their DeepSpeed classes would not pickle.)
    from bloomtrain.checkpoint.interop import zero
    read = zero.load

    def unstepped(f, **kw):
        state = read(f, **kw)
        state["optimizer_state_dict"]["base_optimizer_state"]["state"] = {}
        return state
    monkeypatch.setattr(zero, "load", unstepped)
    src = _copy(tmp_path, "hf_zero2_fp32")
    import_deepspeed(src, tmp_path / "out", log=lambda *a: None)
    got = ckpt.CheckpointReader(tmp_path / "out", kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    assert got.manifest["optimizer"]["step_count"] == 0
    for name in got.names():
        assert not got.load(name, "exp_avg").any() and not got.load(name, "exp_avg_sq").any()


def test_a_save_directory_with_two_latests_naming_different_saves_is_refused(tmp_path):
    # DeepSpeed's ds_to_universal writes into the save directory: `latest` (what DeepSpeed
    # resumes from) and `latest_universal` may name different steps. The universal one was
    # taken without a word, an older step.
    src = tmp_path / "save"
    shutil.copytree(FIXTURES / "hf_bf16_zero1" / "checkpoint", src)
    shutil.copytree(FIXTURES / "hf_bf16_zero1" / "universal", src / "global_step3_universal")
    (src / "latest_universal").write_text("global_step3_universal")
    (src / "latest").write_text("global_step5")
    _refused(src, tmp_path / "out", r"holds both latest \(global_step5\) and latest_universal",
             "give the one to import as --input")


def test_a_save_with_frozen_parameters_is_refused_naming_them(tmp_path, monkeypatch):
    # DeepSpeed keeps frozen parameters (requires_grad=False) apart, in frozen_param_shapes:
    # they were reported as "missing for a 2-layer BLOOM", with no way on.
    from bloomtrain.checkpoint.interop import hf_zero
    read = hf_zero.load

    def with_a_frozen_embedding(f, **kw):
        state = read(f, **kw)
        if isinstance(state, dict) and "param_shapes" in state:
            state["frozen_param_shapes"] = {"transformer.word_embeddings.weight": (120, 32)}
        return state
    monkeypatch.setattr(hf_zero, "load", with_a_frozen_embedding)
    _refused(_copy(tmp_path, "hf_zero2_fp32"), tmp_path / "out",
             r"1 parameter\(s\) were frozen in this run \(requires_grad=False: "
             r"transformer.word_embeddings.weight\)", "bloomtrain trains every parameter")


def test_a_megatron_run_with_skipped_steps_imports_its_schedules_position():
    """AnnealingLR.num_steps counts the samples of applied steps only (Megatron steps it when
    the update was applied); the import read it only without consumed_train_samples, so a run
    that had skipped steps came over with its LR ahead of Megatron's (1e-4 where Megatron's next
    LR is 7.5e-4 in the review's case)."""
    from bloomtrain.checkpoint.interop.megatron import train_position

    args = {"consumed_train_samples": 32, "iteration": 4}
    meta = {"lr_scheduler": {"num_steps": 24, "max_lr": 1e-3}, "skipped_steps": 1}
    assert train_position(args, meta) == {"step": 4, "consumed_samples": 32,
                                          "skipped_steps": 1, "lr_samples": 24}
    assert "lr_samples" not in train_position(args, {"skipped_steps": 0})


def test_an_hf_run_under_deepspeed_with_skipped_steps_imports_its_schedules_position(tmp_path):
    """DeepSpeed steps the LR scheduler only for an update it applied (engine._take_model_step
    skips lr_scheduler.step on an fp16 overflow). The import set no lr_samples for an HF model
    trained under DeepSpeed, so its schedule resumed at every sample consumed: 3 steps of 8 with
    2 skipped came over at 24 samples where DeepSpeed's scheduler stood at 8."""
    import json
    from bloomtrain.train.checkpointing import TrainState
    src = _copy(tmp_path, "hf_zero2_fp32")
    f = src / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(f, weights_only=False)
    assert (state["global_steps"], state["global_samples"]) == (3, 24)
    state["skipped_steps"] = 2
    torch.save(state, f)
    import_deepspeed(src, tmp_path / "out", log=lambda *a: None)
    manifest = json.loads(next((tmp_path / "out").glob("step_*/manifest.json")).read_text())
    st = TrainState.from_manifest(manifest)
    assert (st.step, st.consumed_samples, st.skipped_steps, st.lr_samples) == (3, 24, 2, 8)
    # Without skipped steps the schedule is where the samples are, as before.
    state["skipped_steps"] = 0
    torch.save(state, f)
    import_deepspeed(src, tmp_path / "out0", log=lambda *a: None)
    manifest = json.loads(next((tmp_path / "out0").glob("step_*/manifest.json")).read_text())
    assert TrainState.from_manifest(manifest).lr_samples == 24
