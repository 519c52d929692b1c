"""Chaos test: a real multi-process `bloomtrain train --nproc N` run, SIGKILLed at random moments
(a good share of them while a checkpoint is being written) and restarted with `resume: auto`
each time, must end bitwise equal to an uninterrupted run of the same config.

    python tests/chaos.py --kills 20 [--seed S] [--nproc 2] [--steps 36] [--workdir DIR]

Every kill hits the whole process group (launcher and workers), so the kill is as abrupt as a node
losing power, short of losing the page cache. What is compared at the end: every tensor of the
final checkpoint (fp32 master weights, exp_avg, exp_avg_sq; `torch.equal`), the train state, the
optimizer scalars and the logged per-step losses. Prints a summary and ends with one JSON line;
exit code 0 when everything is bitwise equal, 1 otherwise. `run_chaos` is the same thing as a
function, for tests/system/test_chaos.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bloomtrain import checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find tests/
from tests.synthetic import write_synthetic_dataset  # noqa: E402

KINDS = ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS
_STEP_LINE = re.compile(r"^step\s+(\d+)\s")
_RESUMED = re.compile(r"\[checkpoint\] resumed from .* at step (\d+)")


def write_config(path: Path, dataset: str, steps: int, nproc: int, precision: str,
                 save_interval: int) -> Path:
    # Frequent saves (every 1-2 steps) make it likely that a random kill lands inside one;
    # decay_samples spans the whole run so the lr changes every step, and a resume that got the
    # schedule position wrong would not go unnoticed.
    path.write_text(
        # ~3.4M parameters: a save (fp32 master + two moments, ~40 MB) takes long enough for
        # the watcher to land kills inside it even on a fast, idle machine.
        f"model: {{preset: null, hidden_size: 256, num_layers: 4, num_heads: 4,"
        f" vocab_size: 256}}\n"
        f"parallel: {{zero_stage: {1 if nproc > 1 else 0}}}\n"
        f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
        f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: {steps * 8}}}\n"
        f"train: {{micro_batch_size: 4, global_batch_size: 8, train_iters: {steps},"
        f" precision: {precision}, log_interval: 1, device: cpu, eval_iters: 2}}\n"
        f"checkpoint: {{save_interval: {save_interval}, keep_last: 3, async_save: true}}\n")
    return path


class Run:
    """One `bloomtrain train` process group, its output collected by a reader thread."""

    def __init__(self, config: Path, nproc: int, ckpt_dir: Path, run_dir: Path, log_path: Path):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = open(log_path, "a")
        self.lines: list[str] = []
        self.last_step = 0
        self.resumed_step: int | None = None
        self.started = time.monotonic()
        # A session of its own: its pgid is its pid, and the elastic launcher's workers (spawned,
        # not daemonized) stay in that group, so one killpg reaches every process of the job.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bloomtrain", "train", "--config", str(config),
             "--nproc", str(nproc), f"checkpoint.dir={ckpt_dir}", f"run_dir={run_dir}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.pgid = self.proc.pid
        self.first_step_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            if m := _STEP_LINE.match(line):
                self.last_step = int(m.group(1))
                if self.first_step_at is None:
                    self.first_step_at = time.monotonic()
            elif m := _RESUMED.search(line):
                self.resumed_step = int(m.group(1))

    def done(self) -> bool:
        return self.proc.poll() is not None

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_group_gone(self.pgid)
        self.finish()

    def finish(self) -> int:
        rc = self.proc.wait()
        self._reader.join()
        if not self.log.closed:
            self.log.close()
        return rc

    def output(self) -> str:
        return "".join(self.lines)


def group_members(pgid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    """SIGKILL is asynchronous: a restart must not begin while the old job still holds files or
    ports, and no process may outlive the test."""
    deadline = time.monotonic() + timeout
    while left := group_members(pgid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {left} of killed group {pgid} survive SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(0.05)


_SAVE_DIR = re.compile(r"^\.step_(\d+)\.(tmp|old)$")


def save_dirs(ckpt_dir: Path) -> dict[tuple[str, int, int], int]:
    """In-progress save directories (`.step_N.tmp`, and `.step_N.old` of a re-save) -> step N.
    Keyed by name, inode and ctime: a save that restarts at the same step deletes and recreates
    its directory, and the file system may hand it the same inode number."""
    out = {}
    try:
        with os.scandir(ckpt_dir) as it:
            for e in it:
                if m := _SAVE_DIR.match(e.name):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out[(e.name, st.st_ino, st.st_ctime_ns)] = int(m.group(1))
    except FileNotFoundError:
        pass
    return out


def _wait(cond, run: Run, deadline: float, poll: float) -> bool:
    while time.monotonic() < deadline:
        if cond():
            return True
        if run.done():
            return False
        time.sleep(poll)
    return False


def kill_during_save(run: Run, ckpt_dir: Path, target: int, deadline: float) -> bool:
    """Kill as soon as a save of step >= `target` by this run has created its temporary
    directory. Returns whether the kill landed inside the save: the directory is still there
    afterwards, not yet renamed into place."""
    before = save_dirs(ckpt_dir)
    hit: set = set()

    def save_started():
        nonlocal hit
        hit = {k for k, step in save_dirs(ckpt_dir).items() if k not in before and step >= target}
        return bool(hit)
    # Tight polling: a save of the tiny model takes only milliseconds.
    if not _wait(save_started, run, deadline, 0.0005):
        return False
    run.kill()
    return bool(hit & save_dirs(ckpt_dir).keys())


def kill_at_random(run: Run, rng: random.Random, target: int, steps: int, deadline: float,
                   step_time: float, startup_time: float) -> None:
    """Kill at a random moment: during start-up and resume, or a random time into step `target`
    (or the first step this run takes, when it resumed past `target`)."""
    if rng.random() < 0.25:
        _wait(lambda: False, run, min(deadline, time.monotonic() + rng.uniform(0, startup_time)),
              0.01)
    else:
        def reached():
            resumed = run.resumed_step or 0
            # A run that resumed at the last step takes no steps: it evaluates and saves again.
            return resumed >= steps or run.last_step >= max(target, resumed + 1)
        if not _wait(reached, run, deadline, 0.005):
            return
        _wait(lambda: False, run, time.monotonic() + rng.uniform(0, step_time), 0.002)
    if not run.done():
        run.kill()


def full_state(path: Path) -> dict:
    reader = ckpt.CheckpointReader(path, kinds=KINDS)
    state = {(k, n): reader.load(n, k) for n in reader.names() for k in KINDS}
    reader.close()
    return state


def losses(run_dir: Path) -> dict[int, tuple]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = (rec["loss"], rec["grad_norm"], rec["lr"])
        if "eval_loss" in rec:
            out[("eval", rec["step"])] = (rec["eval_loss"],)
    return out


def compare(ref_ckpt: Path, got_ckpt: Path, ref_run: Path, got_run: Path) -> tuple[list, int]:
    """Every difference between the two final checkpoints and loss curves, as messages; and the
    number of tensors compared."""
    problems = []
    ref_m, got_m = ckpt.read_manifest(ref_ckpt), ckpt.read_manifest(got_ckpt)
    for key in ("train_state", "optimizer"):
        if ref_m.get(key) != got_m.get(key):
            problems.append(f"{key}: reference {ref_m.get(key)} vs chaos {got_m.get(key)}")
    a, b = full_state(ref_ckpt), full_state(got_ckpt)
    if a.keys() != b.keys():
        problems.append(f"tensor sets differ: {sorted(set(a) ^ set(b))}")
    for key in sorted(a.keys() & b.keys()):
        if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
            diff = (a[key].double() - b[key].double()).abs().max().item() \
                if a[key].shape == b[key].shape else "shape"
            problems.append(f"{key[0]} {key[1]} differs (max abs diff {diff})")
    la, lb = losses(ref_run), losses(got_run)
    if la != lb:
        bad = sorted((k for k in la.keys() | lb.keys() if la.get(k) != lb.get(k)), key=str)
        problems.append(f"logged losses differ at steps {bad[:10]}")
    return problems, len(a.keys() & b.keys())


def run_chaos(kills: int, seed: int = 0, workdir: str | os.PathLike | None = None,
              nproc: int = 2, steps: int = 36, precision: str = "fp32",
              save_interval: int = 2, timeout: float = 1800.0, log=print) -> dict:
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="bloomtrain-chaos-")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t_start = time.monotonic()
    deadline = t_start + timeout
    dataset = write_synthetic_dataset(work / "data" / "synth_text_document")
    config = write_config(work / "chaos.yaml", dataset, steps, nproc, precision, save_interval)
    log_path = work / "chaos.log"

    # The reference run also builds the dataset's sample-index cache, which both runs share.
    ref_ck, ref_run = work / "ref_ck", work / "ref_run"
    ref = Run(config, nproc, ref_ck, ref_run, log_path)
    try:
        rc = ref.finish()
    finally:
        if not ref.done():
            ref.kill()
        wait_group_gone(ref.pgid)
    if rc != 0:
        raise RuntimeError(f"reference run failed:\n{ref.output()[-4000:]}")
    startup_time = (ref.first_step_at or time.monotonic()) - ref.started
    step_time = (time.monotonic() - (ref.first_step_at or ref.started)) / steps
    ref_time = time.monotonic() - ref.started
    log(f"[chaos] reference run: {steps} steps in {ref_time:.1f} s (start-up {startup_time:.1f} s, "
        f"{step_time * 1000:.0f} ms/step)")

    # At least a third of the kills must land inside a save; aim at half so that the odd kill
    # that arrives just after a save's rename still leaves enough. Kill i aims at step
    # (i + 1) / (kills + 1) of the run, so the kills spread over the whole run instead of
    # piling up at its end.
    plan = ["save"] * ((kills + 1) // 2) + ["random"] * (kills // 2)
    rng.shuffle(plan)
    got_ck, got_run = work / "chaos_ck", work / "chaos_run"
    n_kills = n_save_kills = restarts = finished_early = missed_saves = 0
    skipped: list[str] = []
    resumed_at: list[int | None] = []
    i = 0
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos run exceeded {timeout} s")
        run = Run(config, nproc, got_ck, got_run, log_path)
        mode, during = "none", False
        try:
            if i < kills:
                mode = plan[i]
                target = max(1, (i + 1) * steps // (kills + 1))
                if mode == "save":
                    during = kill_during_save(run, got_ck, target, deadline)
                else:
                    kill_at_random(run, rng, target, steps, deadline, step_time, startup_time)
            rc = run.finish()
        finally:
            if not run.done():
                run.kill()
            wait_group_gone(run.pgid)
        out = run.output()
        skipped += [ln.strip() for ln in out.splitlines() if "[checkpoint] skipping" in ln]
        resumed_at.append(run.resumed_step)
        killed = rc == -signal.SIGKILL
        if killed:
            n_kills += 1
            n_save_kills += during
            i += 1
            restarts += 1
            log(f"[chaos] kill {n_kills}/{kills} ({mode}{', inside a save' if during else ''}): "
                f"resumed at {run.resumed_step}, last step {run.last_step}")
            continue
        if rc != 0:
            raise RuntimeError(f"training exited with {rc} after {n_kills} kills:\n{out[-4000:]}")
        if i < kills:
            # The job finished before its kill came (the save it waited for was over between
            # two polls). Kills after the end would test nothing, so start the chaos run over
            # from scratch; the plan goes on from the same kill.
            finished_early += 1
            if plan[i] == "save":
                missed_saves += 1
            log(f"[chaos] the run finished before kill {i + 1}; starting over from scratch")
            shutil.rmtree(got_ck, ignore_errors=True)
            shutil.rmtree(got_run, ignore_errors=True)
            continue
        break
    wall = time.monotonic() - t_start

    ref_final, got_final = ckpt.resolve(ref_ck), ckpt.resolve(got_ck)
    problems, n_tensors = [], 0
    if ref_final.name != got_final.name:
        problems.append(f"final checkpoint {got_final.name}, reference {ref_final.name}")
    else:
        problems, n_tensors = compare(ref_final, got_final, ref_run, got_run)
    result = {
        "kills": n_kills,
        "kills_during_save": n_save_kills,
        "restarts": restarts,
        "runs_finished_before_their_kill": finished_early,
        "save_kills_missed": missed_saves,
        "resumed_at_steps": resumed_at,
        "checkpoints_skipped_on_resume": len(skipped),
        "steps": steps,
        "nproc": nproc,
        "precision": precision,
        "save_interval": save_interval,
        "seed": seed,
        "final_checkpoint": str(got_final),
        "tensors_compared": n_tensors,
        "bitwise_equal": not problems,
        "problems": problems,
        "reference_run_s": round(ref_time, 1),
        "wall_s": round(wall, 1),
        "workdir": str(work),
    }
    for line in sorted(set(skipped)):
        log(f"[chaos] {line}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, required=True, help="number of SIGKILLs")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (dp size)")
    p.add_argument("--steps", type=int, default=36, help="train_iters")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--workdir", help="where data, checkpoints and chaos.log go (default: a "
                                     "new temporary directory, kept)")
    args = p.parse_args(argv)
    res = run_chaos(args.kills, args.seed, args.workdir, args.nproc, args.steps, args.precision,
                    args.save_interval)
    print(f"[chaos] kills {res['kills']} ({res['kills_during_save']} inside a save), restarts "
          f"{res['restarts']}, checkpoints skipped as invalid on resume "
          f"{res['checkpoints_skipped_on_resume']}, wall {res['wall_s']} s "
          f"(reference run {res['reference_run_s']} s)")
    if res["bitwise_equal"]:
        print(f"[chaos] final checkpoint {Path(res['final_checkpoint']).name}: "
              f"{res['tensors_compared']} tensors, train state, optimizer scalars and every "
              f"logged loss bitwise equal to the uninterrupted run")
    else:
        print("[chaos] MISMATCH:\n  " + "\n  ".join(res["problems"]))
    print(json.dumps(res))
    return 0 if res["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())


# ---- single-rank failures (tests/system/test_lost_rank.py, test_restart.py, test_multinode.py) --------
class Job:
    """A `bloomtrain` command in a session of its own (so that one process-group scan finds the
    launcher and every worker it started), its output read line by line with the time each line
    arrived. `prefix`: a command that execs it (tests/netns.py: in a node's namespace)."""

    def __init__(self, args: list[str], env: dict | None = None,
                 prefix: list[str] | None = None):
        self.lines: list[tuple[float, str]] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "bloomtrain", *args],
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.pgid = self.proc.pid
        self.exited_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        """When the first line holding `text` arrived."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def wait(self, timeout: float, after: str | None = None, limit: float | None = None) -> int:
        """The exit code. Fails (killing the job) past `timeout` s from the start, or past
        `limit` s after the first line holding `after`."""
        deadline = self.started + timeout
        while self.proc.poll() is None:
            seen = self.first(after) if after is not None and limit is not None else None
            if time.monotonic() > (deadline if seen is None else min(deadline, seen + limit)):
                self.kill()
                raise AssertionError(f"the job was still running {limit if seen else timeout} "
                                     f"s {'after ' + repr(after) if seen else 'in'}:\n"
                                     f"{self.output()[-6000:]}")
            time.sleep(0.1)
        self.exited_at = time.monotonic()
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """For teardown: the whole session, whatever is left of it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        wait_group_gone(self.pgid)

    def output(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def last_line(self) -> str:
        lines = [line.strip() for _, line in list(self.lines) if line.strip()]
        return lines[-1] if lines else ""


def group_left_after(pgid: int, timeout: float = 15.0) -> list[int]:
    """The processes of group `pgid` still there `timeout` s from now; waits for them to go on
    their own (multiprocessing's resource tracker ends when the launcher does), kills none."""
    deadline = time.monotonic() + timeout
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
