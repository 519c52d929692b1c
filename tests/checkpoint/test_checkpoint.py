"""Sharded, layout-independent, atomic checkpoints: resharding across layouts, corrupt-checkpoint
fallback, refusal of pickles, and the preemption / kill-switch exits."""
import os
import pickle
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import Trainer, train
from tests import faults
from tests.dist import run_ranks
from tests.helpers import make_cfg, read_rest, write_config

QUIET = dict(log=lambda *a: None)


def full_state(path, kinds=("model", "exp_avg", "exp_avg_sq")):
    reader = ckpt.CheckpointReader(path, kinds=kinds)
    return {(k, n): reader.load(n, k) for n in reader.names() for k in kinds}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def layout_cfg(dataset, tmp, layout, **over):
    tp, pp, dp, zero = layout
    parallel = {"tp": tp, "zero_stage": zero}
    if pp > 1:
        parallel.update(pp=pp, pp_schedule="1f1b")
    return make_cfg(dataset, Path(tmp), parallel=parallel, train__micro_batch_size=2, **over)


CONTINUE = 3  # steps trained after a reshard, so that the Adam moments shape the weights


def _reshard_worker(rank, world, dataset, tmp, layout, src, out, start):
    """Load `src` (step `start`) in `layout`, save it again at once, then train CONTINUE steps
    and save at the end."""
    cfg = layout_cfg(dataset, tmp, layout, train__train_iters=start + CONTINUE,
                     checkpoint={"dir": out, "resume": src, "async_save": False})
    trainer = Trainer(cfg, **QUIET)
    trainer.checkpoints.save(trainer.state)
    res = trainer.run()
    return res.losses, res.checkpoint


def _single_continuation(dataset, tmp, src, start):
    """The reference: one process continues from the same checkpoint."""
    cfg = layout_cfg(dataset, tmp, (1, 1, 1, 0), train__train_iters=start + CONTINUE,
                     checkpoint={"dir": str(Path(tmp) / "ck"), "resume": str(src),
                                 "async_save": False})
    res = train(cfg, **QUIET)
    return res.losses, full_state(res.checkpoint)


@pytest.fixture(scope="module")
def source_checkpoint(dataset, tmp_path_factory):
    """4 steps on one process (fp32, zero 0), checkpointed at step 4, and the single-process
    continuation from it."""
    tmp = tmp_path_factory.mktemp("src")
    cfg = layout_cfg(dataset, tmp, (1, 1, 1, 0), train__train_iters=4,
                     checkpoint={"dir": str(tmp / "ck"), "save_interval": 4})
    train(cfg, **QUIET)
    src = tmp / "ck" / ckpt.step_dir_name(4)
    return src, _single_continuation(dataset, tmp / "same", src, 4)


# After resharding, the layouts continue for 3 steps in fp32 against one process continuing from
# the same checkpoint: only the summation order of tp/dp reductions differs (~1e-7 relative per
# step). Measured: losses <= 1e-7 relative, masters <= 1.2e-7 apart, moments <= 5.2e-7 of each
# tensor's largest entry. Misplaced moments (another parameter's, another shard's, or none) move
# the weights by ~lr = 1e-3 within these 3 steps and the moments by their own size.
NEXT_LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
MOMENT_RTOL = 1e-5


def assert_continues_like(got_losses, got_state, ref):
    ref_losses, ref_state = ref
    np.testing.assert_allclose(got_losses, ref_losses, rtol=NEXT_LOSS_RTOL)
    assert got_state.keys() == ref_state.keys()
    for (kind, name), want in ref_state.items():
        err = (got_state[kind, name] - want).abs().max().item()
        if kind == "model":
            assert err <= WEIGHT_ATOL, (kind, name, err)
        else:
            assert err <= MOMENT_RTOL * want.abs().max().item(), (kind, name, err)


@pytest.mark.parametrize("layout", [(2, 2, 2, 1), (2, 1, 2, 3), (1, 4, 1, 0)],
                         ids=["1.1.1->2.2.2z1", "1.1.1->tp2.dp2.z3", "1.1.1->pp4"])
def test_reshard_from_single_process(dataset, tmp_path, source_checkpoint, layout):
    src, reference = source_checkpoint
    out = tmp_path / "out"
    losses, final = run_ranks(_world(layout), _reshard_worker, dataset, str(tmp_path), layout,
                              str(src), str(out), 4)[0]
    # Weights, fp32 masters and Adam moments, gathered to full shape, are bitwise what was saved.
    assert_same_state(full_state(out / ckpt.step_dir_name(4)), full_state(src))
    assert_continues_like(losses, full_state(final), reference)


@pytest.mark.parametrize("first,second", [((2, 2, 2, 3), (1, 1, 4, 1)),
                                          ((1, 4, 1, 2), (1, 2, 2, 0)),
                                          ((2, 1, 2, 1), (2, 2, 1, 3))],
                         ids=["2.2.2z3->1.1.4z1", "pp4z2->pp2.dp2z0", "tp2.dp2z1->tp2.pp2z3"])
