"""Running the harness on rank 0: finding the tasks (`lm_eval.tasks.TaskManager`, with the
`--include-path` directories), `lm_eval.simple_evaluate` on a BloomtrainLM, and what becomes of
the results: the harness's results JSON and per-sample files, its table, and the flat
`eval/<task>/<metric>` numbers a training run records.

A task's local data (`dataset_kwargs.data_files`, a local `dataset_path`) is found relative to
its task file, so that task directories work from any directory; the harness itself (HF
datasets' rule) reads them relative to the current directory, which stays the fallback.
"""
from __future__ import annotations

import difflib
import functools
import glob
import json
import os
import re
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output


def find_tasks(tasks: list[str], include_paths: list[str] | tuple = ()):
    """(a TaskManager, {unknown task: why}). The include paths alone are indexed first (a
    fraction of a second); the harness's thousands of built-in task YAMLs (seconds to index)
    only when some task is not among them."""
    check_include_paths(include_paths)
    if include_paths:
        manager = _manager(include_paths, include_defaults=False)
        if all(_known(manager, t) for t in tasks):
            return manager, {}
    manager = _manager(include_paths)
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


def check_include_paths(include_paths) -> None:
    for path in include_paths:
        if not Path(path).is_dir():
            where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()})"
            raise UserError(f"include path {path} is not a directory of task YAMLs{where}")


def check_task_data(tasks: list[str], include_paths) -> None:
    """A UserError now, before any model loads, for a task of the include paths (or a task
    YAML given by path) whose data files are missing."""
    from lm_eval.tasks._yaml_loader import load_yaml

    check_include_paths(include_paths)
    index = _manager(include_paths, include_defaults=False).task_index if include_paths else {}
    for task in tasks:
        entry = index.get(task)
        path = entry.yaml_path if entry is not None else (
            Path(task) if task.endswith(".yaml") and Path(task).is_file() else None)
        if path is None:
            continue  # a harness task, or a group: its tasks' data are checked as they load
        try:
            config = load_yaml(path, resolve_func=False, recursive=True)
        except Exception as e:  # noqa: BLE001 - whatever the parser raised
            if entry is not None:
                continue  # find_tasks reports the include paths' unreadable YAMLs
            raise UserError(f"task file {path} cannot be read: {one_line(e)}") from None
        if isinstance(config, dict):
            check_output_type(config, path)
            resolve_data_paths(config, path)


OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until", "multiple_choice")


def check_output_type(config: dict, path) -> None:
    """The harness refuses any other output_type only once the model has loaded, with a
    traceback."""
    kind = config.get("output_type")
    if kind is not None and kind not in OUTPUT_TYPES:
        raise UserError(f"task file {path}: output_type {kind!r} is not one of "
                        f"{', '.join(OUTPUT_TYPES)}")


def _manager(include_paths, include_defaults: bool = True):
    """A TaskManager over `include_paths` (and the harness's own tasks) whose tasks read their
    local data files relative to their task files."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=list(include_paths) or None,
                          include_defaults=include_defaults)
    factory = getattr(manager, "_factory", None)  # lm-eval 0.4.13's; left as it is elsewhere
    if factory is not None and hasattr(factory, "_load_full_config"):
        manager._factory = _file_relative_factory()(meta=manager.metadata)
    return manager


@functools.cache
def _file_relative_factory():
    """lm-eval's TaskFactory, with each task's config given absolute data paths (against its
    YAML) before the task loads its dataset."""
    from lm_eval.tasks._factory import TaskFactory

    class FileRelativeFactory(TaskFactory):
        def _load_full_config(self, entry, overrides=None):
            config = super()._load_full_config(entry, overrides)
            if entry.yaml_path is not None:
                resolve_data_paths(config, entry.yaml_path)
            return config

    return FileRelativeFactory


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def resolve_data_paths(config: dict, task_file) -> dict:
    """`config` (a task's, as loaded from `task_file`) with every relative local path of
    `dataset_kwargs.data_files` (a string, a list, or a split -> string or list mapping; glob
    patterns too) made absolute against the task file's directory, and `dataset_path` too when
    it names a file or directory there. A path found only relative to the current directory
    (the harness's rule) is left as it is; one found in neither raises a one-line UserError.
    Changes `config` in place and returns it."""
    base = Path(os.path.abspath(task_file)).parent
    task = config.get("task", Path(task_file).stem)
    dataset_path = config.get("dataset_path")
    if (isinstance(dataset_path, str) and dataset_path and not _URL.match(dataset_path)
            and not Path(dataset_path).is_absolute() and (base / dataset_path).exists()):
        config["dataset_path"] = str(base / dataset_path)
    kwargs = config.get("dataset_kwargs")
    if not isinstance(kwargs, dict) or kwargs.get("data_files") is None:
        return config

    def locate(path):
        if not isinstance(path, str) or _URL.match(path):
            return path
        if Path(path).is_absolute():
            if _exists(Path(path)):
                return _nonempty(path, task)
            raise UserError(f"task {task}: data file {path} not found")
        beside = base / path
        if _exists(beside):
            return _nonempty(str(beside), task)
        if _exists(Path(path)):
            return _nonempty(path, task)
        raise UserError(f"task {task}: data file {path} not found: data_files are relative to "
                        f"the task file's directory {base} (or else to the current directory, "
                        f"{os.getcwd()})")

    def each(value):
        if isinstance(value, dict):
            return {k: each(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [locate(v) for v in value]
        return locate(value)

    kwargs["data_files"] = each(kwargs["data_files"])
    return config


def one_line(error: BaseException) -> str:
    """An exception's message on one line: its first line, or its type when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _nonempty(path: str, task: str) -> str:
    """`path`, unless it is a file with nothing but whitespace: the datasets library then
    fails deep in its builder (a StopIteration traceback), after the model has loaded."""
    p = Path(path)
    if p.is_file() and p.stat().st_size < (1 << 20):
        with open(p, "rb") as f:
            if not f.read().strip():
                raise UserError(f"task {task}: data file {path} is empty")
    return path


def _exists(path: Path) -> bool:
    return bool(glob.glob(str(path))) if glob.has_magic(str(path)) else path.exists()


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
                out.append(f"{path} ({one_line(e)})")
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
