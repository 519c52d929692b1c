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