def test_reshard_between_parallel_layouts(dataset, tmp_path, source_checkpoint, first, second):
    src, _ = source_checkpoint
    mid = tmp_path / "mid"
    run_ranks(_world(first), _reshard_worker, dataset, str(tmp_path), first, str(src), str(mid),
              4)
    mid_ckpt = mid / ckpt.step_dir_name(4 + CONTINUE)
    out = tmp_path / "out"
    saved = full_state(mid_ckpt)
    losses, final = run_ranks(_world(second), _reshard_worker, dataset, str(tmp_path / "o"),
                              second, str(mid_ckpt), str(out), 4 + CONTINUE)[0]
    assert_same_state(full_state(out / ckpt.step_dir_name(4 + CONTINUE)), saved)
    assert len(losses) == CONTINUE
    reference = _single_continuation(dataset, tmp_path / "single", mid_ckpt, 4 + CONTINUE)
    assert_continues_like(losses, full_state(final), reference)


def _world(layout):
    return layout[0] * layout[1] * layout[2]


def test_corrupt_and_truncated_checkpoints_fall_back(dataset, tmp_path, monkeypatch):
    root = tmp_path / "ck"
    cfg = make_cfg(dataset, tmp_path, train__train_iters=6,
                   checkpoint={"dir": str(root), "save_interval": 2, "keep_last": 5})
    train(cfg, **QUIET)
    steps = [s for s, _ in ckpt.list_checkpoints(root)]
    assert steps == [2, 4, 6]
    model6 = root / ckpt.step_dir_name(6) / "model-00000.safetensors"
    data = bytearray(model6.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, bad checksum
    model6.write_bytes(bytes(data))
    optim4 = root / ckpt.step_dir_name(4) / "optim-00000.safetensors"
    with open(optim4, "r+b") as f:
        f.truncate(optim4.stat().st_size // 2)
    # A save killed half way leaves only a temporary directory behind.
    (root / ".step_00000008.tmp").mkdir()
    lines, hashed = [], []
    real_sha = ckpt.format.sha256_file
    monkeypatch.setattr(ckpt.format, "sha256_file", lambda f, *a: hashed.append(
        (f.parent.name, f.name)) or real_sha(f, *a))
    resumed = Trainer(make_cfg(dataset, tmp_path / "r", train__train_iters=6,
                               checkpoint={"dir": str(root)}),
                      log=lambda *a: lines.append(" ".join(map(str, a))))
    assert resumed.state.step == 2
    # The checkpoint resumed from is hashed once, when it is chosen, not again when it is read
    # (at BLOOM-176B every file is 2.1 TB per rank).
    from_2 = [f for d, f in hashed if d == ckpt.step_dir_name(2)]
    assert from_2 and len(from_2) == len(set(from_2)), hashed
    text = "\n".join(lines)
    assert "skipping step_00000006" in text and "checksum" in text
    assert "skipping step_00000004" in text and "truncated" in text


def test_an_unreadable_checkpoint_is_skipped_like_a_corrupt_one(dataset, tmp_path, monkeypatch):
    # A bad sector (EIO) in a shard or a manifest the job may not read (EACCES) made resume=auto
    # (and `bloomtrain status`) die on an OSError traceback instead of taking the older one.
    import errno
    from bloomtrain.report import status_text
    root = tmp_path / "ck"
    train(make_cfg(dataset, tmp_path, train__train_iters=4,
                   checkpoint={"dir": str(root), "save_interval": 2}), **QUIET)
    newest = root / ckpt.step_dir_name(4)
    real_sha, real_read = ckpt.format.sha256_file, Path.read_text

    def sha(f, *a):
        if f.parent == newest:
            raise OSError(errno.EIO, "Input/output error", str(f))
        return real_sha(f, *a)

    def read_text(self, *a, **k):
        if self == newest / "manifest.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self, *a, **k)
    for name, fake in (("sha256_file", sha), ("read_text", read_text)):
        with monkeypatch.context() as m:
            if name == "sha256_file":
                m.setattr(ckpt.format, "sha256_file", fake)
            else:
                m.setattr(Path, "read_text", fake)
            lines = []
            resumed = Trainer(make_cfg(dataset, tmp_path / name, train__train_iters=6,
                                       checkpoint={"dir": str(root)}),
                              log=lambda *a: lines.append(" ".join(map(str, a))))
            resumed.watchdog.stop()
            assert resumed.state.step == 2, name
            text = "\n".join(lines)
            assert "skipping step_00000004" in text, text
            assert ("Input/output error" if name == "sha256_file" else "Permission denied") \
                in text
            if name == "read_text":
                status_text(tmp_path / "run")  # reads the checkpoints too: no traceback


def test_a_ctrl_c_during_a_one_process_save_leaves_nothing(tmp_path, monkeypatch):
    # An import (one process, one save) interrupted mid-write left `.step_00000000.tmp/` and
    # the new output directory behind, for good when the user then chose another output.
    from bloomtrain.model.presets import BloomShape
    shape = BloomShape(num_layers=1, hidden_size=8, num_heads=2, vocab_size=16,
                       ffn_hidden_size=32)
    state = {"transformer.ln_f.weight": torch.ones(8)}
    real = ckpt.writer._write_shard

    def interrupted(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(ckpt.writer, "_write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path / "new", 0, state, shape)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path / "old", 0, state, shape)
    assert list((tmp_path / "old").iterdir()) == []


def test_a_manifest_is_the_state_when_it_was_taken():
    # An async save writes the manifest after the shards, while training goes on appending to
    # the loss window: the manifest's lists are copies taken at the save.
    from bloomtrain.train.checkpointing import TrainState
    state = TrainState(step=4, consumed_samples=32, loss_window=[1.0, 2.0],
                       skipped_samples=[{"start": 8, "end": 16, "loss": 9.0}])
    meta = state.manifest()
    state.loss_window.append(3.0)
    state.skipped_samples[0]["end"] = 24
    assert meta["loss_window"] == [1.0, 2.0]
    assert meta["train_state"]["skipped_samples"] == [{"start": 8, "end": 16, "loss": 9.0}]


def test_a_runs_saves_are_never_pruned_for_another_runs_checkpoints(dataset, tmp_path):
    """keep_last counts this run's history only. A fresh run (resume=none) into a directory
    holding another run's checkpoints is refused before it trains (its first saves were the
    lowest steps there, so pruning deleted each right after writing it, and `latest` named a
    deleted one); a run resumed from an older step by path is warned, and its saves are kept
    over the higher steps of the history it left; resume=auto finding only damaged
    checkpoints is refused, not started over (which truncated metrics.jsonl)."""
    from bloomtrain.errors import UserError

    root = tmp_path / "ck"
    train(make_cfg(dataset, tmp_path, train__train_iters=6,
                   checkpoint={"dir": str(root), "save_interval": 2, "keep_last": 2}), **QUIET)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 6]
    with pytest.raises(UserError, match="already holds step_00000004, step_00000006"):
        Trainer(make_cfg(dataset, tmp_path / "fresh", train__train_iters=3,
                         checkpoint={"dir": str(root), "resume": "none"}), **QUIET)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 6]

    lines = []
    train(make_cfg(dataset, tmp_path / "back", train__train_iters=5,
                   checkpoint={"dir": str(root), "resume": str(root / ckpt.step_dir_name(4)),
                               "save_interval": 1, "keep_last": 1}),
          log=lambda *a: lines.append(" ".join(map(str, a))))
    assert "WARNING" in "\n".join(lines) and "step_00000006" in "\n".join(lines)
    # Step 5 is this run's newest: kept; 4 pruned (keep_last 1); 6 is not this run's.
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [5, 6]
    assert (root / "latest").read_text().strip() == ckpt.step_dir_name(5)

    for _, path in ckpt.list_checkpoints(root):
        model = path / "model-00000.safetensors"
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0x01
        model.write_bytes(bytes(data))
    metrics = tmp_path / "back" / "run" / "metrics.jsonl"
    before = metrics.read_bytes()
    with pytest.raises(UserError, match="none passed its checks"):
        Trainer(make_cfg(dataset, tmp_path / "back", train__train_iters=6,
                         checkpoint={"dir": str(root)}), **QUIET)
    assert metrics.read_bytes() == before


def _resume_auto_worker(rank, world, dataset, tmp, root, resume="auto", zero=1):
    """A dp2 job resuming with checkpoint.resume=`resume`: the step it took up, the files this
    rank hashed, its log, and the elements it read of each kind."""
    hashed, lines, read = [], [], {}
    real_sha, real_fill = ckpt.format.sha256_file, ckpt.CheckpointReader._fill
    ckpt.format.sha256_file = lambda f, *a: hashed.append((f.parent.name, f.name)) or \
        real_sha(f, *a)

    def fill(self, name, kind, frags, out, lo=0):
        read[kind] = read.get(kind, 0) + out.numel()
        return real_fill(self, name, kind, frags, out, lo)

    ckpt.CheckpointReader._fill = fill
    trainer = Trainer(layout_cfg(dataset, tmp, (1, 1, 2, zero), train__train_iters=6,
                                 checkpoint={"dir": root, "resume": resume}),
                      log=lambda *a: lines.append(" ".join(map(str, a))))
    step = trainer.state.step
    ckpt.CheckpointReader._fill = real_fill
    trainer.run()  # to its end (steps 5 and 6), which stops the job's threads
    return step, hashed, "\n".join(lines), read


def test_the_ranks_of_a_job_share_the_checksums_and_agree(dataset, tmp_path):
    """resume=auto with 2 ranks (and then a checkpoint named by path): each data file of the checkpoint taken up is hashed by one rank,
    not by every rank (at BLOOM-176B's 2.1 TB and 384 ranks, 800 TB of reads became one
    checkpoint's worth), and a file only one rank hashes, found corrupt, sends both ranks to the
    checkpoint before, each saying why."""
    root = tmp_path / "ck"
    run_ranks(2, _train_dp2_worker, dataset, str(tmp_path), str(root))
    step4, step6 = root / ckpt.step_dir_name(4), root / ckpt.step_dir_name(6)
    names = sorted(ckpt.read_manifest(step6)["files"])
    assert len(names) >= 4  # model and optimizer files of both ranks, and more
    # Corrupt the file rank 1 hashes (every second name, from the second): same size.
    victim = step6 / names[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    results = run_ranks(2, _resume_auto_worker, dataset, str(tmp_path / "r"), str(root))
    assert [r[0] for r in results] == [4, 4]
    # Rank 0 logs; it did not hash that file, and says what rank 1 found.
    assert names[1] not in [f for d, f in results[0][1] if d == step6.name]
    log = results[0][2]
    assert f"skipping {step6.name}" in log and names[1] in log and "checksum" in log
    hashed4 = [f for r in results for d, f in r[1] if d == step4.name]
    # Each file once, and the manifest's own digest once (by rank 0).
    assert sorted(hashed4) == sorted([*ckpt.read_manifest(step4)["files"], "manifest.json"])
    assert {f for d, f in results[0][1] if d == step6.name}.isdisjoint(
        {f for d, f in results[1][1] if d == step6.name})
    # A checkpoint named by path is shared out the same way.
    results = run_ranks(2, _resume_auto_worker, dataset, str(tmp_path / "p"), str(root),
                        str(step4))
    assert [r[0] for r in results] == [4, 4]
    hashed4 = [f for r in results for d, f in r[1] if d == step4.name]
    assert sorted(hashed4) == sorted([*ckpt.read_manifest(step4)["files"], "manifest.json"])
    # ZeRO-1 at dp2: each rank reads its half of each Adam moment, not the whole (the masters
    # whole: its compute copy needs every weight).
    total = sum(t.numel() for t in full_state(step4, ("model",)).values())
    for r in results:
        read = r[3]
        assert read["model"] == total
        for kind in ("exp_avg", "exp_avg_sq"):
            assert 0.4 * total < read[kind] < 0.6 * total, (kind, read[kind], total)
    assert sum(r[3]["exp_avg"] for r in results) == total


def test_a_zero3_rank_reads_its_part_of_the_masters_too(dataset, tmp_path):
    """At ZeRO-3 no rank holds a full compute copy, so the masters are read by part too: each
    rank reads about half of every state at dp2, and the two halves make the whole."""
    root = tmp_path / "ck"
    run_ranks(2, _train_dp2_worker, dataset, str(tmp_path), str(root), 3)
    step4 = root / ckpt.step_dir_name(4)
    results = run_ranks(2, _resume_auto_worker, dataset, str(tmp_path / "r"), str(root),
                        str(step4), 3)
    assert [r[0] for r in results] == [4, 4]
    total = sum(t.numel() for t in full_state(step4, ("model",)).values())
    for kind in ("model", "exp_avg", "exp_avg_sq"):
        assert all(0.4 * total < r[3][kind] < 0.6 * total for r in results), kind
        assert sum(r[3][kind] for r in results) == total, kind


def _train_dp2_worker(rank, world, dataset, tmp, root, zero=1):
    """dp2 at ZeRO stage `zero`: 6 steps, saved at 2, 4 and 6."""
    train(layout_cfg(dataset, tmp, (1, 1, 2, zero), train__train_iters=6,
                     checkpoint={"dir": root, "save_interval": 2, "keep_last": 5}), **QUIET)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['BLOOMTRAIN_PWNED']}",))


def test_malicious_pickle_is_refused(dataset, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("BLOOMTRAIN_PWNED", str(marker))
    payload = pickle.dumps({"transformer.word_embeddings.weight": _Evil()})
    root = tmp_path / "ck"
    train(make_cfg(dataset, tmp_path, train__train_iters=2,
                   checkpoint={"dir": str(root), "save_interval": 2}), **QUIET)
    step = root / ckpt.step_dir_name(2)
    # The attacker replaces a shard with a pickle and fixes the manifest's size and checksum.
    target = step / "model-00000.safetensors"
    target.write_bytes(payload)
    import hashlib
    import json
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["model-00000.safetensors"] = {
        "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    import bloomtrain
    with pytest.raises(Exception):
        bloomtrain.load_model(step)
    with pytest.raises(Exception):
        Trainer(make_cfg(dataset, tmp_path / "r", checkpoint={"dir": str(root),
                                                              "resume": str(step)}), **QUIET)
    # And an HF directory whose pytorch_model.bin is a malicious pickle.
    from bloomtrain.checkpoint import hf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(
        {"model_type": "bloom", "n_embed": 64, "n_layer": 1, "n_head": 4, "vocab_size": 256}))
    (hf_dir / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(Exception, match="weights_only"):
        hf.import_hf(hf_dir, tmp_path / "imported", log=lambda *a: None)
    assert not marker.exists()


def _start_training(tmp_path, dataset, *overrides, env=None):
    cfg = write_config(tmp_path, dataset, "sig")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "bloomtrain", "train", "--config", str(cfg),
         "train.train_iters=100000", "train.log_interval=1", "optim.decay_samples=10000000",
         f"checkpoint.dir={tmp_path / 'ck'}", *overrides],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(proc, n):
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step") and int(line.split()[1]) >= n:
            return seen
    raise AssertionError("training ended early:\n" + "".join(seen))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_preemption_signal_saves_and_exits_cleanly(dataset, tmp_path, sig):
    proc = _start_training(tmp_path, dataset)
    _wait_for_steps(proc, 3)
    proc.send_signal(sig)
    out = read_rest(proc, 120)
    assert proc.wait(timeout=120) == 0, out
    assert "stopping at step" in out and "signal" in out
    (step, path), = ckpt.list_checkpoints(tmp_path / "ck")
    assert step >= 3 and ckpt.verify(path)


def test_ctrl_c_saves_the_step_it_was_in_and_exits_130(dataset, tmp_path):
    """Ctrl-C (SIGINT) on a plain `bloomtrain train`: it says what it will do, finishes the step
    it is in, saves that step and exits 130, its last line naming the checkpoint.
    tests/test_launch.py does the same under --nproc 2, with resumes checked bit for bit."""
    proc = _start_training(tmp_path, dataset)
    seen = _wait_for_steps(proc, 3)
    proc.send_signal(signal.SIGINT)
    out = "".join(seen) + read_rest(proc, 120)
    assert proc.wait(timeout=120) == 130, out
    assert ("bloomtrain: SIGINT: stopping at the end of this step to save a checkpoint; Ctrl-C "
            "again quits at once without saving") in out
    step = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step")][-1]
    assert f"[train] stopping at step {step}: SIGINT; saving" in out, out
    path = tmp_path / "ck" / ckpt.step_dir_name(step)
    assert ckpt.list_checkpoints(tmp_path / "ck") == [(step, path)] and ckpt.verify(path)
    assert ckpt.read_manifest(path)["train_state"]["step"] == step
    assert out.strip().splitlines()[-1] == (f"bloomtrain: SIGINT: stopped at the end of step "
                                            f"{step} and saved {path}; exit code 130")


def test_a_second_ctrl_c_quits_at_once_without_a_partial_checkpoint(dataset, tmp_path):
    """The second Ctrl-C lands in the stop's save (rank 0 sleeps 600 s in it, once its files
    are written): the process ends at once, and the checkpoint of step 2 is still the newest."""
    proc = _start_training(tmp_path, dataset, "checkpoint.save_interval=2",
                           env=faults.env(sleep="0:3:5", save_sleep="0:3:600"))
    try:
        seen = []
        for wait_for in (f"{faults.SLEEP_ENV}: rank 0 sleeps", f"{faults.SAVE_SLEEP_ENV}: rank 0 "
                                                                 f"sleeps"):
            for line in proc.stdout:
                seen.append(line)
                if wait_for in line:
                    break
            # In step 3, where rank 0 sleeps: it stops there. Then in the save of step 3.
            proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)  # not 600 s later
        out = "".join(seen) + rest
        assert proc.returncode == 130, out
    finally:
        proc.kill()
    ck = tmp_path / "ck"
    two = ck / ckpt.step_dir_name(2)
    assert "[train] stopping at step 3: SIGINT; saving" in out, out
    assert out.strip().splitlines()[-1] == (f"bloomtrain: SIGINT again: quit at once without "
                                            f"saving; the newest checkpoint is {two}; exit "
                                            f"code 130")
    assert (ck / ".step_00000003.tmp").is_dir()  # cut short, and taken up by nothing
    assert [p for _, p in ckpt.list_checkpoints(ck)] == [two]
    assert ckpt.find_latest_valid(ck) == ckpt.resolve(ck) == two


def test_kill_switch_saves_and_exits(dataset, tmp_path):
    switch = tmp_path / "STOP"
    proc = _start_training(tmp_path, dataset, f"train.kill_switch_path={switch}")
    _wait_for_steps(proc, 2)
    switch.touch()
    out = read_rest(proc, 120)
    assert proc.wait(timeout=120) == 0, out
    assert "kill switch" in out
    (step, path), = ckpt.list_checkpoints(tmp_path / "ck")
    assert step >= 2 and ckpt.verify(path)
    # The switch left in place: a restart (a requeued job) neither trains nor saves. It
    # trained a step, saved and pruned an older checkpoint at every start.
    lines = []
    res = train(make_cfg(dataset, tmp_path / "again", train__train_iters=100000,  # requeued
                         train__kill_switch_path=str(switch), optim__decay_samples=10000000,
                         checkpoint={"dir": str(tmp_path / "ck"), "save_interval": 1,
                                     "keep_last": 1}),
                log=lambda *a: lines.append(" ".join(map(str, a))))
    assert res.exit_reason == "kill switch" and res.state.step == step
    assert "not training and not saving" in "\n".join(lines)
    assert ckpt.list_checkpoints(tmp_path / "ck") == [(step, path)]
    # Its report says so (a fresh run's closing line read "finished", its status "stalled?").
    from bloomtrain.report.closing import closing_lines
    assert closing_lines(tmp_path / "again" / "run", tmp_path / "ck")[0].startswith(
        f"[train] stopped (kill switch) at step {step}")


def test_resave_killed_between_renames_keeps_the_step(tmp_path, monkeypatch):
    from bloomtrain.model.presets import BloomShape
    shape = BloomShape(num_layers=1, hidden_size=8, num_heads=2, vocab_size=16,
                       ffn_hidden_size=32)
    state = {"transformer.ln_f.weight": torch.ones(8)}
    ckpt.save_checkpoint(tmp_path, 5, state, shape, keep_last=1)
    real = os.replace

    def replace(a, b):
        real(a, b)
        if str(a).endswith("step_00000005") and str(b).endswith(".old"):
            raise KeyboardInterrupt  # stands in for SIGKILL between the two renames
    monkeypatch.setattr(ckpt.writer.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 5, state, shape, keep_last=1)
    monkeypatch.setattr(ckpt.writer.os, "replace", real)
    found = ckpt.find_latest_valid(tmp_path)
    assert found is not None and found.name == ".step_00000005.old"
    assert torch.equal(ckpt.CheckpointReader(found).load("transformer.ln_f.weight"), state[
        "transformer.ln_f.weight"])
    # The next save of that step cleans up.
    ckpt.save_checkpoint(tmp_path, 5, state, shape, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_saves_copy_the_live_state_only_where_they_must(tmp_path, monkeypatch, offload):
    """The engine's fragments are views of its live masters and moments (a copy would be as
    large as the states: 12 bytes per parameter, on the host under offload). An async save
    snapshots them before it returns, so a step taken while it writes does not reach the
    checkpoint; a host without room for that snapshot (simulated: BLOOMTRAIN_HOST_MEMORY) gets
    a synchronous save, said in one line, with the same contents."""
    from bloomtrain.checkpoint.writer import CheckpointWriter
    from bloomtrain.planner.host import HOST_MEMORY_ENV
    from tests import helpers

    cfg = helpers.config(parallel={"zero_stage": 1, "offload_optimizer": offload}, seed=3)
    parts = helpers.build(cfg, device="cpu")
    bufs = parts.engine.bufs
    frags = parts.engine.fragments()
    live = [bufs.master, bufs.exp_avg, bufs.exp_avg_sq]
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in live]
    for f in frags:
        for t in f.tensors.values():  # inside one of the state buffers: no copy was made
            assert any(lo <= t.data_ptr() < hi for lo, hi in spans), f.name
    want = {(f.name, k): t.clone() for f in frags for k, t in f.tensors.items()}
    total = sum(t.numel() * t.element_size() for t in want.values())
    before = [b.clone() for b in live]

    def saved(path):
        reader = ckpt.CheckpointReader(path, kinds=("model", "exp_avg", "exp_avg_sq"))
        out = {}
        for f in frags:
            for k in f.tensors:
                out[(f.name, k)] = reader.load(f.name, k).reshape(-1)[f.offset:f.offset + f.numel]
        return out

    for host, synchronous in ((f"{4 * total}", False), (f"{total // 2}", True)):
        logs = []
        monkeypatch.setenv(HOST_MEMORY_ENV, host)
        writer = CheckpointWriter(tmp_path / host, async_save=True, log=logs.append,
                                  single_process=True)
        path = writer.save(7, frags, parts.shape, {"note": "test"})
        assert (writer._thread is None) == synchronous
        for b in live:  # the next step, while the save may still be writing
            b.add_(1.0)
        writer.wait()
        said = [m for m in logs if "snapshot" in m]
        if synchronous:
            assert len(said) == 1 and "saves this step synchronously" in said[0], logs
            assert f"({HOST_MEMORY_ENV})" in said[0]
        else:
            assert said == [], logs
        got = saved(path)
        bad = [(key, (got[key] - want[key]).abs().max().item()) for key in want
               if not torch.equal(got[key], want[key])]
        assert not bad, (synchronous, bad[:5])
        for b, o in zip(live, before):
            b.copy_(o)


def test_the_reader_allocates_only_what_it_returns(tmp_path, monkeypatch):
    """Reading a parameter allocates the tensor returned and little else (at BLOOM-176B's
    embedding, 14.4 GB in fp32 per rank, with the 8 ranks of a node reading at once): a full
    tensor from an unsplit checkpoint in one allocation, a tp chunk along dim 0 from it (every
    import's checkpoint, resumed under tensor parallelism) without the rest, a tp-split one with
    at most one chunk-sized buffer more. Checked against the saved tensor by plain slicing."""
    from bloomtrain.checkpoint.fragments import Fragment
    from bloomtrain.checkpoint.writer import CheckpointWriter
    from bloomtrain.model.presets import BloomShape

    shape = BloomShape(num_layers=1, hidden_size=24, num_heads=2, vocab_size=64,
                       ffn_hidden_size=96)
    name = "transformer.word_embeddings.weight"
    full = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)
    # Unsplit, in three uneven fragments (as ZeRO's dp ranks write them).
    cuts = [0, 500, 1100, full.numel()]
    unsplit = [Fragment(name, (64, 24), None, 0, 1, a, b - a,
                        {"model": full.reshape(-1)[a:b].clone()}) for a, b in zip(cuts, cuts[1:])]
    # Split over tp 2 along dim 1, each chunk in two fragments.
    split = []
    for r, chunk in enumerate(full.chunk(2, 1)):
        flat = chunk.contiguous().reshape(-1)
        split += [Fragment(name, (64, 24), 1, r, 2, a, b - a, {"model": flat[a:b].clone()})
                  for a, b in ((0, 300), (300, flat.numel()))]
    paths = {}
    for label, frags in (("unsplit", unsplit), ("split", split)):
        writer = CheckpointWriter(tmp_path / label, single_process=True)
        paths[label] = writer.save(1, frags, shape, {})

    live = {"now": 0, "peak": 0}  # bytes of the reader's torch.empty tensors still alive
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        n = t.numel() * t.element_size()
        live["now"] += n
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, lambda: live.__setitem__("now", live["now"] - n))
        return t

    def read(label, call):
        reader = ckpt.CheckpointReader(paths[label])
        live.update(now=0, peak=0)
        monkeypatch.setattr(torch, "empty", counting_empty)
        try:
            out = call(reader)
        finally:
            monkeypatch.setattr(torch, "empty", real_empty)
        return out, live["peak"]

    nbytes = full.numel() * 4
    out, used = read("unsplit", lambda r: r.load(name))
    assert torch.equal(out, full) and used == nbytes
    for rank in range(4):
        out, used = read("unsplit", lambda r: r.load_tp_shard(name, "model", rank, 4, 0))
        assert torch.equal(out, full.chunk(4, 0)[rank]) and used == nbytes // 4
    out, _ = read("unsplit", lambda r: r.load_tp_shard(name, "model", 1, 4, 1))
    assert torch.equal(out, full.chunk(4, 1)[1])
    out, used = read("split", lambda r: r.load(name))
    assert torch.equal(out, full) and used <= nbytes * 3 // 2
    for rank in range(2):
        out, used = read("split", lambda r: r.load_tp_shard(name, "model", rank, 2, 1))
        assert torch.equal(out, full.chunk(2, 1)[rank]) and used == nbytes // 2


