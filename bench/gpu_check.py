"""The one GPU check: bench/gpu.sh's driver. Run it whenever a GPU is available; it fits in 8
minutes on one H200 and leaves one JSON file and a readable summary.

    bench/gpu.sh                       # on a CUDA machine: bench/results/gpu-<date>.json + .md
    bench/gpu.sh --out /tmp/gpu.json   # elsewhere
    bench/gpu.sh --only largest_fit    # rerun some sections (name substrings, comma-separated)
    bench/gpu.sh --cpu-smoke           # the same sections on the CPU, tiny shapes (its test:
                                       # tests/infra/test_gpu_script.py; bloom-7b1's are the tiny
                                       # shape at micro-batch 1)

Sections, in this order (each a subprocess with its own timeout, all under one `--budget`):
1. `tests`: the single-process tests marked `device` (models, optimizer, generation, HF parity),
   `python -m pytest -m device --device cuda tests`.
2. `throughput/<preset>/eager-sdpa`: bench/step_throughput.py at bloom-560m and bloom-1b7, seq
   2048, bf16: tokens/s, Megatron-formula TFLOP/s and MFU against 989 TFLOP/s (dense bf16), and
   HF transformers (AdamW, bf16 autocast) on the same GPU, alternating with bloomtrain; every
   later variant of the preset is compared with that HF figure.
3. `profile/<preset>`: bench/profile_step.py, one eager SDPA step at the throughput shapes
   under torch.profiler, its GPU time in categories (GEMM, attention, LayerNorm, the loss,
   elementwise, optimizer, copies, communication, idle) and the 15 largest kernels.
4. `fusions`: bench/fusions.py at bloom-1b7's block (seq 2048, micro-batch 2, bf16): LayerNorm,
   bias-GeLU, bias-dropout-add and a whole block, eager against compiled, forward and backward:
   kernels per call and time (issue 38: keep the fusions that pay).
5. `serve`: bench/serve_gpu.py, the serving engine against HF `generate` (64 concurrent prompts,
   one alone, the decode step, fp32 checks) on a random-init bloom-560m shape, with decode CUDA
   graphs (the default) and with --enforce-eager.
6. `throughput/<preset>/compile-flex`: torch.compile with FlexAttention, the same shapes.
7. `recompute_memory`: bench/recompute_memory.py, peak memory with none/selective/full
   activation recomputation at bloom-1b7, with SDPA (whose kernel selective recompute keeps; a
   compiled FlexAttention call is opaque to the selective-checkpoint policy, so under flex
   selective recomputes the attention core too).
8. `throughput/bloom-7b1/eager-sdpa-zero1-offload-<full|selective>`: bench/step_throughput.py at
   bloom-7b1, micro-batch 1, seq 2048, ZeRO-1 with the optimizer offloaded (on one GPU its model
   states leave no room otherwise), full and selective recompute, no HF side; one warmup step and
   two timed (the host's AdamW makes a step ~14 s), so both fit in the budget (issue 38).
9. `largest_fit`: bench/largest_fit.py, the largest preset that trains a step on this GPU, with
   and without ZeRO-Offload; its budget is what is left.
Four throughput variants (eager-flex and compile-sdpa of each preset) come last: they are the
first to go when the budget runs out. One of each kind of figure comes before the compiled
variants (the slowest to start) for the same reason. With more device time than the default
budget, pass `--budget`; `--only` reruns what a run skipped.

A section is ok when its command exits 0 and ends with its JSON line (pytest: its JUnit XML);
otherwise it is recorded as failed with the end of its output, and the next section runs. A
section that would start with too little budget left is recorded as skipped. The JSON holds
every section's command, status, wall time, error, its figures and the bench's whole JSON
line; each section's full output is kept in `<out>.logs/`. Exit status: 1 if a section failed
(in `--cpu-smoke`, also if one was skipped), else 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CUDA_PEAK_TFLOPS = 989.0
# A section is not started with less than this left: it could not finish, and a half-run
# section says less than a skipped one.
MIN_START_S = 20
# After a section's timeout: how long it has to stop after SIGINT before SIGKILL.
INTERRUPT_GRACE_S = 10


@dataclass
class Section:
    name: str
    kind: str  # tests | throughput | profile | fusions | serve | recompute_memory | largest_fit
    cmd: list[str]
    timeout_s: float
    meta: dict = field(default_factory=dict)
    # Given `--budget <its timeout less a margin>` so that it reports what it has in time.
    budgeted: bool = False


def _throughput(preset_args, label, variant, timeout, with_hf, extra) -> Section:
    compiled, attention = variant.split("-")
    cmd = [PY, "bench/step_throughput.py", *preset_args, "--attention", attention, *extra]
    if compiled == "compile":
        cmd.append("--compile")
    if not with_hf:
        cmd.append("--skip-hf")
    return Section(f"throughput/{label}/{variant}", "throughput", cmd, timeout,
                   {"preset": label, "variant": variant, "with_hf": with_hf})


def _big_throughput(shape, label, recompute, timeout, timing) -> Section:
    """One process training a model near the device's limit (bloom-7b1 on one GPU): ZeRO-1 with
    the optimizer offloaded, eager SDPA, no HF side, one recompute mode."""
    variant = f"eager-sdpa-zero1-offload-{recompute}"
    cmd = [PY, "bench/step_throughput.py", *shape, "--attention", "sdpa", "--zero-stage", "1",
           "--offload-optimizer", "--activation-checkpointing", recompute, "--skip-hf", *timing]
    return Section(f"throughput/{label}/{variant}", "throughput", cmd, timeout,
                   {"preset": label, "variant": variant, "with_hf": False, "compare_hf": False})


def plan(args) -> list[Section]:
    """The sections in run order: GPU shapes, or tiny CPU ones with --cpu-smoke."""
    if args.cpu_smoke:
        dev, timing = "cpu", ["--warmup", "1", "--rounds", "2", "--steps", "2", "--device", "cpu"]
        tests = ["tests/model/test_model.py"]  # the mechanism, not the suite: that runs in CI anyway
        shapes = {"tiny": ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
                           "--seq", "32", "--micro-batch", "2"]}
        # FlexAttention has no CPU backward in torch 2.13: the smoke run compiles SDPA.
        first, later = ["eager-sdpa", "compile-sdpa"], []
        recompute = ["--preset", "tiny", "--seq", "32", "--micro-batch", "2"]
        fit = ["--presets", "bloom-176b,tiny", "--seq", "32", "--micro-batch", "2",
               "--try-timeout", "60"]
        serve = ["--cpu-smoke"]
        fusions = ["--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch", "2",
                   "--rounds", "1", "--steps", "1", "--warmup", "1"]
        big = {"tiny": shapes["tiny"][:-1] + ["1"]}  # micro-batch 1
        big_timing = ["--warmup", "1", "--rounds", "1", "--steps", "1", "--device", "cpu"]
        timeouts = {"tests": 90, "eager": 150, "compile": 200, "recompute": 60, "fit": 60,
                    "profile": 90, "serve": 150, "big": 90, "fusions": 120}
    else:
        dev, timing = "cuda", ["--warmup", "2", "--rounds", "2", "--steps", "3",
                               "--device", "cuda", "--peak-tflops", str(CUDA_PEAK_TFLOPS)]
        tests = ["tests"]
        # Micro-batches that keep bloomtrain and HF (fp32 weights + AdamW) on one H200 at once.
        shapes = {p: ["--preset", p, "--seq", "2048", "--micro-batch", mbs]
                  for p, mbs in (("bloom-560m", "4"), ("bloom-1b7", "2"))}
        first, later = ["eager-sdpa", "compile-flex"], ["eager-flex", "compile-sdpa"]
        recompute = ["--preset", "bloom-1b7", "--seq", "2048",
                     "--micro-batch", str(args.recompute_micro_batch)]
        fit = ["--seq", "2048", "--micro-batch", "1", "--try-timeout", "150"]
        serve = []
        # One layer of bloom-1b7 at the throughput shape; dropout 0, as BLOOM trained.
        fusions = ["--preset", "bloom-1b7", "--seq", "2048", "--micro-batch", "2",
                   "--dropout", "0"]
        # bloom-7b1 at micro-batch 1 (issue 38): one process holds all its model states, so
        # ZeRO-1 shards nothing, and those states (bf16 weights and gradients, fp32 master,
        # accumulator and Adam moments: 127 GB) leave an H200 no room; the planner puts full
        # recompute at 141 GiB on the device, with the optimizer offloaded at 56 GiB and a
        # 14 s step (the host's AdamW). Hence three steps: warmup, two timed.
        big = {"bloom-7b1": ["--preset", "bloom-7b1", "--seq", "2048", "--micro-batch", "1"]}
        big_timing = ["--warmup", "1", "--rounds", "1", "--steps", "2", "--device", "cuda",
                      "--peak-tflops", str(CUDA_PEAK_TFLOPS)]
        timeouts = {"tests": 240, "eager": 150, "compile": 210, "recompute": 150, "fit": 330,
                    "profile": 90, "serve": 240, "big": 150, "fusions": 90}
    junit = str(args.logs / "pytest.xml")
    sections = [Section("tests", "tests",
                        [PY, "-m", "pytest", "-q", "-m", "device", "--device", dev,
                         "-p", "no:cacheprovider", f"--junitxml={junit}", *tests],
                        timeouts["tests"], {"junit": junit})]
    # Each preset's first variant (with the HF side), then the profiles and serving, then the
    # second variants: one of each kind of figure comes before the budget (which the compiled
    # variants, the slowest to start, can use up) runs short.
    for label, shape in shapes.items():
        sections.append(_throughput(shape, label, first[0], timeouts[first[0].split("-")[0]],
                                    True, timing))
    # Where a step's time goes, at the throughput section's shapes (eager, SDPA): the table
    # every later GPU run starts from.
    for label, shape in shapes.items():
        sections.append(Section(f"profile/{label}", "profile",
                                [PY, "bench/profile_step.py", *shape, "--attention", "sdpa",
                                 "--device", dev],
                                timeouts["profile"], {"preset": label}))
    sections.append(Section("fusions", "fusions",
                            [PY, "bench/fusions.py", *fusions, "--device", dev],
                            timeouts["fusions"]))
    sections.append(Section("serve", "serve", [PY, "bench/serve_gpu.py", *serve],
                            timeouts["serve"]))
    for label, shape in shapes.items():
        for variant in first[1:]:
            sections.append(_throughput(shape, label, variant,
                                        timeouts[variant.split("-")[0]], False, timing))
    sections.append(Section("recompute_memory", "recompute_memory",
                            [PY, "bench/recompute_memory.py", *recompute, "--device", dev,
                             "--attention", "sdpa", "--modes", "none,selective,full"],
                            timeouts["recompute"]))
    # Before largest_fit, whose budget shrinks to what is left (it tries bloom-7b1 too).
    for label, shape in big.items():
        for recompute in ("full", "selective"):
            sections.append(_big_throughput(shape, label, recompute, timeouts["big"],
                                            big_timing))
    sections.append(Section("largest_fit", "largest_fit",
                            [PY, "bench/largest_fit.py", "--device", dev, *fit], timeouts["fit"],
                            budgeted=True))
    for label, shape in shapes.items():
        for variant in later:
            sections.append(_throughput(shape, label, variant,
                                        timeouts[variant.split("-")[0]], False, timing))
    return sections


def last_json(text: str) -> dict | None:
    """The bench's result: its last line that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def junit_counts(path: str) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**n, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "time_s": float(suite.get("time", 0.0))}


