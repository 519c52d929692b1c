"""Single-process training loop: skipped steps, gradient accumulation, data parallelism, exit
controls. Resume after a crash is in test_resume.py, parity with a plain reference loop in
test_train_reference.py."""

import numpy as np
import pytest
import torch

from bloomtrain.train import Trainer, train
from tests.dist import run_ranks
from tests.helpers import make_cfg, metrics


def test_fp32_and_bf16_agree(dataset, tmp_path):
    # bf16 rounds activations to 8 mantissa bits; over 6 steps of the tiny model the loss curves
    # stay within 2% of each other (measured max relative gap ~0.3%).
    l32 = train(make_cfg(dataset, tmp_path / "32"), log=lambda *a: None).losses
    l16 = train(make_cfg(dataset, tmp_path / "16", train__precision="bf16"),
                log=lambda *a: None).losses
    assert len(l32) == len(l16) == 6
    for a, b in zip(l32, l16):
        assert abs(a - b) / a < 0.02
    assert l32[-1] < l32[0]


def test_fp16_overflow_skipped_and_logged(dataset, tmp_path):
    # A loss scale of 2^40 overflows fp16 gradients: the step must be skipped, logged and counted,
    # and the scale must back off (hysteresis 2: the second overflow halves it).
    cfg = make_cfg(dataset, tmp_path, train__precision="fp16", train__train_iters=3,
                   optim__initial_loss_scale=2.0 ** 40)
    lines = []
    trainer = Trainer(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    before = {k: v.clone() for k, v in trainer.engine.master_state().items()}
    trainer.run()
    warnings = [l for l in lines if "step skipped" in l]
    assert warnings and "WARNING step 1" in warnings[0]
    recs = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert recs[0]["skipped"] is True and recs[0]["skipped_steps"] == 1
    assert recs[1]["loss_scale"] == 2.0 ** 39
    assert trainer.state.skipped_steps == 3
    # Nothing was applied.
    for k, v in trainer.engine.master_state().items():
        assert torch.equal(v, before[k])


def test_nonfinite_gradient_skips_step(dataset, tmp_path):
    cfg = make_cfg(dataset, tmp_path, train__precision="bf16", train__train_iters=4)
    lines = []
    trainer = Trainer(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    emb = trainer.parts.chunks[0].transformer.word_embeddings.weight
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        # The second step has two micro-batches; poison its first.
        return grad * float("nan") if calls["n"] == 3 else grad
    emb.register_hook(poison)
    res = trainer.run()
    assert any("WARNING step 2" in l and "skipped" in l for l in lines)
    recs = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["skipped_steps"] for r in recs] == [0, 1, 1, 1]
    assert recs[1].get("skipped") is True
    # The step not applied shows its own loss (a record's `loss` is its applied steps' mean).
    assert recs[1]["step_loss"] == res.losses[1] and "step_loss" not in recs[0]
    assert trainer.state.skipped_steps == 1 and trainer.optimizer.step_count == 3


def test_the_steps_after_the_last_logged_one_get_a_record(dataset, tmp_path):
    # 5 steps at log_interval 2: records at 2 and 4, then one for step 5 alone at the end, so
    # the run's last loss is in metrics.jsonl. A stop (here the kill switch, present from
    # step 3 on) records its partial interval too.
    cfg = make_cfg(dataset, tmp_path / "end", train__train_iters=5, train__log_interval=2)
    res = Trainer(cfg, log=lambda *a: None).run()
    recs = [r for r in metrics(tmp_path / "end" / "run") if "loss" in r]
    assert [r["step"] for r in recs] == [2, 4, 5]
    assert recs[-1]["loss"] == res.losses[4]
    switch = tmp_path / "kill"
    cfg = make_cfg(dataset, tmp_path / "stop", train__train_iters=8, train__log_interval=2,
                   train__kill_switch_path=str(switch))
    trainer = Trainer(cfg, log=lambda *a: None)
    real_step = trainer._step

    def step(*args):
        real_step(*args)
        if trainer.state.step == 3:
            switch.touch()
    trainer._step = step
    res = trainer.run()
    recs = [r for r in metrics(tmp_path / "stop" / "run") if "loss" in r]
    assert res.exit_reason and [r["step"] for r in recs] == [2, 3]
    assert recs[-1]["loss"] == res.losses[2]


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_start_the_kill_switch_stops_rewrites_nothing_of_the_run(dataset, tmp_path,
                                                                   checkpoints):
    # A diverging job killed in its 5th step, the kill switch set so the requeued job does not
    # train: that start dropped the records after the checkpoint (step 3), or all of them
    # without one, and rewrote config.yaml. They are the records the job was stopped to read.
    ck = {"dir": str(tmp_path / "ck"), "save_interval": 3} if checkpoints else {}
    cfg = make_cfg(dataset, tmp_path, train__train_iters=4, train__log_interval=1,
                   checkpoint=ck)
    Trainer(cfg, log=lambda *a: None).run()
    if checkpoints:  # the kill came before step 4's save
        import shutil
        from bloomtrain import checkpoint as ckpt
        shutil.rmtree(tmp_path / "ck" / ckpt.step_dir_name(4))
    run = tmp_path / "run"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "consumed_samples": 4')  # the record the kill cut short
    before = (run / "metrics.jsonl").read_text()
    (run / "config.yaml").write_text("# the stopped job's config\n")
    switch = tmp_path / "KILL"
    switch.touch()
    again = make_cfg(dataset, tmp_path, train__train_iters=8, train__log_interval=1,
                     train__kill_switch_path=str(switch), checkpoint=ck)
    res = Trainer(again, log=lambda *a: None).run()
    assert res.exit_reason == "kill switch"
    after = (run / "metrics.jsonl").read_text()
    kept = before[:before.rindex("\n") + 1]
    assert after.startswith(kept)
    recs = metrics(run)
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert recs[-1]["stopped"] == "kill switch" and recs[-1]["step"] == (3 if checkpoints else 0)
    assert len(recs) == len(kept.splitlines()) + 1
    assert (run / "config.yaml").read_text() == "# the stopped job's config\n"


def _dropout_masks_worker(rank, world, dataset, tmp):
    """Every hidden-dropout mask this rank's blocks draw in one training step, by block."""
    import torch.nn.functional as F
    cfg = make_cfg(dataset, __import__("pathlib").Path(tmp), train__micro_batch_size=1,
                   parallel={"pp": 2, "pp_partition": "uniform"}, model__hidden_dropout=0.1)
    trainer = Trainer(cfg, log=lambda *a: None)
    masks, block = {}, [None]
    for chunk in trainer.parts.chunks:
        for index, layer in chunk.transformer.h.items():
            layer.register_forward_pre_hook(lambda m, a, i=int(index): block.__setitem__(0, i))
    dropout = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        masks.setdefault(block[0], []).append(out == 0)
        return out
    F.dropout = recording
    try:
        trainer.train_step(trainer.data.next_batch())
    finally:
        F.dropout = dropout
        trainer.watchdog.stop()
        trainer.data.stream.close()
    return masks


def test_pipeline_stages_draw_their_own_dropout_masks(dataset, tmp_path):
    # pp=2, two blocks per stage, 8 micro-batches. In one process blocks 0 and 2 draw different
    # masks; so must they on two stages (Megatron seeds stage p with seed + 100 p). With one
    # seed on every stage, block 2 repeated block 0's masks exactly, every micro-batch.
    stage0, stage1 = run_ranks(2, _dropout_masks_worker, dataset, str(tmp_path))
    assert sorted(stage0) == [0, 1] and sorted(stage1) == [2, 3]
    for a, b in ((0, 2), (1, 3)):
        pairs = list(zip(stage0[a], stage1[b]))
        assert len(pairs) == 16  # 8 micro-batches x (after attention, after the MLP)
        assert not any(torch.equal(x, y) for x, y in pairs), (a, b)
        # Each drops about 10%, independently: about 1% of elements dropped by both.
        both = sum(int((x & y).sum()) for x, y in pairs) / sum(x.numel() for x, _ in pairs)
        assert 0.005 < both < 0.02, both


def test_gradient_accumulation_parity(dataset, tmp_path):
    # micro-batch 1 x 8 accumulation steps == micro-batch 8 x 1 step (fp32: same math, different
    # summation order, so 1e-5).
    a = Trainer(make_cfg(dataset, tmp_path / "a", train__micro_batch_size=1), log=lambda *a: None)
    b = Trainer(make_cfg(dataset, tmp_path / "b", train__micro_batch_size=8), log=lambda *a: None)
    ra, rb = a.run(), b.run()
    np.testing.assert_allclose(ra.losses, rb.losses, rtol=1e-5)
    for k, v in a.engine.master_state().items():
        torch.testing.assert_close(v, b.engine.master_state()[k], rtol=1e-4, atol=1e-6)


def _dp_worker(rank, world, dataset, tmp):
    cfg = make_cfg(dataset, __import__("pathlib").Path(tmp), train__micro_batch_size=2)
    trainer = Trainer(cfg, log=lambda *a: None)
    res = trainer.run()
    return res.losses, {k: v.clone() for k, v in trainer.engine.master_state().items()}


def test_data_parallel_matches_single_process(dataset, tmp_path):
    # Two data-parallel ranks each take half of every global batch; their fp32 gradients are
    # averaged, so the run must equal one process taking the whole batch (summation order only).
    single = Trainer(make_cfg(dataset, tmp_path / "s", train__micro_batch_size=2),
                     log=lambda *a: None)
    ref = single.run()
    outs = run_ranks(2, _dp_worker, dataset, str(tmp_path / "dp"))
    for losses, master in outs:
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
        for k, v in master.items():
            torch.testing.assert_close(v, single.engine.master_state()[k], rtol=1e-4, atol=1e-6)


def test_slurm_environment_mapping():
    from bloomtrain.train import env_from_slurm
    from bloomtrain.errors import UserError
    step = {"SLURM_STEP_ID": "0"}  # a task srun started
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500", **step}
    env_from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "16", "1")
    assert "LOCAL_WORLD_SIZE" not in env  # nothing says how many tasks a node has
    # Tasks per node as torchrun's LOCAL_WORLD_SIZE (hpZ's node-local group, the node's host
    # memory): without it the whole job counted as one node.
    for per_node in ({"SLURM_NTASKS_PER_NODE": "8"}, {"SLURM_TASKS_PER_NODE": "8(x2)"}):
        env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
               "MASTER_ADDR": "node1", "MASTER_PORT": "29500", **per_node, **step}
        env_from_slurm(env)
        assert env["LOCAL_WORLD_SIZE"] == "8"
    # --ntasks-per-node is only a maximum with --ntasks (sbatch(1)): a job of 6 tasks at most 4
    # a node runs 4 and 2, which SLURM_(STEP_)TASKS_PER_NODE says; the node of 2 counted 4.
    for spread in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
               "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4", spread: "4,2",
               "MASTER_ADDR": "node1", "MASTER_PORT": "29500", **step}
        env_from_slurm(env)
        assert env["LOCAL_WORLD_SIZE"] == "2"
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", **step}
    env_from_slurm(torchrun)  # torchrun's variables win
    assert torchrun["RANK"] == "3"
    with pytest.raises(UserError, match="MASTER_ADDR"):
        env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **step})
    # The batch script sbatch runs has SLURM_PROCID and SLURM_NTASKS but no step id: a plain
    # `bloomtrain train` there is one process, not rank 0 of 4 that never start (it refused
    # for lack of MASTER_ADDR, or waited for them until the timeout).
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
             "SLURM_TASKS_PER_NODE": "4"}
    env_from_slurm(batch)
    assert "RANK" not in batch and "WORLD_SIZE" not in batch


