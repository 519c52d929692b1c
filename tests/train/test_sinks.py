"""metrics.jsonl's mirrors and the progress line: TensorBoard event files read back with
TensorBoard's own reader, a W&B run through a fake `wandb` module (the package is optional and
not installed here), the UserErrors when a required package is missing, the ETA, and the
progress line redrawn in place on a terminal but one line per record elsewhere."""
from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import pytest

from bloomtrain.config import UserError
from bloomtrain.train import Trainer, train
from bloomtrain.train.metrics import Console, MetricsLog, progress_line
from tests.helpers import make_cfg, metrics

# Tiny models: one intra-op thread keeps them quick on a shared machine (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

CLEAR = "\r\x1b[2K"


def quiet(*_):
    pass


def tensorboard_run(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def expected_scalars(rec: dict, prefix: str = "") -> dict[str, float]:
    """The contract, restated: numeric fields (booleans and strings are not), nested dicts
    flattened with '/' and lists indexed, the top-level step as the x axis."""
    out = {}
    for key, val in rec.items():
        if isinstance(val, dict):
            out.update(expected_scalars(val, f"{prefix}{key}/"))
        elif isinstance(val, list):
            out.update(expected_scalars(dict(enumerate(val)), f"{prefix}{key}/"))
        elif type(val) in (int, float) and f"{prefix}{key}" != "step":
            out[f"{prefix}{key}"] = val
    return out


def assert_mirrors(ea, records: list[dict]) -> None:
    """Every numeric field of every record is a scalar at the record's step, and a tag has one
    value per step (an eval record repeats its step's consumed_samples, with the same value)."""
    series = {tag: ea.Scalars(tag) for tag in ea.Tags()["scalars"]}
    for tag, events in series.items():
        points = {(e.step, e.value) for e in events}
        assert len(points) == len({step for step, _ in points}), (tag, sorted(points))
    for rec in records:
        for tag, value in expected_scalars(rec).items():
            at = {e.step: e.value for e in series[tag]}
            assert at[rec["step"]] == pytest.approx(value, rel=1e-6, nan_ok=True), (tag, rec)


def raw_points(log_dir: Path) -> dict[tuple[str, int], list[float]]:
    """Each (tag, step) scalar's values in the event files, read without any loader's purging:
    what TensorBoard's Rust data server (its default) shows."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util
    out: dict[tuple[str, int], list[float]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    out.setdefault((v.tag, event.step), []).append(
                        float(tensor_util.make_ndarray(v.tensor)))
    return out


def one_point_each(raw) -> bool:
    # An eval record repeats its step's consumed_samples, with the same value.
    return all(len(v) == 1 or (tag == "consumed_samples" and len(set(v)) == 1)
               for (tag, _), v in raw.items())


def config_texts(ea) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode())
            for e in ea.Tensors("config/text_summary")]


class FakeWandb(types.ModuleType):
    """Records what bloomtrain asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, dict(data)))

            def finish(self):
                fake.finished += 1
        return Run()


