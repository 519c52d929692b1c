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

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
HF = ["hf_zero2_fp32", "hf_zero3_fp32", "hf_bf16_zero1"]
MEGATRON = "megatron_pp2_tp2_dp2_bf16"
# (fixture, what is imported: its DeepSpeed checkpoint or its universal conversion)
CASES = [(f, "checkpoint") for f in HF + [MEGATRON]] + \
    [("hf_bf16_zero1", "universal"), (MEGATRON, "universal")]
KINDS = {"model": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def reference(fixture: str) -> dict:
    return torch.load(FIXTURES / fixture / "reference.pt", weights_only=True)


def hf_name(name: str) -> str:
    """GPTModelPipe's names for the fixture's 2-layer BLOOM (blocks are layers 3 and 4, the final
    LayerNorm layer 6), HF names unchanged."""
    fixed = {"tied_modules.embed.word_embeddings.weight": "transformer.word_embeddings.weight",
             "tied_modules.embed.word_embeddings.norm.weight":
                 "transformer.word_embeddings_layernorm.weight",
             "tied_modules.embed.word_embeddings.norm.bias":
                 "transformer.word_embeddings_layernorm.bias",
             "6.weight": "transformer.ln_f.weight", "6.bias": "transformer.ln_f.bias"}
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"([34])\.(.+)", name)
    return f"transformer.h.{int(m.group(1)) - 3}.{m.group(2)}" if m else name


def imported(tmp_path, fixture: str, what: str = "checkpoint", **kw) -> ckpt.CheckpointReader:
    out = tmp_path / f"{fixture}-{what}{'-weights' if kw.get('weights_only') else ''}"
    import_deepspeed(FIXTURES / fixture / what, out, log=lambda *a: None, **kw)
    kinds = ckpt.MODEL_KINDS + (ckpt.OPTIM_KINDS if not kw.get("weights_only") else ())
    return ckpt.CheckpointReader(out, kinds=kinds)


@pytest.mark.parametrize("fixture,what", CASES)
def test_masters_and_moments_equal_deepspeeds_extraction(tmp_path, fixture, what):
    ref = reference(fixture)
    reader = imported(tmp_path, fixture, what)
    # DeepSpeed's universal conversion of an HF model also copies the tied lm_head.weight (the
    # embedding, no moments of its own); bloomtrain stores the tied head once.
    universal = {k: {hf_name(n): t for n, t in v.items() if n != "lm_head.weight"}
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
    assert m["train_state"] == {"step": 3, "consumed_samples": 24, "skipped_steps": 0}
    assert reader.path.name == "step_00000003"
    reader.check_complete()


def _megatron_weights(fixture_dir: Path) -> dict[str, list[torch.Tensor]]:
    """HF name -> the bf16 pieces of each tp rank, from the layer files (layer_01: embedding,
    03/04: blocks, 06: final LayerNorm)."""
    out: dict[str, list] = {}
    step = fixture_dir / "checkpoint" / "global_step3"
    for layer in (1, 3, 4, 6):
        for tp in (0, 1):
            state = torch.load(step / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt",
                               weights_only=True)
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


# ---- continuation ----------------------------------------------------------------------------------

# (fixture, what, layout overrides): one process, and another layout than the run's.
ONE, TP2 = {"parallel.tp": 1, "parallel.pp": 1}, {"parallel.tp": 2, "parallel.pp": 1}
PP2 = {"parallel.tp": 1, "parallel.pp": 2, "parallel.pp_partition": "uniform"}
CONTINUE = [(f, "checkpoint", layout) for f in HF + [MEGATRON] for layout in (ONE, TP2)] + \
    [(MEGATRON, "checkpoint", PP2), (MEGATRON, "universal", ONE), ("hf_bf16_zero1", "universal", ONE)]


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
# after one AdamW step of lr 1e-3 differ by up to 2.8e-4 where bf16 gradients differ (bound
# 5e-4, half a step: a step from wrong moments or with a wrong Adam step count moves masters by
# about a whole lr).
LOSS_TOL = {"fp32": 1e-6, "bf16": 1e-4}
MASTER_TOL = {"fp32": 1e-6, "bf16": 5e-4}


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
    # The run's position: iteration 3, 24 samples; the LR of the next step is the source's
    # (Megatron's AnnealingLR at 24 samples for the Megatron fixture, the constant 1e-3 else).
    assert res["start"] == (3, 24) and not res["skipped"]
    assert res["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    assert abs(res["loss"] - ref["loss"]) <= LOSS_TOL[precision] * \
        (ref["loss"] if precision == "bf16" else 1.0), (res["loss"], ref["loss"])
    after = ckpt.CheckpointReader(res["path"])
    worst = 0.0
    for name, want in ref["next_fp32"].items():
        name = hf_name(name)
        if name == "lm_head.weight":
            continue
        got = after.load(name)
        worst = max(worst, float((got.reshape(-1) - want.reshape(-1).detach()).abs().max()))
    assert worst <= MASTER_TOL[precision], worst


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
    # DeepSpeed's CPU accelerator has no fp16, so no fixture: DeepSpeed's DynamicLossScaler rule
    # written out here. It doubles the scale when (cur_iter - last_overflow_iter) % window == 0
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


def test_zero3_weights_only_come_from_the_shards(tmp_path):
    # ZeRO-3's model-states files hold empty placeholders: the weights are the fp32 masters in
    # the optimizer shards, as DeepSpeed's zero_to_fp32 consolidates them.
    ref = reference("hf_zero3_fp32")
    reader = imported(tmp_path, "hf_zero3_fp32", weights_only=True)
    assert not reader.has("exp_avg")
    for name in reader.names():
        assert torch.equal(reader.load(name), ref["zero_to_fp32"][name]), name