def test_exit_duration_saves_and_stops(dataset, tmp_path):
    cfg = make_cfg(dataset, tmp_path, train__train_iters=50, train__exit_duration_minutes=1e-9,
                   checkpoint={"dir": str(tmp_path / "ck")})
    res = train(cfg, log=lambda *a: None)
    assert res.exit_reason == "exit_duration_minutes" and res.state.step == 1
    from bloomtrain import checkpoint
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "ck")] == [1]


def test_a_stop_at_the_last_step_ends_the_run_with_its_evaluation(dataset, tmp_path):
    """A stop (here the time limit) that lands on the last step saved and returned before the
    end-of-run evaluation, and a resume then said "nothing to train": the run never got its
    final eval record. Saved first, it now ends as a finished run does."""
    import json

    cfg = make_cfg(dataset, tmp_path, train__train_iters=1, train__exit_duration_minutes=1e-9,
                   train__eval_iters=1, checkpoint={"dir": str(tmp_path / "ck")})
    lines = []
    res = train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert res.exit_reason == "finished" and res.state.step == 1 and res.eval_loss is not None
    assert any(line.startswith("[train] stopping at step 1: exit_duration_minutes; saving")
               for line in lines)
    records = [json.loads(x) for x in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [1]
    assert not any("stopped" in r for r in records)
    from bloomtrain import checkpoint
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "ck")] == [1]


