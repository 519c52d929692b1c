"""Downstream evaluation during training (train.eval_harness_*): the records in metrics.jsonl and
TensorBoard, `bloomtrain status` and the report's panel; a failing task logged while training
goes on; training unchanged by the evaluation (rank 0's generators restored); the live model's
numbers equal to `bloomtrain eval` on the checkpoint the run saves; and, in the slow tier, the
same on tensor-parallel and ZeRO-3 data-parallel ranks, and a malformed task YAML.

Tasks: tests/eval_tasks/ (their data files are relative to the repository root, where these
tests run), copied into a directory of the test's own beside a task that cannot run."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("lm_eval")

from bloomtrain import cli  # noqa: E402
from bloomtrain.config import Config  # noqa: E402
from bloomtrain.train import Trainer, train  # noqa: E402
from bloomtrain.errors import UserError  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "at_root")

ROOT = Path(__file__).resolve().parents[2]
GOOD = ["choice_tiny", "lastword_tiny", "greedy_tiny"]
# A task the harness indexes but cannot run: its data file is missing.
NODATA = """task: nodata_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: tests/eval_tasks/no_such_file.jsonl
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: " x"
metric_list:
  - metric: acc
"""


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def task_dir(root: Path, extra: dict[str, str]) -> Path:
    """The good test tasks and `extra` {file name: YAML} in one include directory."""
    d = root / "tasks"
    d.mkdir(parents=True, exist_ok=True)
    for name in GOOD:
        shutil.copy(ROOT / "tests" / "eval_tasks" / f"{name}.yaml", d)
    for name, text in extra.items():
        (d / name).write_text(text)
    return d


def make_cfg(dataset, tokenizer, root: Path, *, tasks: str | None, include=None,
             parallel=None, **train) -> Config:
    return Config.from_dict({
        "model": {"preset": "tiny", "hidden_dropout": 0.1, "attention_dropout": 0.1},
        "parallel": parallel or {},
        "data": {"paths": [dataset], "seq_length": 32, "split": "90,10,0",
                 "tokenizer": str(tokenizer)},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 16, "decay_samples": 400},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 6,
                  "precision": "fp32", "log_interval": 1, "device": "cpu", "eval_iters": 1,
                  "eval_harness_tasks": tasks, "eval_harness_interval": 3 if tasks else None,
                  "eval_harness_include_path": str(include) if include else None,
                  "eval_harness_limit": 4 if tasks else None, **train},
        "checkpoint": {"dir": str(root / "ckpt")},
        "run": {"tensorboard": True},
        "run_dir": str(root / "run")})


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def harness_records(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if any(k.startswith("eval/") for k in r)]


@pytest.fixture(scope="module")
def harness_run(dataset, tiny_tokenizer_dir, tmp_path_factory):
    """A 6-step run evaluating three good tasks and one that fails every 3 steps, and the same
    run without the evaluation: (config, its log lines, losses with, losses without)."""
    root = tmp_path_factory.mktemp("harness_run")
    include = task_dir(root, {"nodata_tiny.yaml": NODATA})
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cfg = make_cfg(dataset, tiny_tokenizer_dir, root,
                       tasks=",".join(GOOD[:2] + ["nodata_tiny", GOOD[2]]), include=include)
        lines: list[str] = []
        with_eval = train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
        plain_cfg = make_cfg(dataset, tiny_tokenizer_dir, root / "plain", tasks=None)
        plain = train(plain_cfg, log=lambda *a: None)
    finally:
        os.chdir(cwd)
    return cfg, lines, with_eval.losses, plain.losses


def test_records_failures_and_unchanged_training(harness_run):
    cfg, lines, losses, plain_losses = harness_run
    recs = harness_records(cfg.run_dir)
    assert [r["step"] for r in recs] == [3, 6]
    for r in recs:
        for task, metric in (("choice_tiny", "acc"), ("choice_tiny", "acc_norm"),
                             ("lastword_tiny", "perplexity"), ("lastword_tiny", "acc"),
                             ("greedy_tiny", "exact_match")):
            assert isinstance(r[f"eval/{task}/{metric}"], float), (task, metric)
        assert r["consumed_samples"] == r["step"] * 4 and r["eval_harness_s"] > 0
        assert not any("nodata_tiny" in k for k in r)
        assert len(r["alerts"]) == 1 and "task nodata_tiny failed" in r["alerts"][0]
        assert "no_such_file" in r["alerts"][0]  # the harness's own error, passed on
    logged = [line for line in lines if "eval-harness" in line]
    assert sum("task nodata_tiny failed" in line for line in logged) == 2
    assert any("choice_tiny/acc" in line for line in logged)
    # The run went on after each failure: every step, its validation evaluation, the final
    # checkpoint; and the harness's seeding of Python's, NumPy's and torch's generators did
    # not reach the dropout masks (0.1 here): the losses are the run's without it, bit for bit.
    assert len(losses) == 6 and losses == plain_losses
    assert (Path(cfg.checkpoint.dir) / "latest").exists()


def test_tensorboard_status_and_report_show_the_records(harness_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bloomtrain.report import write_report
    from bloomtrain.report.status import status_text

    cfg, *_ = harness_run
    last = harness_records(cfg.run_dir)[-1]
    ea = EventAccumulator(str(Path(cfg.run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    for key in ("eval/choice_tiny/acc", "eval/lastword_tiny/perplexity"):
        assert [(e.step, e.value) for e in ea.Scalars(key)][-1] == (6, pytest.approx(last[key]))
    text = status_text(cfg.run_dir)
    assert "downstream lm-eval at step 6" in text
    row = next(line for line in text.splitlines() if "choice_tiny" in line)
    assert f"acc {last['eval/choice_tiny/acc']:.4g}" in row
    assert "task nodata_tiny failed" in text  # among the alerts
    html = write_report([cfg.run_dir], Path(cfg.run_dir) / "plots")
    assert (html.parent / "downstream.png").is_file()
    assert "last downstream eval" in html.read_text()


def test_panel_lines_are_the_records(harness_run, tmp_path):
    from bloomtrain.report.plot import write_plots
    from bloomtrain.report.runs import load_run

    cfg, *_ = harness_run
    panel = next(p for p in write_plots([load_run(cfg.run_dir)], tmp_path)
                 if p.file == "downstream.png")
    recs = harness_records(cfg.run_dir)
    for key in ("eval/choice_tiny/acc", "eval/lastword_tiny/perplexity"):
        task, metric = key.split("/")[1:]
        xs, ys = panel.shown[metric][f"run {task}"]
        assert xs == [r["step"] for r in recs] and ys == [r[key] for r in recs]


def test_live_model_equals_bloomtrain_eval_on_the_saved_checkpoint(harness_run, tmp_path,
                                                                    capsys):
    """The step-6 record, from the training ranks' live parameters, against the command on the
    checkpoint saved right after: the same model, so the same numbers (fp32)."""
    cfg, *_ = harness_run
    out = tmp_path / "results.json"
    assert cli.main(["eval", "--checkpoint", cfg.checkpoint.dir, "--tasks", ",".join(GOOD),
                     "--include-path", cfg.train.eval_harness_include_path, "--limit", "4",
                     "--bootstrap-iters", "0", "--output", str(out)]) == 0
    capsys.readouterr()
    last = harness_records(cfg.run_dir)[-1]
    results = json.loads(out.read_text())["results"]
    for task in GOOD:
        for key, value in results[task].items():
            if key.endswith(",none") and isinstance(value, float) and "stderr" not in key:
                got = last[f"eval/{task}/{key.split(',')[0]}"]
                assert math.isclose(got, value, rel_tol=1e-6), (task, key, got, value)


def test_status_lists_four_tasks_and_counts_the_rest(tmp_path):
    """Rows for the first four tasks (alphabetical, stderrs left out), a count of the others:
    the screen stays within 80 x 24."""
    from bloomtrain.report.status import status_lines

    rec = {"step": 40, "consumed_samples": 320, "eval_harness_s": 3.0}
    for i in range(6):
        rec[f"eval/task{i}/acc"] = i / 10
        rec[f"eval/task{i}/acc_stderr"] = 0.01
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 40, "consumed_samples": 320, "loss": 2.0}) + "\n" +
        json.dumps(rec) + "\n")
    lines = status_lines(tmp_path)
    at = lines.index(next(line for line in lines if line.startswith("downstream")))
    assert lines[at].endswith("lm-eval at step 40")
    assert [line.split()[0] for line in lines[at + 1:at + 5]] == [f"task{i}" for i in range(4)]
    assert lines[at + 1].split()[1:] == ["acc", "0"] and "stderr" not in "".join(lines)
    assert lines[at + 5].strip() == "and 2 more task(s)"
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)


def test_config_errors_before_anything_starts(dataset, tiny_tokenizer_dir, tmp_path):
    cfg = make_cfg(dataset, tiny_tokenizer_dir, tmp_path, tasks=None, eval_harness_interval=5)
    with pytest.raises(UserError, match="need train.eval_harness_tasks"):
        Trainer(cfg)
    cfg = make_cfg(dataset, tiny_tokenizer_dir, tmp_path, tasks="choice_tiny")
    cfg.data.tokenizer = None
    with pytest.raises(UserError, match="needs data.tokenizer"):
        Trainer(cfg)


# ---- slow: parallel ranks, a malformed YAML --------------------------------------------------

def _train_rank(rank, world, cfg_dict, root):
    import tqdm
    tqdm.tqdm.monitor_interval = 0  # no monitor thread left behind in the pool's worker
    os.chdir(root)
    return train(Config.from_dict(cfg_dict), log=lambda *a: None).losses


@pytest.mark.parametrize("parallel", [
    {"tp": 2}, pytest.param({"zero_stage": 3}, marks=pytest.mark.slow, id="dp2-zero3")],
    ids=["tp2", "dp2-zero3"])
def test_parallel_training_ranks_evaluate_together(parallel, dataset, tiny_tokenizer_dir,
                                                   tmp_path, capsys):
    """Two ranks, each with its own shards: tp=2 (the harness's batches broadcast, the
    vocabulary reduced over the shards), or dp=2 under ZeRO-3 (both replicas run every
    forward, for the weight gathers). Training is the run's without the evaluation, bit for
    bit (every rank's generators restored: a tp attention draws from them even in eval, and
    rank 1 alone keeping its draws made the replicated dropout masks, then the replicated
    biases, differ between the tp ranks); the last record equals `bloomtrain eval` in one
    process on the checkpoint saved right after it."""
    include = task_dir(tmp_path, {})
    cfg = make_cfg(dataset, tiny_tokenizer_dir, tmp_path, tasks=",".join(GOOD),
                   include=include, parallel=parallel)
    losses = run_ranks(2, _train_rank, cfg.to_dict(), str(ROOT))
    plain = make_cfg(dataset, tiny_tokenizer_dir, tmp_path / "plain", tasks=None,
                     parallel=parallel)
    assert losses == run_ranks(2, _train_rank, plain.to_dict(), str(ROOT))
    recs = harness_records(cfg.run_dir)
    assert [r["step"] for r in recs] == [3, 6] and not any("alerts" in r for r in recs)
    out = tmp_path / "results.json"
    assert cli.main(["eval", "--checkpoint", cfg.checkpoint.dir, "--tasks", ",".join(GOOD),
                     "--include-path", str(include), "--limit", "4", "--bootstrap-iters", "0",
                     "--output", str(out)]) == 0
    capsys.readouterr()
    results = json.loads(out.read_text())["results"]
    for task in GOOD:
        for key, value in results[task].items():
            if key.endswith(",none") and isinstance(value, float) and "stderr" not in key:
                got = recs[-1][f"eval/{task}/{key.split(',')[0]}"]
                # tp=2 sums its partial products in another order: perplexities to 1e-5.
                assert math.isclose(got, value, rel_tol=1e-5), (task, key, got, value)


@pytest.mark.slow
def test_a_malformed_task_yaml_leaves_the_run_going(dataset, tiny_tokenizer_dir, tmp_path):
    include = task_dir(tmp_path, {"broken_tiny.yaml": "task: broken_tiny\noutput_type: [x\n"})
    cfg = make_cfg(dataset, tiny_tokenizer_dir, tmp_path, tasks="choice_tiny,broken_tiny",
                   include=include, eval_harness_interval=None)
    lines: list[str] = []
    result = train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert len(result.losses) == 6
    rec, = harness_records(cfg.run_dir)  # no interval: once, at the end
    assert "eval/choice_tiny/acc" in rec and rec["step"] == 6
    failure, = [line for line in lines if "broken_tiny failed" in line]
    assert "broken_tiny.yaml" in failure  # the file the harness skipped, with its YAML error
