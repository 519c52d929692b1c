"""`bloomtrain train` ends with the run's summary (bloomtrain.report.closing, which `bloomtrain
demo` ends with too): where it stopped, the last train and eval losses as metrics.jsonl has
them, tokens/s, the checkpoint and run directory, and the next commands, which run as printed.
In one process and from the launcher of --nproc 2 (printed once, not per worker)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bloomtrain import cli
from bloomtrain.report.closing import closing_lines

pytestmark = pytest.mark.usefixtures("one_thread")


def write_config(tmp_path: Path, dataset) -> Path:
    """hidden 64, 4 heads, 4 layers, vocab 256, seq 32; 6 steps, evaluated at 3 and 6."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{preset: tiny, vocab_size: 256}}\n"
        f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
        f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: 400}}\n"
        f"train: {{micro_batch_size: 4, global_batch_size: 8, train_iters: 6, precision: fp32,"
        f" log_interval: 2, eval_interval: 3, eval_iters: 1, device: cpu}}\n"
        f"checkpoint: {{dir: {tmp_path / 'ck'}}}\n"
        f"run_dir: {tmp_path / 'run'}\n")
    return path


def expected_summary(tmp_path: Path) -> tuple[list[str], str]:
    """The summary's lines but tokens/s's, from what the run wrote; and that line's start."""
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    ev = [r for r in records if "eval_loss" in r][-1]
    run, ck = tmp_path / "run", tmp_path / "ck" / "step_00000006"
    return [
        "[train] finished at step 6 of 6 (48 samples)",
        f"  train loss    {steps[-1]['loss']:.4f} at step 6 (first logged: "
        f"{steps[0]['loss']:.4f} at step 2)",
        f"  eval loss     {ev['eval_loss']:.4f} at step 6 (perplexity {ev['eval_ppl']:.2f})",
        "TOKENS",
        f"  checkpoint    {ck}",
        f"  run dir       {run}  (config.yaml, metrics.jsonl)",
        "Next:",
        f"  bloomtrain status {run}",
        f"  bloomtrain plot {run}",
        f"  bloomtrain export-hf --checkpoint {ck} --output {run / 'hf'}",
    ], "  tokens/s      "


def check_summary(out: str, tmp_path: Path) -> None:
    want, tokens = expected_summary(tmp_path)
    lines = out.rstrip("\n").splitlines()
    assert lines.count(want[0]) == 1, out[-3000:]
    got = lines[lines.index(want[0]):]
    got = [line for line in got if not line.startswith("  tensorboard --logdir")]
    assert len(got) == len(want), "\n".join(got)
    rate = got[want.index("TOKENS")]
    assert rate.startswith(tokens) and rate.endswith(" (median of the last logged intervals)")
    assert float(rate[len(tokens):].split()[0].replace(",", "")) > 0
    assert [g for g, w in zip(got, want) if w != "TOKENS"] == [w for w in want if w != "TOKENS"]


def test_one_process_ends_with_the_summary(dataset, tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["train", "--config", str(write_config(tmp_path, dataset))]) == 0
    out = capsys.readouterr().out
    check_summary(out, tmp_path)
    # Its next commands run as printed.
    for line in out.splitlines():
        if line.startswith(("  bloomtrain status", "  bloomtrain export-hf")):
            assert cli.main(shlex.split(line)[1:]) == 0, line
    assert (tmp_path / "run" / "hf" / "config.json").is_file()


def test_the_launcher_ends_with_one_summary(dataset, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, "-m", "bloomtrain", "train", "--config",
                        str(write_config(tmp_path, dataset)), "--nproc", "2"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    check_summary(r.stdout, tmp_path)


def test_a_stopped_run_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {train_iters: 10, global_batch_size: 8}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 2, "consumed_samples": 16, "loss": 5.5, "tokens_per_s": 100.0},
        {"step": 4, "consumed_samples": 32, "loss": 5.25, "tokens_per_s": 300.0}]))
    assert closing_lines(run, None) == [
        "[train] stopped at step 4 of 10 (32 samples)",
        "  train loss    5.2500 at step 4 (first logged: 5.5000 at step 2)",
        "  tokens/s      300 (median of the last logged intervals)",
        "  checkpoint    none (set checkpoint.dir to save one)",
        f"  run dir       {run}  (config.yaml, metrics.jsonl)",
        "Next:",
        f"  bloomtrain status {run}",
        f"  bloomtrain plot {run}"]
