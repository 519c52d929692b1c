"""bench/gpu.sh, the one GPU check, run end to end on the CPU (`--cpu-smoke`) so that it cannot rot
between the rare runs on a GPU: every section must run and leave its figures in the JSON file.
A section that fails fails this test, with the section's own error in the message."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "selective", "full")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    # The script budgets itself (420 s: the tiny throughput sections alone take 120-140 s on a
    # busy 2-core machine); the timeout here only guards against a hang in it.
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), "--cpu-smoke", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(out.read_text()), out


def test_every_section_ran_and_left_numbers(smoke):
    proc, report, out = smoke
    sections = {r["name"]: r for r in report["sections"]}
    assert report["mode"] == "cpu-smoke"
    host = report["host"]  # what the offload check reads: a GPU run records it
    assert host["cpus"] >= 1 and host["available_bytes"] > 0 and host["available_source"]
    assert "memlock_limit_bytes" in host and "ulimit -l" in out.with_suffix(".md").read_text()
    big = [f"throughput/tiny/eager-sdpa-zero1-offload-{m}" for m in ("full", "selective")]
    assert set(sections) == {"tests", "throughput/tiny/eager-sdpa", "throughput/tiny/compile-sdpa",
                             "profile/tiny", "fusions", "serve", "recompute_memory",
                             "largest_fit", *big}
    failed = {n: r["error"] for n, r in sections.items() if r["status"] != "ok"}
    assert failed == {}, failed
    assert report["ok"] and proc.returncode == 0, proc.stdout[-2000:]

    tests = sections["tests"]["figures"]
    assert tests["tests"] > 0 and tests["passed"] == tests["tests"] - tests["skipped"]
    for name in ("throughput/tiny/eager-sdpa", "throughput/tiny/compile-sdpa"):
        f = sections[name]["figures"]
        for key in ("tokens_per_s", "tflops", "mfu", "peak_fraction", "matmul_peak_tflops",
                    "ratio_vs_hf"):
            assert _number(f[key]) and f[key] > 0, (name, key, f[key])
    assert _number(sections["throughput/tiny/eager-sdpa"]["figures"]["hf_tokens_per_s"])
    for name in big:  # bloom-7b1's sections: ZeRO-1 offloaded, micro-batch 1, no HF
        f, cmd = sections[name]["figures"], sections[name]["cmd"]
        assert _number(f["tokens_per_s"]) and f["tokens_per_s"] > 0, (name, f)
        assert f["hf_tokens_per_s"] is None and f["ratio_vs_hf"] is None, (name, f)
        assert "--zero-stage 1 --offload-optimizer" in cmd and "--micro-batch 1" in cmd
        assert sections[name]["result"]["bloomtrain"]["activation_checkpointing"] in name
    peaks = sections["recompute_memory"]["figures"]
    for mode in MODES:
        assert any(mode in k and _number(v) and v > 0 for k, v in peaks.items()), (mode, peaks)
    prof = sections["profile/tiny"]["figures"]
    assert _number(prof["step_ms"]) and prof["step_ms"] > 0
    shares = {k: v for k, v in prof.items() if k.endswith("_share")}
    assert {"GEMM_share", "attention_share", "optimizer_share", "idle_share"} <= set(shares)
    assert sum(shares.values()) == pytest.approx(1.0) and shares["GEMM_share"] > 0
    assert len(prof["top"]) == 15 and all(_number(k["ms"]) for k in prof["top"])
    fusions = sections["fusions"]["figures"]
    for region in ("layernorm", "bias_gelu", "bias_dropout_add", "block"):
        eager, compiled = map(int, fusions[f"{region}.kernels"].split("->"))
        assert eager > 0 and compiled > 0 and _number(fusions[f"{region}.compiled_over_eager"])
    # Inductor fuses the block's LayerNorms, GeLU, dropouts and adds: fewer kernels compiled (on
    # the CPU 37 -> 25 per layer with dropout). Equal counts would mean nothing was compiled.
    eager, compiled = map(int, fusions["block.kernels"].split("->"))
    assert compiled < eager, fusions
    serve = sections["serve"]["figures"]
    for key in ("engine_tokens_per_s", "decode_step_ms", "vs_hf_batched", "alone_vs_hf_alone",
                "eager_decode_step_ms", "graphs_vs_eager", "graphs_vs_eager_alone",
                "first_run_tokens_per_s"):
        assert _number(serve[key]) and serve[key] > 0, (key, serve)
    # fp32: the engine's prompt logprobs are HF's to rounding, its greedy tokens HF's.
    assert serve["fp32_prompt_logprob_max_abs_diff"] < 1e-4
    assert serve["fp32_greedy_equal"] == "4/4"
    fit = sections["largest_fit"]["figures"]
    for mode in ("no_offload", "offload"):
        assert fit[f"{mode}_largest"] == "tiny"  # bloom-176b is skipped by its model states
        assert _number(fit[f"{mode}_peak_memory_gb"]) and fit[f"{mode}_peak_memory_gb"] > 0

    text = out.with_suffix(".md").read_text()
    assert all(name in text for name in sections)
    assert all(Path(r["log"]).is_file() for r in sections.values())


def test_failures_timeouts_and_budget_are_recorded(tmp_path):
    """The driver's bookkeeping on commands that fail, hang or never start, without benches."""
    fail = gpu_check.Section("fails", "largest_fit",
                             [sys.executable, "-c", "print('partial'); raise SystemExit(3)"], 30)
    rec = gpu_check.run_section(fail, 100, tmp_path)
    assert rec["status"] == "failed" and rec["returncode"] == 3
    assert "exit status 3" in rec["error"] and "partial" in rec["error"]

    no_json = gpu_check.Section("silent", "largest_fit", [sys.executable, "-c", "print(1)"], 30)
    rec = gpu_check.run_section(no_json, 100, tmp_path)
    assert rec["status"] == "failed" and "no JSON result line" in rec["error"]

    hang = gpu_check.Section("hangs", "largest_fit",
                             [sys.executable, "-c", "import time; time.sleep(60)"], 2)
    rec = gpu_check.run_section(hang, 100, tmp_path)
    assert rec["status"] == "failed" and rec["returncode"] is None
    assert rec["error"].startswith("timeout after 2 s")

    rec = gpu_check.run_section(hang, gpu_check.MIN_START_S - 1, tmp_path)
    assert rec["status"] == "skipped" and rec["error"].startswith("budget")

    # A timed-out pytest is interrupted before it is killed, so its JUnit XML (the tests that
    # ran) is written and read; one left by an earlier run is not.
    junit = tmp_path / "pytest.xml"
    junit.write_text("<testsuite tests='99' failures='0' errors='0' skipped='0'/>")
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\ndef test_quick():\n    pass\n"
                    "def test_hangs():\n    time.sleep(60)\n")
    tests = gpu_check.Section("tests", "tests",
                              [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", str(slow)], 12, {"junit": str(junit)})
    rec = gpu_check.run_section(tests, 100, tmp_path)
    assert rec["status"] == "failed" and rec["error"].startswith("timeout after 12 s")
    assert rec["result"]["tests"] < 99 and rec["figures"]["passed"] == 1, rec

    # One that ignores the interrupt is killed INTERRUPT_GRACE_S later.
    deaf = gpu_check.Section("deaf", "largest_fit", [sys.executable, "-c",
                             "import signal, time; signal.signal(signal.SIGINT, "
                             "signal.SIG_IGN); time.sleep(60)"], 2)
    rec = gpu_check.run_section(deaf, 100, tmp_path)
    assert rec["returncode"] is None
    assert rec["wall_s"] < 2 + gpu_check.INTERRUPT_GRACE_S + 5

    line = json.dumps({"offload": {"largest": "tiny", "params": 5}})
    ok = gpu_check.Section("ok", "largest_fit", [sys.executable, "-c", f"print({line!r})"], 30)
    rec = gpu_check.run_section(ok, 100, tmp_path)
    assert rec["status"] == "ok" and rec["figures"]["offload_largest"] == "tiny"


@pytest.mark.parametrize("name,cat", [
    # CUDA kernels as torch.profiler names them.
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
     "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, "
     "float, long>(float*, float*, float const*, long const*, float const*, bool, long, long, "
     "long, long)", "loss"),
    ("triton_red_fused__log_softmax_backward_data_nll_loss_backward_0", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, "
     "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
     "attention"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<c10::BFloat16, "
     "float>", "LayerNorm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
     "float>", "LayerNorm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNN", "GEMM"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
     "elementwise/other"),
    # CPU ops.
    ("aten::_log_softmax", "loss"), ("aten::nll_loss_forward", "loss"),
    ("aten::_softmax", "attention"), ("aten::native_layer_norm_backward", "LayerNorm")])
def test_profile_categories(name, cat):
    """The loss's log-softmax is not attention's softmax (at a 250,880-token vocabulary it is a
    large share of the step), LayerNorm's weight-gradient kernel is LayerNorm's."""
    from bench.profile_step import ORDER, category
    assert category(name) == cat and cat in ORDER


# ---- bench/largest_fit.py: which memory ran out ----------------------------------------------
# Outputs of failed tries, as torch and the host check print them; the telling line is not always
# the last (CUDA's error is followed by its debugging advice).
PINNED_OOM = """Traceback (most recent call last):
  File "bloomtrain/parallel/zero/buffers.py", line 67, in zeros
    return torch.zeros(n, dtype=dtype, device=device, pin_memory=True)
torch.AcceleratorError: CUDA error: out of memory
CUDA kernel errors might be asynchronously reported at some other API call.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1"""
DEVICE_OOM = """    return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity
of 139.8 GiB of which 1.2 GiB is free."""
CPU_OOM = ("RuntimeError: [enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't "
           "allocate memory: you tried to allocate 8589934592 bytes.\nsome later line")


@pytest.mark.parametrize("text,code,kind", [
    (PINNED_OOM, 1, "host"), (DEVICE_OOM, 1, "device"), (CPU_OOM, 1, "host"),
    ("error: ZeRO-Offload needs 82.03 GiB (88,075,632,640 bytes) of host memory on this node",
     1, "host"),
    ("MemoryError", 1, "host"), ("", -9, "host"),
    (PINNED_OOM.replace("pin_memory=True", "pin_memory=False"), 1, "device"),
    ("ValueError: bad shape", 1, None)])
def test_largest_fit_says_which_memory_ran_out(text, code, kind):
    from bench.largest_fit import classify_oom
    got, line = classify_oom(text, code)
    assert got == kind
    assert (line is None) == (kind is None)


def test_largest_fit_reports_a_host_out_of_memory_as_such(monkeypatch):
    """A host the offloaded states do not fit (BLOOMTRAIN_HOST_MEMORY): a try fails as a host
    out-of-memory with the host check's line, before it builds anything; the search skips the
    preset as one without trying it."""
    from bench import largest_fit
    monkeypatch.setenv("BLOOMTRAIN_HOST_MEMORY", "1MiB")
    args = largest_fit.parse_args(["--device", "cpu", "--presets", "tiny", "--seq", "32"])
    tried = largest_fit.try_preset(args, "tiny", True, 120)
    assert (tried["ok"], tried["oom"]) == (False, "host"), tried
    assert tried["error"].startswith("error: ZeRO-Offload needs ")
    caps = largest_fit.capacity(largest_fit.torch.device("cpu"))
    found = largest_fit.search(args, True, float("inf"), caps)
    assert [(t["ok"], t["oom"]) for t in found["tries"]] == [(False, "host")]
    assert found["largest"] is None
