"""Running the harness on rank 0: finding the tasks (`lm_eval.tasks.TaskManager`, with the
`--include-path` directories), `lm_eval.simple_evaluate` on a BloomtrainLM, and what becomes of
the results: the harness's results JSON and per-sample files, its table, and the flat
`eval/<task>/<metric>` numbers a training run records.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.utils import atomic_output


def find_tasks(tasks: list[str], include_paths: list[str] | tuple = ()):
    """(a TaskManager, {unknown task: why}). The include paths alone are indexed first (a
    fraction of a second); the harness's thousands of built-in task YAMLs (seconds to index)
    only when some task is not among them."""
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise UserError(f"include path {path} is not a directory of task YAMLs")
    if include_paths:
        manager = TaskManager(include_path=list(include_paths), include_defaults=False)
        if all(_known(manager, t) for t in tasks):
            return manager, {}
    manager = TaskManager(include_path=list(include_paths) or None)
    missing = [t for t in tasks if not _known(manager, t)]
    broken = unreadable_yamls(include_paths) if missing else []
    why = {}
    for t in missing:
        close = difflib.get_close_matches(t, manager.all_tasks, n=3)
        why[t] = (f"unknown task {t}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                  + (f"; the harness skipped YAMLs it could not read: {'; '.join(broken)}"
                     if broken else "" if include_paths else
                     "; give local task YAMLs with --include-path DIR"))
    return manager, why


def task_manager(tasks: list[str], include_paths: list[str] | tuple = ()):
    """A TaskManager that knows every one of `tasks`; a UserError saying why otherwise."""
    manager, unknown = find_tasks(tasks, include_paths)
    if unknown:
        raise UserError("; ".join(unknown.values()))
    return manager


def unreadable_yamls(include_paths) -> list[str]:
    """`path (error)` for each YAML under the include paths that the harness's own loader
    cannot read: its index leaves them out without a word."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for root in include_paths:
        for path in sorted(Path(root).glob("**/*.yaml")):
            try:
                load_yaml(path, resolve_func=False, recursive=True)
            except Exception as e:  # noqa: BLE001 - reported, whatever the parser raised
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                out.append(f"{path} ({first})")
    return out


def _known(manager, task: str) -> bool:
    return task in manager.all_tasks or (task.endswith(".yaml") and Path(task).is_file())


def evaluate(lm, tasks: list[str], manager, *, num_fewshot: int | None = None,
             limit: float | None = None, bootstrap_iters: int = 100000,
             log_samples: bool = False) -> dict:
    """The harness's results dict for `tasks` on `lm` (lm_eval.simple_evaluate)."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot,
                              limit=limit, bootstrap_iters=bootstrap_iters,
                              log_samples=log_samples, task_manager=manager,
                              batch_size=lm.batch_size)
    if results is None:  # only a rank other than the harness's rank 0 gets None
        raise RuntimeError("the harness returned no results on rank 0")
    return results


def write_results(results: dict, output: str | Path) -> list[Path]:
    """The results JSON at `output` (the harness's dict, its samples left out) and, when it
    logged samples, one `<output stem>_samples_<task>.jsonl` per task beside it, a line per
    document as the harness writes them. Returns the files written."""
    from lm_eval.utils import handle_non_serializable

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples") or {}
    body = {k: v for k, v in results.items() if k != "samples"}
    written = [output]
    with atomic_output(output, "w") as f:
        json.dump(body, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        f.write("\n")
    for task, docs in samples.items():
        path = output.with_name(f"{output.stem}_samples_{task}.jsonl")
        with atomic_output(path, "w") as f:
            for doc in docs:
                f.write(json.dumps(doc, default=handle_non_serializable, ensure_ascii=False)
                        + "\n")
        written.append(path)
    return written


def results_table(results: dict) -> str:
    """The harness's Markdown table of the results (and of the groups, if any)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def metric_values(results: dict) -> dict[str, float]:
    """`eval/<task>/<metric>` -> value for every numeric result (stderrs included, "N/A"
    ones not; an overflowed perplexity stays inf, as metrics.jsonl writes a skipped step's
    grad norm). The harness names a metric `name,filter`; the filter is kept, after an
    underscore, unless it is `none`, the filter of every loglikelihood task."""
    out = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            out[f"eval/{task}/{name if filt in ('', 'none') else f'{name}_{filt}'}"] = \
                float(value)
    return out