def test_a_snapshot_counts_what_it_pins():
    """An async save's copy from the GPU goes into page-locked buffers, which torch's allocator
    rounds up to a power of two (28% more over BLOOM-176B's fragments); the host check counts
    that, and nothing for buffers the previous save left that it reuses."""
    from bloomtrain.checkpoint.fragments import Fragment
    from bloomtrain.checkpoint.writer import snapshot_bytes

    class OnTheGpu:  # what snapshot_bytes reads of a CUDA tensor
        is_cuda, shape, dtype = True, (3000,), torch.float32

        def numel(self):
            return 3000

        def element_size(self):
            return 4

    def frag(t):
        return Fragment("w", (3000,), None, 0, 1, 0, 3000, {"model": t})

    assert snapshot_bytes([frag(torch.zeros(3000))], {}) == 12000
    assert snapshot_bytes([frag(OnTheGpu())], {}) == 16384
    kept = {(0, "w", "model"): torch.zeros(3000)}
    assert snapshot_bytes([frag(OnTheGpu())], kept) == 0


def test_a_sharded_load_puts_each_shard_on_the_device_as_it_reads_it(tmp_path, monkeypatch):
    """load_sharded(device=...) (serving and eval under a topology) moves each parameter's shard
    to the device as soon as it is read, so the host never holds the rank's whole share (the
    meta device stands in for a GPU here): the reader's buffers alive at once stay within the
    largest parameter."""
    from bloomtrain.checkpoint.load import load_sharded
    from bloomtrain.model.bloom import BloomForCausalLM
    from bloomtrain.model.presets import BloomShape
    from bloomtrain.topology import Topology

    shape = BloomShape(num_layers=2, hidden_size=32, num_heads=4, vocab_size=96,
                       ffn_hidden_size=128)
    torch.manual_seed(0)
    state = {k: v for k, v in BloomForCausalLM(shape).state_dict().items()
             if k != "lm_head.weight"}
    path = ckpt.save_checkpoint(tmp_path, 1, state, shape)
    live = {"now": 0, "peak": 0}
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.device.type == "cpu":
            n = t.numel() * t.element_size()
            live["now"] += n
            live["peak"] = max(live["peak"], live["now"])
            weakref.finalize(t, lambda: live.__setitem__("now", live["now"] - n))
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    loaded = load_sharded(path, Topology.single(), device="meta")
    monkeypatch.setattr(torch, "empty", real_empty)
    params = list(loaded.chunks[0].parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert loaded.chunks[0].transformer.alibi_slopes.device.type == "meta"
    largest = max(t.numel() * t.element_size() for t in state.values())
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert live["peak"] <= largest < total // 4, (live, largest, total)


def _extend_worker(rank, world, dataset, tmp, iters, eval_interval):
    """tp 2 with dropout, saving only at its end: `iters` steps (resumed from the run dir's
    checkpoint if there is one). Its losses."""
    cfg = layout_cfg(dataset, tmp, (2, 1, 1, 0), train__train_iters=iters,
                     train__eval_interval=eval_interval, train__eval_iters=1,
                     model={"preset": "tiny", "vocab_size": 256, "hidden_dropout": 0.1,
                            "attention_dropout": 0.1},
                     checkpoint={"dir": str(Path(tmp) / "ck"), "async_save": False})
    return Trainer(cfg, **QUIET).run().losses


def test_a_run_extended_from_its_final_save_continues_bitwise(dataset, tmp_path):
    """The end-of-run save came after the final evaluation, whose tensor-parallel forwards draw
    from the default generator (the attention-dropout fork, even in eval mode): the saved
    generator was one evaluation ahead, and a run extended from it (raise train_iters, as
    "nothing to train" says) drew other dropout masks from step 4 on. Evaluations now leave
    the generators as they were, so neither the save nor the training's masks depend on them:
    a run evaluating every 2 steps trains as one evaluating only at its end."""
    whole = run_ranks(2, _extend_worker, dataset, str(tmp_path / "whole"), 6, None)[0]
    evals = run_ranks(2, _extend_worker, dataset, str(tmp_path / "evals"), 6, 2)[0]
    first = run_ranks(2, _extend_worker, dataset, str(tmp_path / "split"), 3, None)[0]
    rest = run_ranks(2, _extend_worker, dataset, str(tmp_path / "split"), 6, None)[0]
    assert len(whole) == 6 and len(first) == 3 and len(rest) == 3
    assert first + rest == whole
    assert evals == whole


def test_a_manifest_altered_after_its_save_is_skipped_and_keep_last_counts_good_ones(
        dataset, tmp_path):
    """The data files' sha256 are in the manifest, but nothing covered the manifest: one bit
    (step_count 4 -> 5) resumed silently with another optimizer state and other losses. And
    keep_last counted a checkpoint resume=auto had skipped as corrupt, so the save after the
    resume deleted a good one and kept the bad one."""
    import hashlib
    root = tmp_path / "ck"
    train(make_cfg(dataset, tmp_path, train__train_iters=6,
                   checkpoint={"dir": str(root), "save_interval": 2, "keep_last": 5}), **QUIET)
    step6 = root / ckpt.step_dir_name(6)
    # The digest is sha256sum's line for manifest.json, so `sha256sum -c` checks it too.
    want = hashlib.sha256((step6 / "manifest.json").read_bytes()).hexdigest()
    assert (step6 / "manifest.sha256").read_text() == f"{want}  manifest.json\n"
    text = (step6 / "manifest.json").read_text()
    assert '"step_count": 6' in text
    (step6 / "manifest.json").write_text(text.replace('"step_count": 6', '"step_count": 7'))
    lines = []
    resumed = train(make_cfg(dataset, tmp_path / "r", train__train_iters=8,
                             checkpoint={"dir": str(root), "save_interval": 3, "keep_last": 2}),
                    log=lambda *a: lines.append(" ".join(map(str, a))))
    assert "skipping step_00000006" in "\n".join(lines) and "fails its checksum" in \
        "\n".join(lines)
    assert resumed.state.step == 8
    # Resumed from step 4, saved 6 (over the bad one) and 8: keep_last 2 keeps those two.
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [6, 8]
    for _, p in ckpt.list_checkpoints(root):
        ckpt.verify(p)
    # Named by path, the altered manifest is refused.
    (root / ckpt.step_dir_name(8) / "manifest.json").write_text(
        (root / ckpt.step_dir_name(8) / "manifest.json").read_text().replace(
            '"step_count": 8', '"step_count": 9'))
    with pytest.raises(ckpt.CheckpointError, match="manifest.json fails its checksum"):
        ckpt.verify(root / ckpt.step_dir_name(8))


def test_keep_last_leaves_a_checkpoint_resume_skipped_out_of_its_count(dataset, tmp_path):
    # Saves at 2, 4, 6; 6 corrupt; the resumed run saves at 8 only (another interval), with
    # keep_last 2: it kept 6 (bad) and 8, deleting 4, the one it had resumed from.
    root = tmp_path / "ck"
    train(make_cfg(dataset, tmp_path, train__train_iters=6,
                   checkpoint={"dir": str(root), "save_interval": 2, "keep_last": 5}), **QUIET)
    model6 = root / ckpt.step_dir_name(6) / "model-00000.safetensors"
    data = bytearray(model6.read_bytes())
    data[len(data) // 2] ^= 0x01
    model6.write_bytes(bytes(data))
    train(make_cfg(dataset, tmp_path / "r", train__train_iters=8,
                   checkpoint={"dir": str(root), "save_interval": 8, "keep_last": 2}), **QUIET)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 6, 8]
    ckpt.verify(root / ckpt.step_dir_name(4))
    ckpt.verify(root / ckpt.step_dir_name(8))


def test_a_save_over_the_file_size_limit_says_so_not_free_disk_space(tmp_path, monkeypatch):
    import errno
    from bloomtrain.checkpoint import writer
    from bloomtrain.model import BloomShape, build_model
    shape = BloomShape(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=32)
    state = build_model(shape, seed=0).state_dict()
    ckpt.save_checkpoint(tmp_path / "ck", 1, state, shape)

    def too_large(*a, **k):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(writer, "_write_shard", too_large)
    with pytest.raises(writer.CheckpointSaveError) as e:
        ckpt.save_checkpoint(tmp_path / "ck", 2, state, shape)
    said = str(e.value)
    assert "File too large" in said and "file-size limit" in said and "ulimit -f" in said
    assert "Free disk space" not in said
    assert "the latest checkpoint is still" in said and "step_00000001" in said