def test_exit_duration_counts_from_the_jobs_start(dataset, tmp_path, monkeypatch):
    """As a scheduler's time limit does: a job its launcher started two minutes ago (a worker
    restarted since, or one that spent them loading) stops after its first step at a limit
    of one minute. It counted from the first step, so loading and restarts were free."""
    import time

    from bloomtrain.launch import JOB_START_ENV

    monkeypatch.setenv(JOB_START_ENV, repr(time.time() - 120))
    lines = []
    res = train(make_cfg(dataset, tmp_path, train__train_iters=50,
                         train__exit_duration_minutes=1.0),
                log=lambda *a: lines.append(" ".join(map(str, a))))
    assert res.exit_reason == "exit_duration_minutes" and res.state.step == 1
    # No checkpoint.dir: the stop does not claim to save.
    assert ("[train] stopping at step 1: exit_duration_minutes; nothing to save to (no "
            "checkpoint.dir)") in lines


def test_a_run_that_ends_inside_its_warmup_says_so(dataset, tmp_path):
    """optim.decay_samples unset: the decay spans the run, and a run shorter than its warmup
    never reaches optim.lr (a shortened demo: 2.4e-5 of 3e-4). Said at the start; it trains."""
    lines = []
    res = train(make_cfg(dataset, tmp_path, train__train_iters=2, optim__warmup_samples=64,
                         optim__decay_samples=None),
                log=lambda *a: lines.append(" ".join(map(str, a))))
    assert res.state.step == 2
    # Its steps read the rate at 0 and 8 samples (Megatron's order): 8/64 of optim.lr at most.
    # The figure was 16/64, a rate no step used.
    assert any("[train] WARNING the run's 16 samples end inside the warmup "
               "(optim.warmup_samples 64): the learning rate reaches only 0.000125, at its "
               "last step (optim.lr 0.001)" in line for line in lines), lines
    # Said as well with optim.decay_samples set, and for a warmup ending between the last
    # step's start and the run's end; not for one the last step starts at or after.
    from bloomtrain.config import OptimConfig
    from bloomtrain.train.loop import lr_schedule
    for warmup, decay, said in ((12, 100, "0.000667"), (16, None, "0.0005"), (8, None, None)):
        lines = []
        lr_schedule(OptimConfig(lr=1e-3, min_lr=0.0, warmup_samples=warmup, decay_samples=decay),
                    16, lines.append, last_start=8)
        assert (f"reaches only {said}, at its last step" in lines[0]) if said else not lines, lines


def test_an_eval_interval_without_a_validation_split_is_refused(dataset, tmp_path):
    """No evaluation would ever run: that was silent."""
    from bloomtrain.errors import UserError

    with pytest.raises(UserError, match="gives the validation split no documents"):
        train(make_cfg(dataset, tmp_path, data__split="100,0,0", train__eval_interval=2,
                       train__train_iters=2), log=lambda *a: None)


