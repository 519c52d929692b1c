"""`bloomtrain status`: a finished tiny run with checkpoints (and a corrupt newest one), a live
run whose metrics.jsonl ends in a half-written line, the total under batch-size ramp-up against
a real run, a relative checkpoint dir, the 80x24 screen with everything in it, and bad input."""
import json
import os
import shutil

import pytest
import yaml

from bloomtrain.cli import main
from bloomtrain.config import UserError
from bloomtrain.report import status_text
from bloomtrain.report.runs import fmt_bytes, fmt_duration, planned_steps, read_metrics
from bloomtrain.train import train
from tests.runs import full_records, step_record, write_run
from tests.helpers import make_cfg


@pytest.fixture(scope="module")
def finished(dataset, tmp_path_factory):
    """A finished 6-step run (fp32, CPU): evals at steps 3 and 6, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("finished")
    cfg = make_cfg(dataset, root, train__eval_interval=3, train__eval_iters=1,
                   checkpoint={"dir": str(root / "ckpt"), "save_interval": 3})
    train(cfg, log=lambda *a: None)
    return root


def rows(text: str) -> dict[str, str]:
    """The screen as {label: text} (the first row of each label)."""
    out = {}
    for line in text.split("\n"):
        label, value = line[:11].strip(), line[11:]
        if label and label not in out:
            out[label] = value
    return out


def assert_fits(text: str) -> None:
    lines = text.split("\n")
    assert len(lines) <= 24, f"{len(lines)} lines:\n{text}"
    assert max(len(line) for line in lines) <= 80, text


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_finished_run(finished, capsys):
    run = finished / "run"
    assert main(["status", str(run)]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert_fits(text)
    r = rows(text)
    recs = records(run)
    last_loss = [x for x in recs if "loss" in x][-1]["loss"]
    last_eval = [x for x in recs if "eval_loss" in x][-1]
    assert r["state"].startswith("finished")
    assert r["step"].startswith("6 / 6 (100.0%)")
    assert "ETA" not in r  # nothing left to estimate
    assert r["loss"].startswith(f"{last_loss:.4f}")
    assert f"eval loss {last_eval['eval_loss']:.4f}" in r["loss"] and "step 6" in r["loss"]
    assert "tokens/s" in r["speed"] and "TFLOP/s" in r["speed"]
    peaks = [x["mem_peak_bytes"] for x in recs if "mem_peak_bytes" in x]
    if peaks:  # records carry memory once the trainer measures it
        assert r["memory"].startswith(f"peak {fmt_bytes(max(peaks))}")
    assert r["layout"].startswith("tp=1 pp=1 dp=1")
    assert r["checkpoint"].startswith("step_00000006, saved ")
    assert r["skipped"].startswith("0 steps") and r["spikes"] == "0" and r["alerts"] == "0"
    assert "note" not in r


def test_corrupt_newest_checkpoint_is_skipped(finished, tmp_path):
    # The checkpoint package's own verdict: a truncated file makes step 6 invalid, so the
    # latest valid checkpoint is step 3, as a resume would find it.
    ckpt = shutil.copytree(finished / "ckpt", tmp_path / "ckpt")
    model = ckpt / "step_00000006" / "model-00000.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    run = shutil.copytree(finished / "run", tmp_path / "run")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["checkpoint"]["dir"] = str(ckpt)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    text = status_text(run)
    assert_fits(text)
    lines = text.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("checkpoint"))
    assert lines[at][11:].startswith("step_00000003")
    assert "1 newer skipped" in lines[at + 1] and "step_00000006" in lines[at + 1]


def test_live_run_with_a_half_written_line(tmp_path):
    cfg = {"train": {"train_iters": 100, "global_batch_size": 8}, "run_dir": str(tmp_path / "r")}
    # Step times: a slow first interval (start-up) and one slow interval among the last ten
    # (a checkpoint save); the recent median ignores both.
    recs = [step_record(s, step_time_s=30.0 if s == 1 else 9.0 if s == 37 else 0.5)
            for s in range(1, 41)]
    run = write_run(tmp_path / "r", recs, cfg)
    metrics = run / "metrics.jsonl"
    line = json.dumps(step_record(41, loss=1.25)) + "\n"
    with open(metrics, "a") as f:
        f.write(line[:37])  # rank 0 is mid-write
    assert read_metrics(metrics)[1] is True
    written = metrics.stat().st_mtime
    text = status_text(run, now=written + 125)
    assert_fits(text)
    r = rows(text)
    assert r["state"] == "in progress (last record 2m 05s ago)"
    assert r["step"].startswith("40 / 100 (40.0%)")
    assert r["ETA"] == f"{fmt_duration(60 * 0.5)} at 0.5 s/step (recent median)"
    assert r["note"].startswith("metrics.jsonl ends in a line being written")
    # Far past the usual gap between records (10 steps of 0.5 s) the screen asks.
    assert rows(status_text(run, now=written + 7200))["state"] == \
        "no record for 2h 00m: stopped or stalled? (one was due every ~5s)"

    # The line completes and the next one starts: status moves on.
    with open(metrics, "a") as f:
        f.write(line[37:] + json.dumps(step_record(42))[:10])
    r = rows(status_text(run))
    assert r["step"].startswith("41 / 100") and r["loss"].startswith("1.2500")

    # A whole record whose newline has not landed yet counts.
    metrics.write_text("".join(json.dumps(x) + "\n" for x in recs) + json.dumps(step_record(41)))
    recs_read, partial = read_metrics(metrics)
    assert not partial and recs_read[-1]["step"] == 41
    assert "note" not in rows(status_text(run))


def test_total_with_batch_size_rampup_matches_a_real_run(dataset, tmp_path):
    # Ramp 4 -> 8 over the first 16 samples of 40: 4 steps of 4, then 3 of 8.
    cfg = make_cfg(dataset, tmp_path, train__train_iters=None, train__train_samples=40,
                   train__rampup_batch_size=[4, 4, 16])
    train(cfg, log=lambda *a: None)
    run = tmp_path / "run"
    steps = [x for x in records(run) if "loss" in x]
    assert len(steps) == 7
    train_cfg = yaml.safe_load((run / "config.yaml").read_text())["train"]
    for rec in [{"step": 0, "consumed_samples": 0}] + steps:
        assert planned_steps(train_cfg, rec["step"], rec["consumed_samples"]) == 7
    assert rows(status_text(run))["step"].startswith("7 / 7 (100.0%)")


def test_relative_checkpoint_dir(finished, tmp_path, monkeypatch):
    # Training ran in `launch` with run_dir runs/x and checkpoint.dir ckpt (both relative);
    # status is asked from elsewhere.
    launch = tmp_path / "launch"
    shutil.copytree(finished / "ckpt", launch / "ckpt")
    run = write_run(launch / "runs" / "x", [step_record(6)],
                    {"train": {"train_iters": 6}, "checkpoint": {"dir": "ckpt"},
                     "run_dir": "runs/x"})
    monkeypatch.chdir(tmp_path)
    assert rows(status_text(run))["checkpoint"].startswith("step_00000006")
    monkeypatch.chdir(launch)  # and from the launch dir, by the relative path
    assert rows(status_text("runs/x"))["checkpoint"].startswith("step_00000006")

    write_run(run, [step_record(6)], {"train": {"train_iters": 6}, "checkpoint": {"dir": None}})
    assert rows(status_text(run))["checkpoint"] == "none (checkpoint.dir is not set)"
    write_run(run, [step_record(6)], {"train": {"train_iters": 6},
                                      "checkpoint": {"dir": "elsewhere"}})
    assert rows(status_text(run))["checkpoint"] == "none yet (elsewhere does not exist)"


def test_everything_fits_80x24(tmp_path):
    long_dir = tmp_path / ("a-very-long-directory-name-" * 4) / "run"
    recs = [rec for rec in full_records(50) if "loss" in rec]
    recs[-1]["layout"] = "tp=8 pp=12 dp=4 zero=1 offload schedule=interleaved sp " * 4
    for rec in recs:
        rec["alerts"] = rec.get("alerts", []) + [
            f"alert at step {rec['step']} with a long explanation of what went wrong " * 3]
    cfg = {"train": {"train_iters": 1000, "global_batch_size": 8},
           "checkpoint": {"dir": str(tmp_path / "no-ckpt-yet")}, "run_dir": str(long_dir)}
    run = write_run(long_dir, recs, cfg)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 51, "lo')
    text = status_text(run)
    assert_fits(text)
    r = rows(text)
    assert r["run"].startswith("...") and r["run"].endswith("/run")
    assert r["memory"] == "peak 3.0 GiB (rank 1, CUDA allocated), reserved 4.0 GiB"
    assert "MFU 44." in r["speed"]
    assert r["skipped"] == "1 step   loss scale 32768"
    assert r["spikes"] == "1, last step 20 z=8.5 log"
    assert r["straggler"] == "rank 3 at 1.50x the median step time (step 25)"
    assert r["alerts"].startswith("52, latest:")  # 50 periodic + a spike + a straggler
    assert text.split("\n")[-1].startswith("  step 50: alert at step 50 ")
    assert "note" in r


def test_just_started_no_config_and_bad_input(tmp_path, capsys):
    started = write_run(tmp_path / "started", [], {"train": {"train_iters": 10}})
    created = (started / "metrics.jsonl").stat().st_mtime
    r = rows(status_text(started, now=created + 125))
    assert r["state"] == "started 2m 05s ago, no step logged yet"
    assert r["step"] == "no step logged yet"
    # Stuck before its first record (a rendezvous, a first collective): asked, not healthy.
    assert rows(status_text(started, now=created + 3 * 3600))["state"] == \
        "no step logged 3h 00m after the start: stalled?"

    no_cfg = write_run(tmp_path / "no_cfg", [step_record(5)])
    r = rows(status_text(no_cfg))
    assert r["step"].startswith("5 ") and r["ETA"] == "- (no config.yaml in the run dir)"
    # Without a config the run's own estimate, when its records carry one.
    write_run(no_cfg, [step_record(5, eta_s=3700.0)])
    assert rows(status_text(no_cfg))["ETA"] == "1h 01m (the run's own estimate)"

    assert main(["status", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing does not exist" in err and "run_dir" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text(json.dumps(step_record(1)) + "\n" +
                                       json.dumps(step_record(2)) + "\n{oops}\n" +
                                       json.dumps(step_record(3)) + "\n")
    with pytest.raises(UserError, match=r"line 3 is not valid JSON .* fix or delete"):
        status_text(bad)
    os.remove(bad / "metrics.jsonl")
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        status_text(bad)


def test_eta_and_done_during_a_batch_size_rampup_go_by_samples(tmp_path):
    # Ramp 16 -> 1024 over 100k of 200k samples, a step's time proportional to its batch
    # (10 ms per sample). 40 steps of 16 in, the steps left are mostly of 1024: the ETA is the
    # samples left at the recent time per sample, and 640 of 200k samples is 0.3% done, not
    # the 7% of the planned steps that 40 small ones are.
    from bloomtrain.layout import BatchSchedule
    gbs, samples, ramp = 1024, 200_000, [16, 16, 100_000]
    schedule = BatchSchedule(gbs, 1, None, tuple(ramp))
    recs, consumed = [], 0
    for step in range(1, 41):
        b = schedule.global_batch_size_at(consumed)
        consumed += b
        recs.append(step_record(step, consumed_samples=consumed, global_batch_size=b,
                                step_time_s=0.01 * b))
    true_left, c = 0.0, consumed  # every step left at its own batch; a partial last batch
    while c + schedule.global_batch_size_at(c) <= samples:  # is not trained (Megatron floors)
        b = schedule.global_batch_size_at(c)
        c, true_left = c + b, true_left + 0.01 * b
    run = write_run(tmp_path / "ramp", recs, {"train": {
        "train_samples": samples, "global_batch_size": gbs, "micro_batch_size": 1,
        "rampup_batch_size": ramp, "train_iters": None}})
    r = rows(status_text(run))
    assert r["step"].startswith("40 / ") and "(0.3%)" in r["step"]
    assert r["ETA"] == f"{fmt_duration(true_left)} at the recent time per sample, the batch " \
                       f"ramping up to {gbs}"


def test_a_run_that_stopped_cleanly_reads_as_stopped(dataset, tmp_path, monkeypatch):
    # A stop before the end (the kill switch, a signal, train.exit_duration_minutes) saves and
    # exits 0. It wrote nothing status could read, so the run read as in progress, with an ETA.
    import time

    from bloomtrain.launch import JOB_START_ENV
    monkeypatch.setenv(JOB_START_ENV, repr(time.time() - 120))
    run = tmp_path / "run"
    train(make_cfg(dataset, tmp_path, train__train_iters=50, train__exit_duration_minutes=1.0),
          log=lambda *a: None)
    assert records(run)[-1] == {"step": 1, "consumed_samples": 8,
                                "stopped": "exit_duration_minutes"}
    r = rows(status_text(run))
    assert r["state"].startswith("stopped at step 1 (exit_duration_minutes), ")
    assert "ETA" not in r  # none for a run that is not running
    # Resumed past the stop: in progress again.
    write_run(run, records(run)[:-1] + [records(run)[-1], step_record(2)],
              yaml.safe_load((run / "config.yaml").read_text()))
    assert rows(status_text(run))["state"].startswith("in progress")


def test_a_stop_between_log_steps_is_the_last_record(dataset, tmp_path, monkeypatch):
    """A stop at a step that is no log step wrote its record before the interval's loss
    record, which status read as the run trained on after it: "killed or crashed"."""
    import time

    from bloomtrain.launch import JOB_START_ENV
    monkeypatch.setenv(JOB_START_ENV, repr(time.time() - 120))
    run = tmp_path / "run"
    train(make_cfg(dataset, tmp_path, train__train_iters=50, train__log_interval=1000,
                   train__exit_duration_minutes=1.0), log=lambda *a: None)
    recs = records(run)
    assert [("stopped" in r, "loss" in r) for r in recs[-2:]] == [(False, True), (True, False)]
    assert rows(status_text(run))["state"].startswith("stopped at step 1 (exit_duration_minutes)")


def test_a_run_resumed_into_a_new_run_dir_reads_as_started(dataset, tmp_path):
    # Resumed from another run's checkpoint (or an import) into a fresh run_dir: metrics.jsonl
    # is there from the start, as for a fresh run; status said "has no metrics.jsonl".
    from bloomtrain.train.metrics import MetricsLog
    MetricsLog(tmp_path / "fresh", True, 7, log=lambda *a: None)
    assert (tmp_path / "fresh" / "metrics.jsonl").read_text() == ""
    assert rows(status_text(tmp_path / "fresh"))["state"].startswith("started")


def test_a_hand_edited_config_with_strings_for_numbers_is_read_around(tmp_path):
    """config.yaml edited by hand or written by another tool: "10" for log_interval made status
    raise TypeError (a string times a float), strings in rampup_batch_size made status and the
    report raise. Values that are no numbers are passed over, as others already were."""
    from bloomtrain.report.closing import closing_lines

    run = tmp_path / "run"
    write_run(run, [step_record(1)], {"train": {
        "log_interval": "10", "train_samples": 800, "global_batch_size": 8,
        "rampup_batch_size": ["2", "2", "100"]}})
    assert rows(status_text(run))["state"].startswith("in progress")
    assert closing_lines(run, None)[0].startswith("[train] ")


def test_a_partial_last_batch_is_not_counted_as_left(dataset, tmp_path):
    """A run of 41 samples at a batch of 8 trains 5 steps, 40 samples (a partial last batch is
    not trained, as Megatron's update_train_iters floors): its status read 97.6% and counted
    the sample never trained in the ETA. Ramped, 101 samples train 98."""
    cfg = make_cfg(dataset, tmp_path, train__train_iters=None, train__train_samples=41)
    train(cfg, log=lambda *a: None)
    row = rows(status_text(tmp_path / "run"))["step"]
    assert row.startswith("5 / 5 (100.0%)") and "samples 40" in row
    from bloomtrain.report.runs import planned_samples
    assert planned_samples({"train_samples": 101, "global_batch_size": 8,
                            "rampup_batch_size": [2, 2, 40]}) == 98


def test_a_killed_run_reads_as_not_running(tmp_path):
    """A run killed mid-way (kill -9: its lock dropped by the kernel) read "in progress" with an
    ETA for ten minutes or more. Its lock file names the process; on this host, one that runs no
    more is said, and no ETA is given."""
    import subprocess
    import sys
    import socket

    run = tmp_path / "run"
    write_run(run, [step_record(s) for s in range(1, 5)],
              {"train": {"train_iters": 100, "global_batch_size": 8, "log_interval": 1}})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ".bloomtrain.lock").write_text(f"pid {dead.pid} on {socket.gethostname()}, since "
                                          f"2026-12-07 08:00:00\n")
    got = rows(status_text(run))
    assert got["state"] == f"killed or crashed at step 4 (pid {dead.pid} is gone); rerun to resume"
    assert "ETA" not in got
    (run / ".bloomtrain.lock").write_text(f"pid {os.getpid()} on {socket.gethostname()}, since "
                                          f"2026-12-07 08:00:00\n")  # alive: still running
    assert rows(status_text(run))["state"].startswith("in progress")


def test_hand_edited_records_and_paths_are_one_line(tmp_path, capsys):
    """A consumed_samples of "abc" and a ramp with a zero increment raised TypeError and
    ZeroDivisionError; a file given as the run dir was "does not exist"; config.yaml without a
    checkpoint section is not "checkpoint.dir is not set" when there is no config.yaml."""
    run = tmp_path / "r1"
    write_run(run, [step_record(1), step_record(2, consumed_samples="abc")],
              {"train": {"train_samples": 800, "global_batch_size": 8,
                         "rampup_batch_size": [2, 0, 40]}})
    assert rows(status_text(run))["state"].startswith("in progress")
    (tmp_path / "afile").write_text("x")
    assert main(["status", str(tmp_path / "afile")]) == 2
    assert "is a file, not a run directory" in capsys.readouterr().err
    bare = write_run(tmp_path / "r2", [step_record(1)])
    assert "no config.yaml in the run dir" in rows(status_text(bare))["checkpoint"]
    (bare / "config.yaml").write_text("train: [1, 2\n")
    assert main(["status", str(bare)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.yaml is not valid YAML at line 2" in err


def test_a_start_the_kill_switch_stops_after_a_kill_reads_as_stopped_at_its_checkpoint(
        dataset, tmp_path):
    """A job killed in step 5 after its checkpoint at step 3, requeued with the kill switch set:
    that start appends its stop (step 3, where a resume starts) after the killed job's records
    of steps 4 and 5. Status compared step numbers, dropped the stop and said "killed or crashed
    at step 5 ... rerun to resume"."""
    from bloomtrain import checkpoint as ckpt
    ck = {"dir": str(tmp_path / "ck"), "save_interval": 3}
    train(make_cfg(dataset, tmp_path, train__train_iters=5, train__log_interval=1,
                   checkpoint=ck), log=lambda *a: None)
    shutil.rmtree(tmp_path / "ck" / ckpt.step_dir_name(5))  # the kill came before its save
    switch = tmp_path / "KILL"
    switch.touch()
    res = train(make_cfg(dataset, tmp_path, train__train_iters=6, train__log_interval=1,
                         train__kill_switch_path=str(switch), checkpoint=ck),
                log=lambda *a: None)
    assert res.exit_reason == "kill switch"
    run = tmp_path / "run"
    assert records(run)[-1] == {"step": 3, "consumed_samples": 24, "stopped": "kill switch"}
    assert max(r["step"] for r in records(run)) == 5
    got = rows(status_text(run))
    assert got["state"].startswith("stopped at step 3 (kill switch), "), got
    # config.yaml is still the killed job's (the stopped start rewrites nothing): 5 steps.
    assert got["step"].startswith("3 / 5 ") and "samples 24" in got["step"], got
    # Nor the evaluation of the undone step 5 (the run evaluates at its end).
    assert got["loss"].endswith("eval loss -"), got
    # Resumed past the stop (the resume drops the records after step 3), it is not stopped.
    write_run(run, [r for r in records(run) if r["step"] <= 3] + [step_record(4)],
              yaml.safe_load((run / "config.yaml").read_text()))
    assert rows(status_text(run))["state"].startswith("in progress")


def test_a_run_that_holds_its_lock_before_its_first_record_reads_as_starting(tmp_path):
    """Training writes metrics.jsonl once the model, the data's indices and the checkpoint are
    ready (minutes at scale) after the run directory and its lock appear: status said "has no
    metrics.jsonl; give the run_dir of a training run" of the right directory."""
    import socket
    import subprocess
    import sys

    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".bloomtrain.lock"
    lock.write_text(f"pid {os.getpid()} on {socket.gethostname()}, since 2026-12-07 08:00:00\n")
    # Held, as a starting run holds it (flock, exclusive).
    held = os.open(lock, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    got = rows(status_text(run, now=lock.stat().st_mtime + 90))
    assert got["state"] == (f"starting for {fmt_duration(90)} (building model, data, "
                            f"checkpoint), no step yet"), got
    # Its holder on another host (status on a login node, the job on a compute node): the
    # lock file alone read "starting" for days after the start had died.
    lock.write_text("pid 4242 on gpu-017, since 2026-12-07 08:00:00\n")
    assert rows(status_text(run))["state"].startswith("starting for ")  # still held
    os.close(held)
    assert rows(status_text(run))["state"].startswith("ended while starting (its lock is free)")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"pid {dead.pid} on {socket.gethostname()}, since 2026-12-07 08:00:00\n")
    assert rows(status_text(run))["state"].startswith(f"ended while starting (pid {dead.pid} gone)")
    lock.unlink()  # no lock: not a run directory, as before
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        status_text(run)


def test_a_config_or_record_that_cannot_be_read_as_numbers_is_read_around_or_one_line(
        tmp_path, capsys):
    """`train: abc` in config.yaml raised AttributeError in the ETA row; a config.yaml that is
    not UTF-8 raised UnicodeDecodeError in status and plot; a skipped_steps of NaN or 1e400
    raised ValueError and OverflowError."""
    run = write_run(tmp_path / "r", [step_record(1), step_record(2, eta_s=60.0)],
                    {"train": "abc"})
    assert rows(status_text(run))["state"].startswith("in progress")
    (run / "metrics.jsonl").write_text(
        json.dumps(step_record(1)) + "\n" + json.dumps(step_record(2)).replace(
            '"skipped_steps": 0', '"skipped_steps": NaN') + "\n")
    assert rows(status_text(run))["state"].startswith("in progress")
    (run / "metrics.jsonl").write_text(json.dumps(step_record(1)).replace(
        '"skipped_steps": 0', '"skipped_steps": 1e400') + "\n")
    assert rows(status_text(run))["state"].startswith("in progress")
    (run / "config.yaml").write_bytes(b"# caf\xe9\ntrain: {global_batch_size: 8}\n")
    for cmd in (["status", str(run)], ["plot", str(run), "--output", str(tmp_path / "out")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "config.yaml is not UTF-8 text" in err, err
    assert not (tmp_path / "out").exists()
