"""Seeing a run: `bloomtrain plot` (PNG panels and report.html, several runs overlaid) and
`bloomtrain status` (one text screen), both read from run directories (metrics.jsonl and
config.yaml as bloomtrain.train writes them).

Modules: `runs` (reading and summarizing a run dir), `plot` (matplotlib panels; matplotlib is
the optional `plot` extra, imported only when drawing), `html` (report.html and
`write_report`), `status` (the status screen), `cli` (both commands).
"""
from bloomtrain.report.html import render_html, write_report
from bloomtrain.report.runs import Run, Summary, load_run, load_runs, run_labels, summarize
from bloomtrain.report.status import status_text

__all__ = ["Run", "Summary", "load_run", "load_runs", "render_html", "run_labels",
           "status_text", "summarize", "write_report"]
