"""The full trainer under tensor (and sequence) parallelism against one process, and the
multi-process launcher."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomtrain.train import Trainer
from tests.dist import run_ranks
from tests.helpers import gather_full_tensors, make_cfg, metrics, write_config
from tests.layouts import LOSS_RTOL, WEIGHT_ATOL


def _tp_worker(rank, world, dataset, tmp, tp, sp, save):
    extra = {"checkpoint": {"dir": f"{tmp}/ck", "save_interval": 10}} if save else {}
    cfg = make_cfg(dataset, Path(tmp), parallel={"tp": tp, "sequence_parallel": sp},
                   train__train_iters=10, **extra)
    trainer = Trainer(cfg, log=lambda *a: None)
    res = trainer.run()
    full = gather_full_tensors(trainer.engine.master_state(), trainer.topo)
    return res.losses, {k: v.clone() for k, v in full.items()}, res.checkpoint


@pytest.fixture(scope="module")
def single_run(dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    trainer = Trainer(make_cfg(dataset, tmp, train__train_iters=10), log=lambda *a: None)
    res = trainer.run()
    return res.losses, {k: v.clone() for k, v in trainer.engine.master_state().items()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_training_matches_single_process(dataset, tmp_path, single_run, sp):
    ref_losses, ref_master = single_run
    outs = run_ranks(2, _tp_worker, dataset, str(tmp_path), 2, sp, not sp)
    for losses, master, _ in outs:
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert master.keys() == ref_master.keys()
        for k, v in master.items():
            torch.testing.assert_close(v, ref_master[k], rtol=0, atol=WEIGHT_ATOL)
    if not sp:
        # A checkpoint trained with tp=2 exports to HF with logit parity.
        transformers = pytest.importorskip("transformers")
        from bloomtrain import load_model
        from bloomtrain.checkpoint.hf.convert import export_hf
        ckpt = outs[0][2]
        export_hf(ckpt, str(tmp_path / "hf"))
        hf = transformers.BloomForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        ours = load_model(ckpt)
        ids = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            diff = (hf(ids).logits - ours(ids)).abs().max().item()
        assert diff < 1e-4
        # And the exported weights are the tp=2 run's gathered master weights.
        sd = dict(ours.named_parameters())
        for k, v in outs[0][1].items():
            assert torch.equal(sd[k], v)


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "bloomtrain", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_nproc2_tp2_matches_nproc1(dataset, tmp_path):
    cfg = write_config(tmp_path, dataset, "one")
    one = _cli("train", "--config", str(cfg), "--nproc", "1")
    assert one.returncode == 0, one.stderr
    two = _cli("train", "--config", str(cfg), "--nproc", "2", "parallel.tp=2",
               f"run_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr + two.stdout
    a = [r["loss"] for r in metrics(tmp_path / "one") if "loss" in r]
    b = [r["loss"] for r in metrics(tmp_path / "two") if "loss" in r]
    assert len(a) == len(b) == 6
    np.testing.assert_allclose(b, a, rtol=LOSS_RTOL)
    assert "tp=2" in json.dumps(metrics(tmp_path / "two")[0])


def test_cli_rejects_impossible_layout(dataset, tmp_path):
    cfg = write_config(tmp_path, dataset, "bad")
    out = _cli("train", "--config", str(cfg), "--nproc", "3", "parallel.tp=2")
    assert out.returncode == 2
    assert "not divisible by parallel.tp" in out.stderr


def test_cli_nproc4_pp4_1f1b_matches_nproc1(dataset, tmp_path):
    # The command: 4 pipeline stages with the 1F1B schedule on the demo-style data,
    # against one process. tiny has 4 blocks: one per stage, embedding on the first, head on
    # the last ("type:transformer|embedding" puts them there).
    cfg = write_config(tmp_path, dataset, "one")
    one = _cli("train", "--config", str(cfg), "--nproc", "1")
    assert one.returncode == 0, one.stderr
    four = _cli("train", "--config", str(cfg), "--nproc", "4", "parallel.pp=4",
                "parallel.pp_schedule=1f1b", "parallel.pp_partition=uniform",
                "parallel.pp_timeline=true", f"run_dir={tmp_path / 'four'}")
    assert four.returncode == 0, four.stderr + four.stdout
    a = [r["loss"] for r in metrics(tmp_path / "one") if "loss" in r]
    b = [r["loss"] for r in metrics(tmp_path / "four") if "loss" in r]
    assert len(a) == len(b) == 6
    np.testing.assert_allclose(b, a, rtol=LOSS_RTOL)
    assert "pp=4" in metrics(tmp_path / "four")[0]["layout"]
    timeline = _cli("pipeline-timeline", str(tmp_path / "four"))
    assert timeline.returncode == 0 and "bubble" in timeline.stdout.lower(), timeline.stderr


def _3d_worker(rank, world, dataset, tmp, zero, precision):
    cfg = make_cfg(dataset, Path(tmp), train__train_iters=10, train__micro_batch_size=1,
                   train__precision=precision,
                   parallel={"tp": 2, "pp": 2, "zero_stage": zero, "pp_schedule": "1f1b",
                             "pp_partition": "uniform"},
                   checkpoint={"dir": f"{tmp}/ck", "save_interval": 10, "async_save": False})
    res = Trainer(cfg, log=lambda *a: None).run()
    return res.losses, res.checkpoint


def _final_weights(path):
    from bloomtrain.checkpoint import CheckpointReader
    reader = CheckpointReader(path)
    return {n: reader.load(n) for n in reader.names()}


@pytest.mark.parametrize("zero", [1, 3])
def test_3d_tp2_pp2_dp2_matches_single_process(dataset, tmp_path, zero):
    # 8 ranks: tp=2 x pp=2 x dp=2 with the 1F1B schedule and ZeRO, against one process taking
    # the whole global batch. fp32: only summation orders differ (tp all-reduces, dp
    # reduce-scatters, micro-batch accumulation), so the parity tolerances above apply.
    single = Trainer(make_cfg(dataset, tmp_path / "one", train__train_iters=10,
                              train__micro_batch_size=1,
                              checkpoint={"dir": str(tmp_path / "one_ck"), "save_interval": 10,
                                          "async_save": False}), log=lambda *a: None)
    ref = single.run()
    outs = run_ranks(8, _3d_worker, dataset, str(tmp_path / "3d"), zero, "fp32")
    for losses, _ in outs:
        np.testing.assert_allclose(losses, ref.losses, rtol=LOSS_RTOL)
    got, want = _final_weights(outs[0][1]), _final_weights(ref.checkpoint)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=WEIGHT_ATOL)
    if zero == 3:
        # export-hf from a tp2.pp2.dp2 ZeRO-3 checkpoint: HF loads it with our logits.
        transformers = pytest.importorskip("transformers")
        from bloomtrain import load_model
        from bloomtrain.checkpoint.hf.convert import export_hf
        export_hf(outs[0][1], str(tmp_path / "hf"), log=lambda *a: None)
        hf = transformers.BloomForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        ids = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            assert (hf(ids).logits - load_model(outs[0][1])(ids)).abs().max().item() < 1e-4


def _combo_worker(rank, world, dataset, tmp, parallel):
    cfg = make_cfg(dataset, Path(tmp), train__train_iters=4, train__micro_batch_size=1,
                   model={"preset": None, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                          "vocab_size": 256},
                   parallel=parallel)
    return Trainer(cfg, log=lambda *a: None).run().losses


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "zero_stage": 3, "pp_schedule": "interleaved", "num_virtual_stages": 2,
     "pp_partition": "uniform"},
    {"pp": 2, "zero_stage": 2, "pp_schedule": "gpipe", "pp_partition": "uniform"},
    {"tp": 2, "zero_stage": 3, "sequence_parallel": True},
], ids=["pp2.dp2-interleaved-z3", "pp2.dp2-gpipe-z2", "tp2.dp2-sp-z3"])
def test_other_compositions_match_single_process(dataset, tmp_path, single4, parallel):
    outs = run_ranks(4, _combo_worker, dataset, str(tmp_path), parallel)
    for losses in outs:
        np.testing.assert_allclose(losses, single4, rtol=LOSS_RTOL)


@pytest.fixture(scope="module")
def single4(dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single4")
    cfg = make_cfg(dataset, tmp, train__train_iters=4, train__micro_batch_size=1)
    return Trainer(cfg, log=lambda *a: None).run().losses


# ---- issue 36: the data and the tokenizer, checked before any process starts -----------------

# bloomtrain.cli.main in a fresh interpreter: its exit code, its stderr, and whether torch was
# imported (the launcher imports it to start workers, so no torch means no worker started).
MAIN_PROBE = (
    "import contextlib, io, json, sys\n"
    "from bloomtrain.cli import main\n"
    "err = io.StringIO()\n"
    "with contextlib.redirect_stderr(err):\n"
    "    code = main(sys.argv[1:])\n"
    "print(json.dumps({'code': code, 'stderr': err.getvalue(), 'torch': 'torch' in sys.modules}))\n")


def _main_probe(*argv):
    r = subprocess.run([sys.executable, "-c", MAIN_PROBE, *argv], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def _one_line_error(stderr):
    assert stderr.count("\n") == 1 and stderr.startswith("bloomtrain train: error: "), stderr
    assert "Traceback" not in stderr
    return stderr


def test_a_missing_dataset_or_tokenizer_is_refused_before_any_worker(dataset, tmp_path):
    cfg = write_config(tmp_path, dataset, "run")
    nope = tmp_path / "nope_text_document"
    missing_data = _main_probe("train", "--config", str(cfg), "--nproc", "2",
                               f"data.paths=[{nope}]")
    missing_tok = _main_probe("train", "--config", str(cfg), "--nproc", "2",
                              f"data.tokenizer={tmp_path / 'no_tok'}")
    for got in (missing_data, missing_tok):
        assert got["code"] == 2 and not got["torch"], got
        _one_line_error(got["stderr"])
    assert f"data.paths: no dataset at {nope} (.idx and .bin missing)" in missing_data["stderr"]
    assert f"data.tokenizer: tokenizer {tmp_path / 'no_tok'} not found" in missing_tok["stderr"]
    # As the user runs it: the one line and nothing else, no elastic agent's traceback.
    out = _cli("train", "--config", str(cfg), "--nproc", "2", f"data.paths=[{nope}]")
    assert out.returncode == 2 and out.stdout == ""
    assert _one_line_error(out.stderr) == missing_data["stderr"]
    assert not (tmp_path / "run").exists()


def _wide_dataset(tmp_path) -> str:
    """Tokenized with a 918-token tokenizer: ids up to 917, a third of them past 256."""
    from bloomtrain.data.indexed import write_dataset
    rng = np.random.RandomState(0)
    docs = [[rng.randint(4, 918, size=rng.randint(20, 60)).tolist() + [2]] for _ in range(300)]
    docs[7][0][3] = 917
    write_dataset(tmp_path / "wide_text_document", docs, dtype=np.uint16)
    return str(tmp_path / "wide_text_document")


WIDE_ERROR = ("holds token ids up to 917, past the model's vocabulary of 256 ids (0-255; "
              "model.vocab_size=256)")


def _wide_worker(rank, world, wide, tmp, config):
    """A worker started without bloomtrain's launcher (as torchrun starts them): both the
    command and the Trainer refuse before anything trains."""
    import contextlib
    import io

    from bloomtrain.cli import main
    from bloomtrain.errors import UserError
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", config, "parallel.tp=2", f"data.paths=[{wide}]"])
    cfg = make_cfg(wide, Path(tmp), parallel={"tp": 2})
    try:
        Trainer(cfg, log=lambda *a: None)
    except UserError as e:
        return code, err.getvalue(), str(e)
    return code, err.getvalue(), None


def test_token_ids_past_the_vocabulary_are_refused_before_the_first_step(dataset, tmp_path):
    from bloomtrain.errors import UserError
    wide = _wide_dataset(tmp_path)
    cfg = write_config(tmp_path, dataset, "run")
    # The launcher, tp=2 over 2 workers and one process: refused before either starts.
    for argv in (["--nproc", "2", "parallel.tp=2"], []):
        got = _main_probe("train", "--config", str(cfg), *argv, f"data.paths=[{wide}]")
        assert got["code"] == 2 and not got["torch"], got
        assert f"dataset {wide} {WIDE_ERROR}" in _one_line_error(got["stderr"])
    # The same within each of tp=2's workers when no launcher checked first.
    for code, stderr, error in run_ranks(2, _wide_worker, wide, str(tmp_path / "w"), str(cfg)):
        assert code == 2 and WIDE_ERROR in _one_line_error(stderr)
        assert error is not None and WIDE_ERROR in error
    # tp=1 in this process: the error, not torch's IndexError at the first step. A blend names
    # the dataset that does not fit.
    blend = make_cfg(dataset, tmp_path / "t1", train__train_iters=2)
    blend.data.paths = [f"0.5 {dataset}", f"0.5 {wide}"]
    with pytest.raises(UserError, match=f"dataset {wide} holds token ids up to 917") as e:
        Trainer(blend, log=lambda *a: None)
    assert dataset not in str(e.value)
    assert not (tmp_path / "w").exists() and not (tmp_path / "t1").exists()
    # The data that fits still trains, in a blend too.
    blend.data.paths = [f"0.5 {dataset}", f"0.5 {dataset}"]
    losses = Trainer(blend, log=lambda *a: None).run().losses
    assert len(losses) == 2 and all(np.isfinite(losses))