def test_tensorboard_and_wandb_mirror_every_record_and_resume_replaces(dataset, tmp_path,
                                                                       monkeypatch):
    # Run A logs every step, evaluates at 3 and 6 and saves at 3; run B resumes from step 3 with
    # another lr, so steps 4-6 run again with different values. TensorBoard must show each step
    # once, with run B's values.
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    over = dict(train__eval_interval=3, train__eval_iters=1,
                checkpoint={"dir": str(tmp_path / "ck"), "save_interval": 3, "keep_last": None,
                            "async_save": False})
    run_dir, tb = tmp_path / "run", tmp_path / "run" / "tensorboard"
    lines = []
    train(make_cfg(dataset, tmp_path, run__wandb="proj", **over), log=lines.append)
    first = metrics(run_dir)
    assert [r["step"] for r in first] == [1, 2, 3, 3, 4, 5, 6, 6]
    assert "eval_ppl" in first[3]
    # The first lines say where the logs are and how to view them.
    assert f"[train] TensorBoard: tensorboard --logdir {tb}" in lines[:6]
    assert any(line.startswith("[train] W&B: offline run in") for line in lines[:6])
    # Not a terminal: one plain progress line per record, with the ETA (steps left x step time).
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 6 and all(" | ETA " in line for line in progress)
    for rec in (r for r in first if "loss" in r):
        assert rec["eta_s"] == pytest.approx((6 - rec["step"]) * rec["step_time_s"])
    ea = tensorboard_run(tb)
    assert_mirrors(ea, first)
    [(step, text)] = config_texts(ea)
    assert step == 1 and "    train_iters: 6\n" in text and "    lr: 0.001\n" in text
    # W&B: one offline run under run_dir/wandb, every record's scalars at its step, finished.
    [init] = fake.inits
    assert (init["project"], init["mode"], init["dir"]) == ("proj", "offline", str(run_dir))
    assert init["config"]["train"]["train_iters"] == 6
    assert fake.logged == [(r["step"], expected_scalars(r)) for r in first]
    assert fake.finished == 1

    # (another schedule on purpose: optim.override_schedule, Megatron's --override-lr-scheduler)
    train(make_cfg(dataset, tmp_path, optim__lr=5e-4, optim__override_schedule=True,
                   run={"tensorboard": True, "wandb": "proj"},
                   checkpoint={**over["checkpoint"], "resume": str(tmp_path / "ck" /
                                                                "step_00000003")},
                   **{k: v for k, v in over.items() if k != "checkpoint"}), log=quiet)
    second = metrics(run_dir)
    assert [r["step"] for r in second] == [r["step"] for r in first]
    assert second[:4] == first[:4] and second[4]["lr"] != first[4]["lr"]
    ea = tensorboard_run(tb)
    assert_mirrors(ea, second)
    assert [e.step for e in ea.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in ea.Scalars("eval_loss")] == [3, 6]
    # In the files themselves too: purge_step, which only the old Python loader honoured,
    # left steps 4-6 of run A beside run B's for TensorBoard's default (Rust) loader.
    raw = raw_points(tb)
    assert len(raw[("loss", 4)]) == 1 and len(raw[("eval_loss", 6)]) == 1 and one_point_each(raw)
    assert [(s, "    lr: 0.0005\n" in t) for s, t in config_texts(ea)] == [(1, False), (4, True)]
    # A resumed start is a second W&B run, from the step after its checkpoint.
    assert fake.inits[1]["name"] == "run@3"
    assert [step for step, _ in fake.logged[len(first):]] == [4, 5, 6, 6]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_progress_in_place_then_tensorboard_backfilled_on_resume(dataset, tmp_path,
                                                                          monkeypatch):
    # On a terminal (print to a TTY stdout) the progress line is redrawn in place, and ended
    # before any other line and at the end. run.tensorboard=false writes no event file.
    monkeypatch.setenv("COLUMNS", "400")
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", term)
    ck = {"dir": str(tmp_path / "ck"), "save_interval": 2, "keep_last": None,
          "async_save": False}
    train(make_cfg(dataset, tmp_path, train__train_iters=4, run__tensorboard=False,
                   checkpoint=ck))
    monkeypatch.undo()
    out = term.getvalue()
    assert out.endswith("\n")
    rows = out.split("\n")
    redrawn = [row for row in rows if CLEAR in row]
    # One terminal row for steps 1-2, another for 3-4 (the save at 2 printed a line between).
    assert [len(row.split(CLEAR)) - 1 for row in redrawn] == [2, 2]
    assert all(row.startswith(CLEAR) and all(part.startswith("step ") and " | ETA " in part
                                             for part in row.split(CLEAR)[1:])
               for row in redrawn)
    for row in redrawn:
        assert rows[rows.index(row) + 1].startswith("[checkpoint] saved")
    assert rows[-2].startswith("[eval] step 4") and rows[-1] == ""
    assert not (tmp_path / "run" / "tensorboard").exists()

    # Resumed with TensorBoard on: the steps before the checkpoint come over from metrics.jsonl.
    train(make_cfg(dataset, tmp_path, train__train_iters=4, run__tensorboard=True,
                   checkpoint={**ck, "resume": str(tmp_path / "ck" / "step_00000002")}),
          log=quiet)
    recs = metrics(tmp_path / "run")
    ea = tensorboard_run(tmp_path / "run" / "tensorboard")
    assert_mirrors(ea, recs)
    assert [e.step for e in ea.Scalars("loss")] == [1, 2, 3, 4]
    # Off again for a stretch, then on: the stretch's steps came over only when no event file
    # was there at all, so 5-6 were never in TensorBoard.
    train(make_cfg(dataset, tmp_path, train__train_iters=6, run__tensorboard=False,
                   checkpoint={**ck, "resume": str(tmp_path / "ck" / "step_00000004")}),
          log=quiet)
    train(make_cfg(dataset, tmp_path, train__train_iters=8, run__tensorboard=True,
                   checkpoint={**ck, "resume": str(tmp_path / "ck" / "step_00000006")}),
          log=quiet)
    recs = metrics(tmp_path / "run")
    assert_mirrors(tensorboard_run(tmp_path / "run" / "tensorboard"), recs)
    raw = raw_points(tmp_path / "run" / "tensorboard")
    assert sorted(step for tag, step in raw if tag == "loss") == list(range(1, 9))
    assert one_point_each(raw)


