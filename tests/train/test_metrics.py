"""run_dir/metrics.jsonl on resume (bloomtrain.train.metrics.MetricsLog)."""
import json

import pytest

from bloomtrain.errors import UserError
from bloomtrain.train.metrics import MetricsLog


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_a_resume_drops_a_last_line_cut_short_and_refuses_a_damaged_one(tmp_path):
    """A kill or a full disk in the middle of an append leaves a partial last line: a resume
    keeps the records up to its step and drops that line, saying so (it failed with a bare
    JSONDecodeError). A damaged line elsewhere is no crash's doing: named, with what to do."""
    records = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    _write(path, records + ['{"step": 4, "lo'])
    said = []
    MetricsLog(tmp_path, True, resume_step=2, log=said.append)
    assert path.read_text() == "".join(line + "\n" for line in records[:2])
    assert any("unfinished last line" in s for s in said)

    _write(path, records[:1] + ["garbage"] + records[1:])
    with pytest.raises(UserError, match="metrics.jsonl line 2 is not JSON"):
        MetricsLog(tmp_path, True, resume_step=2, log=said.append)
    assert "garbage" in path.read_text()  # left as it was


def test_a_resume_from_a_stop_drops_the_stop_it_resumes(tmp_path):
    """The record of a clean stop at step 2 said the run's state; resumed from that step, the
    run trains again, and `status` read "stopped" until the resumed run's first record. An
    earlier stop, resumed and trained past, stays in the history."""
    from bloomtrain.report.runs import load_run, summarize

    records = [{"step": 1, "loss": 1.0}, {"step": 1, "stopped": "signal"},
               {"step": 2, "loss": 0.5}, {"step": 2, "stopped": "exit_duration_minutes"}]
    path = tmp_path / "metrics.jsonl"
    _write(path, [json.dumps(r) for r in records])
    MetricsLog(tmp_path, True, resume_step=2, log=lambda *a: None)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    assert summarize(load_run(tmp_path)).stopped is None