def run_command(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run `cmd` from the repository root with its output in `log`. On timeout the whole process
    group is interrupted, then killed (a bench's own subprocesses and compile workers too).
    Returns (exit status or None on timeout, seconds)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # An interrupt first: pytest still writes its JUnit XML (the tests that ran count),
            # and a bench can say where it was. Then the whole group, compile workers too.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return rc, time.perf_counter() - t0


def run_section(sec: Section, seconds_left: float, logs: Path) -> dict:
    rec = {"name": sec.name, "kind": sec.kind, **sec.meta, "cmd": " ".join(sec.cmd),
           "status": "skipped", "error": None, "figures": {}, "result": None}
    if seconds_left < MIN_START_S:
        rec["error"] = f"budget: {seconds_left:.0f} s left, {MIN_START_S} s needed to start"
        return rec
    timeout = min(sec.timeout_s, seconds_left)
    cmd = sec.cmd + (["--budget", f"{max(timeout - 15, 1):.0f}"] if sec.budgeted else [])
    rec["cmd"] = " ".join(cmd)
    log = logs / (sec.name.replace("/", "__") + ".log")
    if sec.kind == "tests":  # a rerun's XML only: an earlier run's must not stand in for it
        Path(sec.meta["junit"]).unlink(missing_ok=True)
    rc, wall = run_command(cmd, timeout, log)
    text = log.read_text(errors="replace")
    result = junit_counts(sec.meta["junit"]) if sec.kind == "tests" else last_json(text)
    rec.update(log=str(log), wall_s=round(wall, 1), returncode=rc, result=result)
    tail = " | ".join(ln for ln in text.strip().splitlines()[-6:])[-800:]
    if rc is None:
        rec.update(status="failed", error=f"timeout after {timeout:.0f} s; output ends: {tail}")
    elif rc != 0 or result is None:
        why = (f"exit status {rc}" if rc else
               "no JUnit XML" if sec.kind == "tests" else "no JSON result line")
        rec.update(status="failed", error=f"{why}; output ends: {tail}")
    elif sec.kind == "tests" and result["tests"] == 0:
        rec.update(status="failed", error="no test was selected")
    else:
        rec["status"] = "ok"
    if result is not None:
        rec["figures"] = FIGURES[sec.kind](result)
    return rec


# ---- figures: the few numbers of each section that the summary shows -------------------------

def _throughput_figures(r: dict) -> dict:
    ours, hf = r.get("bloomtrain", {}), r.get("hf", {})
    return {"tokens_per_s": ours.get("tokens_per_s"), "tflops": ours.get("tflops"),
            "mfu": ours.get("mfu"), "peak_fraction": ours.get("peak_fraction"),
            "matmul_peak_tflops": r.get("matmul_peak_tflops"),
            "mfu_peak_tflops": r.get("mfu_peak_tflops"),
            "attention": ours.get("attention"),
            # bloomtrain's own peak where the sides ran apart (an 80 GB device), else both's.
            "peak_memory_gb": ours.get("peak_memory_gb", r.get("peak_memory_gb")),
            "sides": r.get("sides"),
            "hf_tokens_per_s": hf.get("tokens_per_s"), "hf_tflops": hf.get("tflops"),
            "hf_mfu": hf.get("mfu"), "hf_attention": hf.get("attention"),
            "ratio_vs_hf": r.get("ratio")}


def _numeric_leaves(obj, path: str = "") -> dict:
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, (int, float)):
        return {path: obj}
    items = (obj.items() if isinstance(obj, dict) else
             enumerate(obj) if isinstance(obj, list) else ())
    out = {}
    for k, v in items:
        # list entries that name themselves (e.g. {"mode": "full", ...}) are keyed by that name
        key = v.get("mode", k) if isinstance(v, dict) else k
        out.update(_numeric_leaves(v, f"{path}.{key}" if path else str(key)))
    return out


RECOMPUTE_MODES = ("none", "selective", "full")


def _recompute_figures(r: dict) -> dict:
    """recompute_memory.py's per-mode memory and time figures, keyed `<mode>.<figure>`."""
    out = {}
    for path, v in _numeric_leaves(r).items():
        parts = path.split(".")
        mode = next((m for m in RECOMPUTE_MODES if m in parts), None)
        if mode and any(w in parts[-1] for w in ("peak", "activation", "step")):
            out[f"{mode}.{parts[-1]}"] = v
    return out


def _recompute_table(figures: dict) -> list[str]:
    metrics = list(dict.fromkeys(k.split(".", 1)[1] for k in figures))
    lines = ["| mode | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for mode in RECOMPUTE_MODES:
        lines.append(f"| {mode} | " + " | ".join(_fmt(figures.get(f"{mode}.{m}"))
                                                 for m in metrics) + " |")
    return lines


def _largest_fit_figures(r: dict) -> dict:
    out = {}
    for mode in ("no_offload", "offload"):
        found = r.get(mode) or {}
        tries = found.get("tries") or []
        fit = [t for t in tries if t.get("ok")]
        out.update({f"{mode}_largest": found.get("largest"), f"{mode}_params": found.get("params"),
                    f"{mode}_peak_memory_gb": found.get("peak_memory_gb"),
                    f"{mode}_step_s": fit[0].get("step_s") if fit else None,
                    # which memory each failed try ran out of (host or device; None: not memory)
                    f"{mode}_failed": {t["preset"]: t.get("oom") for t in tries
                                       if not t.get("ok") and "skipped" not in t}})
    out["device_memory_gb"] = r.get("device_memory_gb")
    return out


def _profile_figures(r: dict) -> dict:
    """The step's milliseconds and each category's share (bench/profile_step.py)."""
    out = {"step_ms": r.get("wall_ms")}
    out.update({f"{c}_share": v.get("share") for c, v in (r.get("categories") or {}).items()})
    out["top"] = r.get("top")
    return out


def _serve_figures(r: dict) -> dict:
    e, f = r.get("engine") or {}, r.get("fp32") or {}
    return {"engine_tokens_per_s": e.get("tokens_per_s"), "decode_step_ms": e.get("decode_step_ms"),
            "vs_hf_batched": r.get("vs_hf_batched"), "alone_vs_hf_alone": r.get("alone_vs_hf_alone"),
            "hf_batched_tokens_per_s": (r.get("hf_batched") or {}).get("tokens_per_s"),
            "eager_decode_step_ms": (r.get("engine_eager") or {}).get("decode_step_ms"),
            "graphs_vs_eager": r.get("graphs_vs_eager"),
            "graphs_vs_eager_alone": r.get("graphs_vs_eager_alone"),
            "first_run_tokens_per_s": (r.get("engine_cold") or {}).get("tokens_per_s"),
            "fp32_prompt_logprob_max_abs_diff": f.get("prompt_logprob_max_abs_diff"),
            "fp32_greedy_equal": f"{f.get('greedy_equal')}/{f.get('greedy_checked')}"}


def _fusion_figures(r: dict) -> dict:
    """Per region: kernels eager and compiled, and compiled time over eager (bench/fusions.py)."""
    out = {}
    for name, v in (r.get("regions") or {}).items():
        out.update({f"{name}.kernels": f"{v.get('kernels_eager')}->{v.get('kernels_compiled')}",
                    f"{name}.compiled_over_eager": v.get("ratio"),
                    f"{name}.eager_ms": v.get("eager_ms"), f"{name}.compiled_ms": v.get("compiled_ms")})
    return out


FIGURES = {"tests": lambda r: dict(r), "throughput": _throughput_figures,
           "recompute_memory": _recompute_figures, "largest_fit": _largest_fit_figures,
           "profile": _profile_figures, "serve": _serve_figures, "fusions": _fusion_figures}


def compare_with_hf(records: list[dict]) -> None:
    """Variants timed without HF get the ratio to their preset's HF figure from this run (same
    GPU, same shape, but not alternated with it)."""
    hf = {r["preset"]: r["figures"].get("hf_tokens_per_s") for r in records
          if r["kind"] == "throughput" and r.get("with_hf") and r["status"] == "ok"}
    for r in records:
        f = r["figures"]
        if (r["kind"] == "throughput" and f and f.get("ratio_vs_hf") is None
                and r.get("compare_hf", True) and hf.get(r["preset"])):
            f["hf_tokens_per_s_from"] = f"throughput/{r['preset']}/eager-sdpa"
            f["ratio_vs_hf"] = f["tokens_per_s"] / hf[r["preset"]]


# ---- the summary -------------------------------------------------------------------------------

def _fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def _throughput_table(records: list[dict]) -> list[str]:
    head = ("| preset | variant | attention | tokens/s | TFLOP/s | MFU | HF tokens/s | HF TFLOP/s "
            "| HF MFU | ratio vs HF | process peak GiB |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        if r["kind"] != "throughput" or r["status"] != "ok":
            continue
        f = r["figures"]
        lines.append(f"| {r['preset']} | {r['variant']} | {_fmt(f['attention'])} | "
                     f"{_fmt(f['tokens_per_s'], ',.0f')} | {_fmt(f['tflops'], '.3g')} | "
                     f"{_fmt(f['mfu'], '.2%')} | {_fmt(f['hf_tokens_per_s'], ',.0f')} | "
                     f"{_fmt(f['hf_tflops'], '.3g')} | {_fmt(f['hf_mfu'], '.2%')} | "
                     f"{_fmt(f['ratio_vs_hf'], '.2f')} | {_fmt(f['peak_memory_gb'], '.1f')} |")
    return lines


def summary(report: dict) -> str:
    recs = report["sections"]
    verdict = "all sections ok" if report["ok"] else "NOT ALL SECTIONS OK"
    about = (f"device: {report['device']}; torch {report['torch']}; commit {report['commit']}; "
             f"wall {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget; {verdict}")
    host = report.get("host") or {}
    if host:
        lock = host.get("memlock_limit_bytes")
        about += (f"\n\nhost: {host.get('cpus')} CPUs, {host.get('available_bytes', 0) / 2 ** 30:.1f} "
                  f"GiB available ({host.get('available_source')}), ulimit -l "
                  f"{'unlimited' if lock is None else f'{lock / 2 ** 20:.1f} MiB'}")
    lines = [f"# bloomtrain GPU check ({report['mode']}), {report['started']}", "", about, "",
             "| section | status | wall s | figures |", "|---|---|---|---|"]
    for r in recs:
        short = {k: v for k, v in r["figures"].items()
                 if isinstance(v, (int, float, str)) and k != "attention"}
        text = ", ".join(f"{k}={_fmt(v)}" for k, v in list(short.items())[:6])
        lines.append(f"| {r['name']} | {r['status']} | {_fmt(r.get('wall_s'), '.0f')} | {text} |")
    peaks = {r["figures"].get("mfu_peak_tflops") for r in recs if r["kind"] == "throughput"}
    peak = ", ".join(_fmt(p, ".4g") for p in sorted(peaks - {None})) or "-"
    lines += ["", f"## Step throughput (MFU against {peak} TFLOP/s)", "",
              *_throughput_table(recs)]
    for r in recs:
        if r["status"] != "ok":
            continue
        if r["kind"] == "recompute_memory":
            lines += ["", "## Activation recompute (peak memory)", "",
                      *_recompute_table(r["figures"])]
        elif r["kind"] == "profile":
            f = r["figures"]
            lines += ["", f"## Profile: one step of {r['preset']} ({_fmt(f['step_ms'], '.1f')} "
                          f"ms)", "", "| category | share |", "|---|---|"]
            lines += [f"| {k[:-6]} | {_fmt(v, '.1%')} |" for k, v in f.items()
                      if k.endswith("_share")]
            lines += ["", "| largest kernels | category | ms | share |", "|---|---|---|---|"]
            lines += [f"| {k['name'][:70]} | {k['category']} | {_fmt(k['ms'], '.2f')} | "
                      f"{_fmt(k['share'], '.1%')} |" for k in f.get("top") or []]
        elif r["kind"] == "fusions":
            f = r["figures"]
            lines += ["", "## Fusions: eager against compiled, forward and backward", "",
                      "| region | kernels eager->compiled | eager ms | compiled ms | "
                      "compiled/eager |", "|---|---|---|---|---|"]
            for region in dict.fromkeys(k.split(".", 1)[0] for k in f):
                lines.append(f"| {region} | {f.get(region + '.kernels')} | "
                             f"{_fmt(f.get(region + '.eager_ms'), '.3f')} | "
                             f"{_fmt(f.get(region + '.compiled_ms'), '.3f')} | "
                             f"{_fmt(f.get(region + '.compiled_over_eager'), '.2f')} |")
        elif r["kind"] == "serve":
            lines += ["", "## Serving (engine vs HF generate, in process)", "",
                      "| figure | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in r["figures"].items()]
        elif r["kind"] == "largest_fit":
            lines += ["", "## Largest preset that trains a step", "", "| figure | value |",
                      "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in r["figures"].items()]
    bad = [r for r in recs if r["status"] != "ok"]
    if bad:
        lines += ["", "## Not ok", ""] + [f"- **{r['name']}** ({r['status']}): {r['error']}"
                                          for r in bad]
    return "\n".join(lines) + "\n"


def host_info() -> dict:
    """What ZeRO-Offload's host check reads on this machine (bloomtrain.planner.host): its
    cores, its available memory and where that figure comes from, and the locked-memory limit
    (`ulimit -l`, None: unlimited), which the check holds the staging ring to on CUDA: whether
    the driver itself holds pinned memory to it is one of the things a GPU run shows."""
    sys.path.insert(0, str(REPO))
    from bloomtrain.planner.host import available_host_memory, memlock_limit
    avail, source = available_host_memory()
    return {"cpus": len(os.sched_getaffinity(0)), "available_bytes": avail,
            "available_source": source, "memlock_limit_bytes": memlock_limit()}


# ---- main ---------------------------------------------------------------------------------------

def _git_commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _device_name(cpu_smoke: bool) -> str:
    if cpu_smoke:
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    # nvidia-smi rather than torch.cuda: a CUDA context in this process would hold GPU memory
    # through every section.
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out.splitlines()[0] if out else "cuda"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every section on the CPU with tiny shapes (a few minutes)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON file (default bench/results/gpu-<date>.json); the summary "
                         "goes next to it as .md, the logs into <out>.logs/")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all sections (default 450 on GPU, 420 with --cpu-smoke)")
    ap.add_argument("--only", default=None,
                    help="run only the sections whose names contain one of these "
                         "comma-separated substrings")
    ap.add_argument("--recompute-micro-batch", type=int, default=4)
    ap.add_argument("--list", action="store_true",
                    help="print the sections' commands and timeouts, run nothing")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    prefix = "gpu-smoke" if args.cpu_smoke else "gpu"
    args.out = args.out or REPO / "bench" / "results" / f"{prefix}-{stamp}.json"
    args.logs = args.out.with_suffix(".logs")
    args.budget = args.budget or (420.0 if args.cpu_smoke else 450.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sections = plan(args)
    if args.only:
        wanted = args.only.split(",")
        sections = [s for s in sections if any(w in s.name for w in wanted)]
    if args.list:
        for sec in sections:
            print(f"{sec.name}  (timeout {sec.timeout_s:.0f} s)\n    {' '.join(sec.cmd)}")
        return 0
    import torch  # no CUDA context: is_available() only asks the driver
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench/gpu.sh: torch sees no CUDA device here; run with --cpu-smoke to check the "
              "script on the CPU", file=sys.stderr)
        return 2
    args.logs.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.perf_counter()
    records = []
    for sec in sections:
        left = args.budget - (time.perf_counter() - t0)
        print(f"[{time.perf_counter() - t0:5.0f} s] {sec.name} ...", flush=True)
        rec = run_section(sec, left, args.logs)
        records.append(rec)
        print(f"        {rec['status']}" + (f" ({rec['wall_s']:.0f} s)" if "wall_s" in rec else "")
              + (f": {rec['error'][:300]}" if rec["error"] else ""), flush=True)
    compare_with_hf(records)
    bad = [r for r in records if r["status"] == "failed"
           or (args.cpu_smoke and r["status"] == "skipped")]
    report = {"script": "bench/gpu.sh", "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
              "started": started, "wall_s": time.perf_counter() - t0, "budget_s": args.budget,
              "device": _device_name(args.cpu_smoke), "host": host_info(),
              "torch": torch.__version__,
              "python": platform.python_version(), "commit": _git_commit(),
              "mfu_peak_tflops": None if args.cpu_smoke else CUDA_PEAK_TFLOPS,
              "ok": not bad, "sections": records}
    text = summary(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print("\n" + text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