def test_required_sink_without_its_package_is_a_user_error(dataset, tmp_path, monkeypatch):
    # A None in sys.modules makes `import` fail as for a package that is not installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"pip install bloomtrain\[tensorboard\]"):
        Trainer(make_cfg(dataset, tmp_path, run__tensorboard=True), log=quiet)
    # Every rank refuses, not only the one that would write.
    cfg = make_cfg(dataset, tmp_path, run__tensorboard=False, run__wandb="proj")
    for enabled in (True, False):
        with pytest.raises(UserError, match="pip install wandb"):
            MetricsLog(tmp_path / "m", enabled, None, cfg=cfg)
    # run.tensorboard unset: no TensorBoard, and a note on how to get it.
    log = MetricsLog(tmp_path / "m", True, None, cfg=make_cfg(dataset, tmp_path))
    assert log.sinks == [] and "pip install bloomtrain[tensorboard]" in log.where()[-1]


def test_nested_fields_eta_and_progress_line(dataset, tmp_path):
    cfg = make_cfg(dataset, tmp_path, run__tensorboard=True)
    log = MetricsLog(tmp_path / "run", True, None, cfg=cfg, train_samples=100)
    rec = {"step": 3, "consumed_samples": 24, "loss": 2.0, "lr": 1e-4, "grad_norm": 0.5,
           "global_batch_size": 8, "step_time_s": 2.0, "tokens_per_s": 10.0,
           "tflops_per_device": 0.1, "skipped": True, "layout": "tp=2",
           "comm": {"all_reduce/tp": {"bytes": 4096, "calls": 2}}, "block_grad_norm": [0.5, 0.25]}
    log.record(rec)
    log.close()
    # 76 samples left at 8 a step: 9 steps; a partial last batch is not trained (Megatron's
    # update_train_iters floors).
    assert rec["eta_s"] == (76 // 8) * 2.0
    ea = tensorboard_run(tmp_path / "run" / "tensorboard")
    assert_mirrors(ea, metrics(tmp_path / "run"))
    assert {"comm/all_reduce/tp/bytes", "comm/all_reduce/tp/calls", "block_grad_norm/1",
            "eta_s"} <= set(ea.Tags()["scalars"])
    assert not {"step", "skipped", "layout"} & set(ea.Tags()["scalars"])
    assert progress_line(rec).endswith("0.100 TFLOP/s/dev | ETA 0:00:18")
    rec["eta_s"] = 2 * 3600 + 61.4
    assert progress_line(rec).endswith("| ETA 2:01:01")
    del rec["eta_s"]
    assert progress_line(rec).endswith("TFLOP/s/dev")


@pytest.mark.parametrize("tty", [True, False])
def test_console_redraws_only_on_a_terminal(tty, monkeypatch):
    monkeypatch.setenv("COLUMNS", "12")
    stream = FakeTerminal() if tty else io.StringIO()
    console = Console(lambda *a: print(*a, file=stream), stream)
    console.progress("step 1 | loss 2.0")
    console.progress("step 2")
    console.line("[checkpoint] saved")
    console.progress("step 3")
    console.close()
    console.close()
    if tty:  # cut to the terminal's width less one, so that it never wraps
        assert stream.getvalue() == (f"{CLEAR}step 1 | lo{CLEAR}step 2\n[checkpoint] saved\n"
                                     f"{CLEAR}step 3\n")
    else:
        assert stream.getvalue() == "step 1 | loss 2.0\nstep 2\n[checkpoint] saved\nstep 3\n"