def test_a_split_without_what_the_run_needs_is_refused_before_the_launch(dataset, tmp_path,
                                                                          capsys):
    """The launcher says it, in one line, before any worker or directory exists: an empty
    validation split under eval_interval came from every worker (35 lines of tracebacks, lock
    files left); a training share of 0, or one that rounds to no documents, crashed on the
    first step with a TypeError."""
    from bloomtrain.cli import main
    from tests.helpers import write_config

    cfg = write_config(tmp_path, dataset, "run")
    for extra, said in (
            (["--nproc", "2", "data.split=100,0,0", "train.eval_interval=2"],
             "train.eval_interval is 2, but data.split '100,0,0' gives the validation split no "
             "documents"),
            (["data.split=0,1,0"], "data.split: split '0,1,0' gives training (the first part) "
                                   "no share"),
            (["data.split=1,10000,0"], f"data.split '1,10000,0' gives the training split of "
                                       f"{dataset} no documents")):
        assert main(["train", "--config", str(cfg), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert not (tmp_path / "run").exists()


def test_hpz_without_a_dp_peer_on_the_node_and_a_missing_resume_are_refused_before_anything(
        dataset, tmp_path, capsys, monkeypatch):
    """Both were found only after the run directory and checkpoint.dir were created and
    locked (hpZ after the process groups too, on every worker)."""
    from bloomtrain.cli import main
    from tests.helpers import write_config

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = write_config(tmp_path, dataset, "run")
    for extra, said in (
            (["parallel.zero_stage=3", "parallel.zero_secondary_shard=true"],
             "parallel.zero_secondary_shard needs at least 2 ranks of every dp group on each "
             "node, as many on every node: with 1 processes per node and tp=1, pp=1, dp=1, the "
             "dp groups have [1] ranks per node"),
            (["--nproc", "2", "parallel.tp=2", "parallel.zero_stage=3",
              "parallel.zero_secondary_shard=true"],
             "with 2 processes per node and tp=2, pp=1, dp=1, the dp groups have [1] ranks"),
            ([f"checkpoint.resume={tmp_path / 'nowhere'}"],
             f"checkpoint.resume {tmp_path / 'nowhere'} does not exist")):
        assert main(["train", "--config", str(cfg), f"checkpoint.dir={tmp_path / 'ck'}",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()
    # Two dp ranks on the node: accepted (the same rule, judged as the gatherer judges it).
    from bloomtrain.layout import ParallelLayout
    assert ParallelLayout(tp=1, pp=1, dp=2).secondary_shard_problem(2) is None
    assert "[1] ranks per node" in ParallelLayout(tp=1, pp=1, dp=2).secondary_shard_problem(1)


def test_a_finished_run_says_there_is_nothing_to_train(dataset, tmp_path):
    # Run again at its end (train_iters, then the same end as train_samples), it trains nothing,
    # says so, and leaves metrics.jsonl as the finished run wrote it (no second eval record).
    cfg = make_cfg(dataset, tmp_path, train__train_iters=2,
                   checkpoint={"dir": str(tmp_path / "ck")})
    train(cfg, log=lambda *a: None)
    written = metrics(cfg.run_dir)
    for over in ({"train__train_iters": 2},
                 {"train__train_iters": None, "train__train_samples": 16}):
        lines = []
        res = train(make_cfg(dataset, tmp_path, checkpoint={"dir": str(tmp_path / "ck")}, **over),
                    log=lambda *a: lines.append(" ".join(map(str, a))))
        assert "[train] already at step 2 of 2; nothing to train (raise train.train_iters or " \
               "train.train_samples to continue)" in lines
        assert res.losses == [] and res.exit_reason == "nothing to train"
        assert metrics(cfg.run_dir) == written


@pytest.mark.parametrize("parallel", [{"zero_stage": 1}, {"zero_stage": 3},
                                      {"pp_schedule": "gpipe", "zero_stage": 2}],
                         ids=["z1", "z3", "gpipe-z2"])
def test_one_process_takes_any_zero_stage_and_schedule(dataset, tmp_path, parallel):
    # One process, one dp rank: every ZeRO stage holds the same numbers as stage 0 and a
    # schedule of one stage is plain accumulation, so the runs match bit for bit; and both follow
    # the plain bf16 loop of tests/reference.py (the bound of test_train_reference.py).
    from tests.reference import reference_train
    ref_cfg = make_cfg(dataset, tmp_path / "ref", train__precision="bf16")
    ref = train(ref_cfg, log=lambda *a: None)
    got = train(make_cfg(dataset, tmp_path / "got", train__precision="bf16", parallel=parallel),
                log=lambda *a: None)
    assert got.losses == ref.losses
    np.testing.assert_allclose(got.losses, reference_train(ref_cfg).losses, rtol=1e-4)


def test_a_run_leaves_no_global_state_behind(dataset, tmp_path):
    import signal

    from bloomtrain.parallel import comm
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    enabled = comm.STATS.enabled
    records = train(make_cfg(dataset, tmp_path, train__train_iters=2,
                             parallel={"comm_stats": True}), log=lambda *a: None)
    assert {s: signal.getsignal(s) for s in before} == before
    assert comm.STATS.enabled == enabled
    assert len(records.losses) == 2


def test_training_without_compile_never_imports_dynamo(dataset, tmp_path):
    """torch._dynamo costs 1.5 s of every process's start (every worker, server and eval rank).
    Only train.compile needs it: building the model on the meta device (no nn.Embedding init
    there) and counting communication (CommStats.record, made untraced only when compiling) must
    not import it. A child process, since this one has imported it for other tests."""
    import subprocess
    import sys
    cfg = make_cfg(dataset, tmp_path, train__train_iters=2, parallel__zero_stage=1,
                   checkpoint__dir=str(tmp_path / "ck"), checkpoint__save_interval=1)
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    code = ("import sys\nfrom bloomtrain.train.loop import train\nfrom bloomtrain.config import "
            f"Config\ntrain(Config.load({str(tmp_path / 'c.yaml')!r}, []), log=lambda *a: None)\n"
            "print('dynamo imported:', 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "dynamo imported: False", out.stdout
    assert (tmp_path / "ck").is_dir()


def test_a_resume_onto_another_grid_gives_each_stage_its_own_dropout_stream():
    # Saved at pp=1 (rank 0's generator state), resumed at pp=2: both stages start from rank
    # 0's state, then each seeds its own from one draw of it. Same stage: the same stream (tp
    # ranks stay in step); other stage: another.
    from types import SimpleNamespace
    from bloomtrain.train.checkpointing import restore_rng, rng_state
    torch.manual_seed(7)
    manifest = {"topology": {"tp": 1, "pp": 1, "dp": 1}, "ranks": {"0": {"rng": rng_state()}}}
    here = {"tp": 2, "pp": 2, "dp": 1}

    def draws(rank, pp_rank):
        torch.manual_seed(rank + 1000)  # whatever the rank's generator held before
        restore_rng(manifest, here, SimpleNamespace(rank=rank, pp_rank=pp_rank))
        return torch.rand(64)
    first, first_tp1, second = draws(0, 0), draws(1, 0), draws(2, 1)
    assert torch.equal(first, first_tp1) and not torch.equal(first, second)
    # An unchanged grid takes each rank's own state as saved.
    manifest["topology"] = here
    torch.manual_seed(7)
    expected = torch.rand(64)
    assert torch.equal(draws(0, 0), expected)


def test_an_eval_perplexity_past_exps_range_is_inf_not_capped(tmp_path):
    import json
    import math
    from bloomtrain import jsonl
    from bloomtrain.train.metrics import MetricsLog
    log = MetricsLog(tmp_path, True, None, log=lambda *a: None)
    for step, loss in enumerate((2.0, 60.0, 800.0, math.inf, math.nan), 1):
        log.eval(step, 8 * step, loss)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    got = [jsonl.loads(line)["eval_ppl"] for line in lines]
    assert got[:2] == [math.exp(2.0), math.exp(60.0)]  # no cap at e^50
    assert got[2:4] == [math.inf, math.inf] and math.isnan(got[4])
    # Strict JSON, as the format promises (bare NaN and Infinity stop a strict parser at the
    # line): the non-finite values are strings that bloomtrain's readers turn back.
    def refuse(name):
        raise ValueError(f"bare {name}")
    strict = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["eval_ppl"] for r in strict[2:]] == ["Infinity", "Infinity", "NaN"]
    assert [r["eval_loss"] for r in strict[2:]] == [800.0, "Infinity", "NaN"]


def test_records_carry_mfu_against_the_devices_peak(dataset, tmp_path, monkeypatch):
    # The peak by the CUDA device's name (torchtitan's get_peak_flops does the same); a CPU,
    # an unknown GPU or an fp32 run have none, and their records no `mfu`.
    from types import SimpleNamespace
    from bloomtrain.planner.hardware import device_peak_tflops
    from bloomtrain.train.loop import peak_tflops
    cuda = SimpleNamespace(type="cuda")
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                       ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        assert device_peak_tflops(cuda) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H200")
    assert peak_tflops(cuda, SimpleNamespace(precision="bf16")) == 989.0
    assert peak_tflops(cuda, SimpleNamespace(precision="fp32")) is None
    assert device_peak_tflops(torch.device("cpu")) is None
    # A record's MFU is its TFLOP/s per device over the peak.
    from bloomtrain.train import loop
    monkeypatch.setattr(loop, "device_peak_tflops", lambda device: 1e-3)
    cfg = make_cfg(dataset, tmp_path, train__precision="bf16", train__train_iters=2)
    Trainer(cfg, log=lambda *a: None).run()
    recs = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert recs and all(r["mfu"] == r["tflops_per_device"] / 1e-3 for r in recs)
    # With full recompute the TFLOP/s is Megatron's hardware figure (f = 4: the forward twice),
    # and MFU counts the model's FLOPs only (f = 3), as the planner's does: it read 4/3 of it.
    cfg = make_cfg(dataset, tmp_path / "rc", train__precision="bf16", train__train_iters=2,
                   train__activation_checkpointing="full")
    Trainer(cfg, log=lambda *a: None).run()
    recs = [r for r in metrics(tmp_path / "rc" / "run") if "loss" in r]
    assert recs and all(r["mfu"] == pytest.approx(r["tflops_per_device"] * 3 / 4 / 1e-3,
                                                  rel=1e-12) for r in recs)


def _megatron_train_iters(train_samples: int, gbs: int, rampup=None) -> int:
    """Megatron-DeepSpeed's training.py update_train_iters, written out: the ramp's batches one
    by one while consumed <= ramp_samples (RampupBatchsizeNumMicroBatches.update's batch), then
    whole batches; a partial last batch is thrown away."""
    if rampup is None:
        return train_samples // gbs
    start, inc, ramp = rampup
    increments = (gbs - start) // inc
    iters = consumed = 0
    while consumed <= ramp:
        steps = int(consumed / (ramp / increments))
        consumed += min(start + steps * inc, gbs)
        iters += 1
    return iters + (train_samples - consumed) // gbs


def test_a_partial_last_batch_is_not_trained_and_valid_is_sized_as_megatrons(dataset, tmp_path,
                                                                              monkeypatch):
    """41 samples at a batch of 8 are Megatron's 5 steps (update_train_iters floors): a sixth
    step read samples 40-47, past what the datasets were built for (a UserError at its end
    when a split had no slack). The valid split is built for Megatron's count, a window of
    eval_iters batches per evaluation of its train_iters and one for the end; it was sized from
    ceil(samples / smallest batch) steps (2000 for Megatron's 1000 below)."""
    from bloomtrain.data import loader
    from bloomtrain.layout import BatchSchedule

    asked = []
    real = loader.build_train_valid_test_datasets

    def spy(data_cfg, tokenizer, counts, seq):
        asked.append(list(counts))
        return real(data_cfg, tokenizer, counts, seq)
    monkeypatch.setattr(loader, "build_train_valid_test_datasets", spy)
    cfg = make_cfg(dataset, tmp_path / "a", train__train_iters=None, train__train_samples=41,
                   train__eval_interval=2, train__eval_iters=1)
    res = train(cfg, log=lambda *a: None)
    assert res.exit_reason == "finished"
    assert res.state.step == _megatron_train_iters(41, 8) == 5
    assert res.state.consumed_samples == 40
    assert asked[-1][:2] == [41, (5 // 2 + 1) * 1 * 8]
    # The rule (BatchSchedule.steps_until) against Megatron's, constant and ramped, as the
    # trainer sizes the valid split from it (the review's case: 1050 samples, batch 100,
    # eval_interval 11, eval_iters 10 -> 1000 valid samples).
    for samples, gbs, ramp in ((1050, 100, None), (41, 8, None), (8, 8, None),
                               (10_000, 64, (16, 16, 3000)), (3337, 64, (16, 8, 1000)),
                               (220_000_000, 2048, (192, 16, 9_765_625))):
        batches = BatchSchedule(gbs, 1, None, ramp)
        assert batches.steps_until(samples) == _megatron_train_iters(samples, gbs, ramp)
    assert (_megatron_train_iters(1050, 100) // 11 + 1) * 10 * 100 == 1000
    # Fewer samples than one batch is no run: refused with the config.
    from bloomtrain.config import UserError
    with pytest.raises(UserError, match=r"train.train_samples \(5\) is less than the first "
                                        r"global batch \(8\)"):
        Trainer(make_cfg(dataset, tmp_path / "b", train__train_iters=None,
                         train__train_samples=5), log=lambda *a: None)


def test_each_evaluation_reads_the_next_window_of_the_valid_split(dataset, tmp_path,
                                                                   monkeypatch):
    """Megatron's evaluations read on through the valid split (one iterator; evaluate() adds
    eval_iters x the global batch to consumed_valid_samples), the one at the end of training
    included: the valid split is sized for exactly that. Every evaluation here read its first
    window. The window follows from the step, so a resumed run reads what the whole one did."""
    import bloomtrain.data.loader as loader

    starts, valid = [], {}
    real = loader.get_micro_batches

    def spy(ds, consumed, gbs, *a, **k):  # the train stream's reads may run on its thread
        if ds is valid.get("ds"):
            starts.append(consumed)
        return real(ds, consumed, gbs, *a, **k)
    monkeypatch.setattr(loader, "get_micro_batches", spy)
    cfg = make_cfg(dataset, tmp_path, train__train_iters=5, train__eval_interval=2,
                   train__eval_iters=2)
    trainer = Trainer(cfg, log=lambda *a: None)
    valid["ds"] = trainer.data.valid_ds
    trainer.run()
    # Megatron: evaluations at iterations 2 and 4, then the end of training, each reading
    # eval_iters = 2 batches of 8 from consumed_valid_samples, which starts at 0.
    consumed_valid, want = 0, []
    for _ in range(3):
        for _ in range(2):
            want.append(consumed_valid)
            consumed_valid += 8
    assert starts == want == [0, 8, 16, 24, 32, 40]
    assert len(trainer.data.valid_ds) >= (5 // 2 + 1) * 2 * 8
    evals = [r["step"] for r in metrics(tmp_path / "run") if "eval_loss" in r]
    assert evals == [2, 4, 5]


def test_skipped_steps_do_not_move_the_learning_rate(dataset, tmp_path):
    """Megatron steps its LR scheduler by the batch only when the update was applied
    (training.py train_step, and DeepSpeed's engine on an overflow): an fp16 run that overflows
    its first steps starts warm-up from 0 at its first applied update. bloomtrain followed
    consumed samples, so 7 overflowed steps of 8 put the first update at 5.5e-4, mid-decay. The
    position is saved (lr_samples) and a resumed run goes on from it."""
    from tests.reference import megatron_lr

    over = dict(train__precision="fp16", train__train_iters=10, train__log_interval=1,
                optim__initial_loss_scale=2.0 ** 27, optim__hysteresis=1,
                optim__warmup_samples=32, optim__decay_samples=80,
                optim__lr=1e-3, optim__min_lr=1e-4)
    cfg = make_cfg(dataset, tmp_path / "a", **over, checkpoint={"dir": str(tmp_path / "ck"),
                                                                "save_interval": 8})
    train(cfg, log=lambda *a: None)
    recs = [r for r in metrics(tmp_path / "a" / "run") if "loss" in r]
    skipped = [bool(r.get("skipped")) for r in recs]
    assert skipped[0] and not skipped[-1]
    applied, want = 0, []
    for s in skipped:
        want.append(megatron_lr(applied, 1e-3, 1e-4, 32, 80, "cosine"))
        applied += 0 if s else 8
    assert [r["lr"] for r in recs] == pytest.approx(want, rel=1e-12, abs=0)
    # Resumed from step 8's checkpoint: the same LRs for steps 9 and 10.
    from bloomtrain import checkpoint as ckpt
    step8 = tmp_path / "ck" / ckpt.step_dir_name(8)
    cfg = make_cfg(dataset, tmp_path / "b", **over, checkpoint={"dir": str(tmp_path / "ck2"),
                                                                "resume": str(step8)})
    state = ckpt.read_manifest(step8)["train_state"]
    assert state["lr_samples"] == 8 * (8 - sum(skipped[:8])) < state["consumed_samples"]
    train(cfg, log=lambda *a: None)
    again = [r for r in metrics(tmp_path / "b" / "run") if "loss" in r]
    assert [r["lr"] for r in again] == pytest.approx(want[8:], rel=1e-12, abs=0)


def _train_epochs(cfg, samples: int) -> int:
    """Epochs of the training split Megatron's index takes for `samples` samples (an independent
    count: the split's tokens over the sequence length, each sample's last token the next's
    first)."""
    from bloomtrain.data.gpt_dataset import split_documents
    from bloomtrain.data.indexed import MMapIndexedDataset
    sizes = MMapIndexedDataset(cfg.data.paths[0]).sizes
    bounds = split_documents(cfg.data.split, len(sizes))
    tokens = int(sizes[bounds[0]:bounds[1]].sum())
    return next(e for e in range(1, 1000) if (e * tokens - 1) // cfg.data.seq_length >= samples)


def test_a_resume_on_another_data_order_is_refused(dataset, tmp_path):
    """Raising train.train_iters (as "nothing to train" says to continue) can take another
    epoch of the data, and Megatron's index shuffles over all its epochs: the resumed run read
    its first samples in another order, training on some twice and never on others, and said
    nothing. Now the checkpoint records the order (the key of what the index is built from, a
    digest of its consumed samples' tokens) and a resume on another one is refused, naming the
    lengths and the epochs; data.override_order goes on. A longer run in the same epochs (one
    here, so no last epoch shuffled on its own) keeps the order and resumes."""
    from bloomtrain.data.loader import build_train_valid_test_datasets
    from bloomtrain.errors import UserError

    ck = {"dir": str(tmp_path / "ck")}
    base = dict(optim__decay_samples=4096, checkpoint=ck)
    short = make_cfg(dataset, tmp_path / "a", train__train_iters=2, **base)
    one_epoch = _train_epochs(short, 16)
    # The longest run in the first run's epochs, and one step past it.
    same = max(i for i in range(2, 400) if _train_epochs(short, 8 * i) == one_epoch)
    more = same + 1
    assert _train_epochs(short, 8 * more) > one_epoch
    train(short, log=lambda *a: None)

    def first_samples(iters):
        cfg = make_cfg(dataset, tmp_path / "x", train__train_iters=iters, **base)
        ds = build_train_valid_test_datasets(cfg.data, None, [8 * iters, 0, 0], 32)[0]
        return [ds[i].tolist() for i in range(16)]
    # The premise: another epoch reorders the samples the first run trained on.
    assert first_samples(more) != first_samples(2) == first_samples(same)

    with pytest.raises(UserError, match=(
            r"the training data's order differs from the one the checkpoint's run trained on: "
            r"its first 16 samples are not the same \(train samples 16 -> "
            rf"{8 * more:,}; epochs of each dataset 1 -> 2.*: Megatron's index, and so ours, is "
            r"built for the epochs a length takes.*\); resumed, the run would train on some samples "
            r"again and never on others. Keep the checkpoint's data settings and length "
            r"\(16 samples: train.train_samples=16, or the train.train_iters that gives it; "
            r".*\), or set data.override_order=true")):
        Trainer(make_cfg(dataset, tmp_path / "a", train__train_iters=more, **base),
                log=lambda *a: None)
    # Other data settings on the same length: the same refusal, without the lengths.
    with pytest.raises(UserError, match=r"its first 16 samples are not the same; resumed"):
        Trainer(make_cfg(dataset, tmp_path / "a", train__train_iters=2, data__seed=7, **base),
                log=lambda *a: None)
    # In the same epochs the order holds: the run resumes and goes on.
    res = train(make_cfg(dataset, tmp_path / "a", train__train_iters=3, **base),
                log=lambda *a: None)
    assert res.state.step == 3 and res.state.data_order["samples"] == 24
    res = train(make_cfg(dataset, tmp_path / "a", train__train_iters=more,
                         data__override_order=True, **base), log=lambda *a: None)
    assert res.state.step == more


def _small_dataset(path, docs: int) -> str:
    """`docs` documents of 20-40 random tokens and an end of document (id 2)."""
    from bloomtrain.data.indexed import write_dataset
    rng = np.random.RandomState(1)
    write_dataset(str(path), [[rng.randint(4, 256, size=rng.randint(20, 40)).tolist() + [2]]
                              for _ in range(docs)], dtype=np.uint16)
    return str(path)


def test_a_resume_on_another_order_of_a_blended_dataset_or_of_the_last_epoch_is_refused(
        dataset, tmp_path):
    """The first record hashed the tokens at five positions of the blend: with weights 0.8 and
    0.2 all five came from the large dataset, and a longer run that took another epoch of the
    small one, reordering its samples among those consumed, resumed silently. Now each
    dataset's index key is in the record. A shorter run over a blend (nothing to train) read
    its digest past the small dataset's end and raised IndexError; it now ends with "nothing
    to train". And on one dataset, a longer run in the same two epochs whose last epoch is no
    longer shuffled on its own (Megatron's rule: under 95% of an epoch) reorders too; the
    refusal names that, not another epoch."""
    from bloomtrain.data.gpt_dataset import SEPARATE_LAST_EPOCH_FRACTION
    from bloomtrain.data.loader import build_train_valid_test_datasets
    from bloomtrain.errors import UserError

    small = _small_dataset(tmp_path / "B_text_document", 12)
    base = dict(data__paths=[f"0.8 {dataset}", f"0.2 {small}"], optim__decay_samples=4096,
                checkpoint={"dir": str(tmp_path / "ck")})
    train(make_cfg(dataset, tmp_path / "a", train__train_iters=2, **base), log=lambda *a: None)

    def blend(iters):
        cfg = make_cfg(dataset, tmp_path / "x", train__train_iters=iters, **base)
        return build_train_valid_test_datasets(cfg.data, None, [8 * iters, 0, 0], 32)[0]
    # The premise: 7 steps reorder some of the 16 samples trained on, all of them the small
    # dataset's, at none of the five positions the tokens were hashed at.
    old, new = blend(2), blend(7)
    changed = [i for i in range(16) if not np.array_equal(old[i], new[i])]
    assert changed and {int(old.dataset_index[i]) for i in changed} == {1}
    assert not set(changed) & {0, 4, 8, 12, 15}
    with pytest.raises(UserError, match=r"its first 16 samples are not the same \(train samples "
                                        r"16 -> 56; epochs of each dataset 1, 1 -> 1, 2 \(the "
                                        r"last shuffled on its own\)"):
        Trainer(make_cfg(dataset, tmp_path / "a", train__train_iters=7, **base),
                log=lambda *a: None)
    train(make_cfg(dataset, tmp_path / "a", train__train_iters=7, data__override_order=True,
                   **base), log=lambda *a: None)
    lines = []
    res = train(make_cfg(dataset, tmp_path / "a", train__train_iters=2, **base),
                log=lambda *a: lines.append(" ".join(map(str, a))))
    assert res.state.step == 7 and any("already at step 7 of 2; nothing to train" in line
                                       for line in lines)

    # One dataset of 33 samples an epoch: 34 samples take two epochs, the last shuffled on its
    # own (1 sample of it, under 95% of 33), and so do 66, the last not on its own.
    one = _small_dataset(tmp_path / "C_text_document", 40)
    kw = dict(optim__decay_samples=4096, checkpoint={"dir": str(tmp_path / "ck1")},
              train__micro_batch_size=2, train__global_batch_size=2, train__eval_iters=1)
    assert _train_epochs(make_cfg(one, tmp_path / "c"), 34) == 2 == _train_epochs(
        make_cfg(one, tmp_path / "c"), 66) < _train_epochs(make_cfg(one, tmp_path / "c"), 67)
    assert 34 - 33 < SEPARATE_LAST_EPOCH_FRACTION * 33 < 66 - 33
    train(make_cfg(one, tmp_path / "c", train__train_iters=17, **kw), log=lambda *a: None)
    with pytest.raises(UserError, match=r"\(train samples 34 -> 66; epochs of each dataset 2 "
                                        r"\(the last shuffled on its own\) -> 2: Megatron's"):
        Trainer(make_cfg(one, tmp_path / "c", train__train_iters=33, **kw), log=lambda *a: None)


def test_a_resume_with_another_learning_rate_schedule_is_refused(dataset, tmp_path):
    """Megatron's AnnealingLR refuses a checkpoint whose schedule differs from the arguments
    unless --override-lr-scheduler; bloomtrain resumed silently, and with decay_samples unset
    (the run's length), lengthening a run as "nothing to train" says moved the decay: the LR
    jumped from 1.9e-4 back to 6.1e-4. Now it is refused, naming the change and the value to
    keep; optim.override_schedule takes the new schedule."""
    from bloomtrain.errors import UserError

    ck = {"dir": str(tmp_path / "ck")}
    base = dict(optim__decay_samples=None, optim__warmup_samples=8, checkpoint=ck)
    train(make_cfg(dataset, tmp_path / "a", train__train_iters=2, **base), log=lambda *a: None)
    lines = []
    train(make_cfg(dataset, tmp_path / "a", train__train_iters=2, **base),
          log=lambda *a: lines.append(" ".join(map(str, a))))
    assert "[train] already at step 2 of 2; nothing to train (raise train.train_iters or " \
           "train.train_samples to continue, with optim.decay_samples=16 to keep this run's " \
           "decay)" in lines
    with pytest.raises(UserError, match=r"the learning-rate schedule differs from checkpoint "
                                        r".*: optim.decay_samples 16 -> 32 \(optim.decay_samples "
                                        r"is unset: the decay follows the run's length\); the LR "
                                        r"would jump. Keep the checkpoint's "
                                        r"\(optim.decay_samples=16\), or set "
                                        r"optim.override_schedule=true"):
        Trainer(make_cfg(dataset, tmp_path / "a", train__train_iters=4, **base),
                log=lambda *a: None)
    with pytest.raises(UserError, match=r"optim.lr 0.001 -> 0.002, optim.min_lr 0.0001 -> 0.0"):
        Trainer(make_cfg(dataset, tmp_path / "a", train__train_iters=2, optim__lr=2e-3,
                         optim__min_lr=0.0, **base), log=lambda *a: None)
    # Pinned to the checkpoint's decay, the extended run's LRs are the uninterrupted one's.
    whole = make_cfg(dataset, tmp_path / "w", train__train_iters=4, optim__decay_samples=16,
                     optim__warmup_samples=8, checkpoint={"dir": str(tmp_path / "ckw")})
    train(whole, log=lambda *a: None)
    train(make_cfg(dataset, tmp_path / "a", train__train_iters=4,
                   **{**base, "optim__decay_samples": 16}), log=lambda *a: None)
    lrs = [r["lr"] for r in metrics(tmp_path / "a" / "run") if "loss" in r]
    assert lrs[-2:] == [r["lr"] for r in metrics(tmp_path / "w" / "run") if "loss" in r][2:]
    res = train(make_cfg(dataset, tmp_path / "a", train__train_iters=5, optim__lr=2e-3,
                         optim__override_schedule=True, **base), log=lambda *a: None)
    assert res.state.step == 5
