"""The largest BLOOM preset that trains one step on one device, with and without ZeRO-Offload.

One process, ZeRO stage 1 (the same as stage 0 on one rank; `--zero-stage` to change), bf16 with
fp32 masters, full activation recompute by default (as BLOOM trained its larger models), one
micro-batch of `--micro-batch` x `--seq` random tokens. For each of `parallel.offload_optimizer`
false and true, the presets are tried from the largest down (bloomtrain/model/presets.py) and the
first that completes forward, backward and the optimizer step is the answer.

Each try runs in its own subprocess (this file with `--child`), so that an out-of-memory error,
or a CUDA context left in a bad state, cannot poison the next try; a try also has a timeout.
A preset is skipped without a try when its model states alone cannot fit, by the ZeRO memory
formula (bloomtrain/parallel/zero/memory.py) against the device's total memory: 2 bytes of bf16
parameters + 4 of fp32 gradients per parameter stay on the device either way, and the 12 of fp32
master + Adam moments go to the host under offload, where they must fit in RAM with the staging
ring and the process (bloomtrain.planner.host, the figures `bloomtrain train` checks). A try
runs that same host check before it builds anything.

A failed try says which memory ran out, from whichever line of its output says so: `host` (the
host check's refusal, torch's CPU allocator, a MemoryError, a pinned allocation, or the kernel's
OOM killer's SIGKILL) or `device` (CUDA's out of memory).

The model is built on the meta device and materialized by the engine, as in training, with
unseeded random values (bench.common.unseeded_init): the memory is a real run's, the values do not
matter, and BLOOM's seeded ones would take minutes to generate at the larger presets.

Peak memory: torch.cuda.max_memory_allocated (and reserved) on CUDA; the process's peak RSS on
the CPU, where device and host are the same memory. Each try also reports its resident memory
before it builds (the process overhead the host check plans with) and the host bytes the engine
allocated and pinned. `--micro-batches N` accumulates N micro-batches per step (the host step
then amortized over them).

    python bench/largest_fit.py --device cuda --seq 2048 --micro-batch 1
    python bench/largest_fit.py --device cpu --presets bloom-176b,tiny --seq 32   # a smoke run

Prints each try, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import unseeded_init
from bloomtrain.config import ModelConfig
from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model import resolve_model_config
from bloomtrain.model.presets import PRESETS
from bloomtrain.planner.host import (available_host_memory, check_host, node_host,
                                     resident_bytes)
from tests import helpers

GIB = 2 ** 30
# Bytes per parameter that must be resident on the device (bloomtrain/parallel/zero/buffers.py):
# bf16 parameters + the fp32 gradient accumulator; fp32 master + Adam m, v (12) too without
# offload. Under offload the host's are bloomtrain.planner.host's.
DEVICE_BYTES, OPTIM_BYTES = 2 + 4, 12

# Which memory ran out, by the line of a try's output that says so (any line: a traceback's last
# line is not always the one).
HOST_OOM = re.compile(r"of host memory on this node|DefaultCPUAllocator: can't allocate memory"
                      r"|(?<![A-Za-z])MemoryError|Cannot allocate memory")
DEVICE_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
# A CUDA API call that fails for memory: a page-locked host allocation (cudaHostAlloc, as the
# pinned states of older versions did) when the traceback shows one, else the device's.
CUDA_ERROR_OOM = "CUDA error: out of memory"
PINNED = ("pin_memory=True", "cudaHostAlloc", "CachingHostAllocator")


def presets_largest_first() -> list[str]:
    def size(name):
        return resolve_model_config(ModelConfig(preset=name)).num_parameters()
    return sorted(PRESETS, key=size, reverse=True)


def capacity(device: torch.device) -> tuple[float, float, str | None]:
    """(device bytes, host bytes, GPU name): the ceilings a try cannot exceed (the host's: what
    it has available, as the host check reads it). The GPU is asked from a subprocess: a CUDA
    context in this process would hold GPU memory through every try."""
    host = float(available_host_memory()[0])
    if device.type != "cuda":
        return host, host, None
    query = (f"import torch; d = torch.device({str(device)!r}); "
             f"print(torch.cuda.mem_get_info(d)[1]); print(torch.cuda.get_device_name(d))")
    out = subprocess.run([sys.executable, "-c", query], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return float(out[0]), host, out[1]


def config(args, preset: str, offload: bool):
    shape = resolve_model_config(ModelConfig(preset=preset))
    return shape, helpers.config(shape, parallel={"zero_stage": args.zero_stage,
                                                  "offload_optimizer": bool(offload)},
                                 precision="bf16", seed=1,
                                 activation_checkpointing=args.activation_checkpointing)


def planned_host(args, preset: str, device: torch.device) -> float:
    """What the host check plans for one offloading process of `preset` (states, ring and the
    process itself)."""
    shape, cfg = config(args, preset, True)
    layout = ParallelLayout.from_config(cfg.parallel, 1)
    return node_host(shape, layout, [0], "bf16", cfg.parallel.bucket_size_mb, False,
                     "cuda" if device.type == "cuda" else "cpu").total


def classify_oom(text: str, returncode: int) -> tuple[str | None, str | None]:
    """("host" | "device" | None, the line that says so)."""
    lines = [ln.strip() for ln in text.splitlines()]
    for kind, pattern in (("host", HOST_OOM), ("device", DEVICE_OOM)):
        for line in lines:
            if pattern.search(line):
                return kind, line
    for line in lines:
        if CUDA_ERROR_OOM in line:
            pinned = any(m in ln for ln in lines for m in PINNED)
            return ("host" if pinned else "device"), line
    if returncode == -9:  # SIGKILL: the kernel's OOM killer takes host memory back
        return "host", "killed by SIGKILL (the kernel's out-of-memory killer)"
    return None, None


def too_large(args, preset: str, offload: bool, device: torch.device,
              caps) -> tuple[str, str] | None:
    """(which memory, why) a preset cannot fit whatever its activations need, or None."""
    dev_cap, host_cap, _ = caps
    params = resolve_model_config(ModelConfig(preset=preset)).num_parameters()
    on_device = params * (DEVICE_BYTES + (0 if offload else OPTIM_BYTES))
    on_host = planned_host(args, preset, device) if offload else 0
    if device.type == "cpu":  # one memory for both
        on_device, on_host = on_device + on_host, 0
    if on_device > dev_cap:
        return ("host" if device.type == "cpu" else "device",
                f"model states need {on_device / GIB:.1f} GiB on the {device.type} "
                f"(> {dev_cap / GIB:.1f} GiB)")
    if on_host > host_cap:
        return ("host", f"offloaded states need {on_host / GIB:.1f} GiB of host memory "
                        f"(> {host_cap / GIB:.1f} GiB)")
    return None


def child(args) -> dict:
    """One train step of one preset in this process; returns its figures."""
    device = torch.device(args.device)
    shape, cfg = config(args, args.preset, args.offload)
    resident = resident_bytes()
    # The check `bloomtrain train` makes before it allocates: a host that cannot hold the
    # offloaded states is refused here, as a host out-of-memory, not by a failed allocation.
    node = check_host(cfg, shape, ParallelLayout.from_config(cfg.parallel, 1),
                      "cuda" if device.type == "cuda" else "cpu", [0], resident)
    t0 = time.perf_counter()
    with unseeded_init():  # BLOOM's seeded values would take minutes to generate at 7b1
        parts = helpers.build(cfg, device=device)
    built = time.perf_counter() - t0
    model, engine = parts.chunks[0], parts.engine
    model.train()
    ids = torch.randint(0, shape.vocab_size, (args.micro_batches, args.micro_batch,
                                              args.seq + 1), device=device)
    t0 = time.perf_counter()
    for mb in ids:
        (model(mb[:, :-1], labels=mb[:, 1:]) / args.micro_batches).backward()
    result = helpers.step(parts.optimizer, 1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {"preset": args.preset, "params": shape.num_parameters(), "build_s": built,
           "step_s": time.perf_counter() - t0, "micro_batches": args.micro_batches,
           "skipped_step": bool(result.skipped),
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
           "rss_before_build_gb": resident / GIB}
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GIB
    else:
        out["peak_memory_gb"] = out["peak_rss_gb"]
    # The engine's own accounting says where the model states were (device vs host).
    measured = engine.memory_report().get("measured", {})
    out["model_states_gb"] = {"device": measured.get("total", 0) / GIB,
                              "host": measured.get("host", {}).get("total", 0) / GIB,
                              "host_pinned": measured.get("host_pinned", 0) / GIB}
    if node is not None:
        out["planned_host_gb"] = node.total / GIB
    return out


def try_preset(args, preset: str, offload: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", "--preset", preset, "--offload", str(int(offload)),
           "--device", args.device, "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
           "--zero-stage", str(args.zero_stage), "--micro-batches", str(args.micro_batches),
           "--activation-checkpointing", args.activation_checkpointing]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"preset": preset, "ok": False, "error": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "ok": True, "wall_s": wall}
    oom, said = classify_oom(proc.stdout + "\n" + proc.stderr, proc.returncode)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    error = said if said is not None else " | ".join(tail)
    return {"preset": preset, "ok": False, "oom": oom, "returncode": proc.returncode,
            "wall_s": wall, "error": error[-600:]}


def search(args, offload: bool, deadline: float, caps) -> dict:
    """Presets from the largest down until one trains a step (or `deadline` passes)."""
    tries = []
    for preset in args.presets:
        left = deadline - time.monotonic()
        if left < 10:
            tries.append({"preset": preset, "ok": False, "skipped": "budget (--budget)"})
            continue
        over = too_large(args, preset, offload, torch.device(args.device), caps)
        if over:
            kind, why = over
            tries.append({"preset": preset, "ok": False, "oom": kind, "skipped": why})
            print(f"  offload={offload}: {preset:<11} skipped ({kind} out of memory): {why}")
            continue
        res = try_preset(args, preset, offload, min(args.try_timeout, left))
        tries.append(res)
        if res["ok"]:
            print(f"  offload={offload}: {preset:<11} trains: peak {res['peak_memory_gb']:.2f} "
                  f"GiB, step {res['step_s']:.2f} s (built in {res['build_s']:.1f} s)")
            return {"largest": preset, "params": res["params"],
                    "peak_memory_gb": res["peak_memory_gb"], "tries": tries}
        what = f"{res['oom']} out of memory" if res.get("oom") else "error"
        print(f"  offload={offload}: {preset:<11} failed ({what}): {res['error'][:300]}")
    return {"largest": None, "params": 0, "peak_memory_gb": None, "tries": tries}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches accumulated per step (default 1)")
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1))
    ap.add_argument("--activation-checkpointing", default="full",
                    choices=("none", "selective", "full"))
    ap.add_argument("--presets", default=",".join(presets_largest_first()),
                    help="comma-separated, tried in this order (default: every preset, "
                         "largest first)")
    ap.add_argument("--offload", default="both", choices=("both", "0", "1"),
                    help="both: search without and with parallel.offload_optimizer")
    ap.add_argument("--try-timeout", type=float, default=300, help="seconds per try")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds for the whole search: tries that would start later are "
                         "recorded as skipped, and the JSON line still comes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        args.offload = int(args.offload)
        try:
            print(json.dumps(child(args)))
        except UserError as e:  # the host check's refusal: one line, as `bloomtrain train`
            sys.exit(f"error: {e}")
        return
    device = torch.device(args.device)
    caps = capacity(device)
    dev_cap, host_cap, gpu = caps
    print(f"device {device} ({dev_cap / GIB:.1f} GiB), host {host_cap / GIB:.1f} GiB available; "
          f"seq {args.seq}, micro-batch {args.micro_batch}, ZeRO stage {args.zero_stage}, bf16, "
          f"recompute {args.activation_checkpointing}")
    modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.offload]
    out = {"bench": "largest_fit", "device": str(device),
           "gpu": gpu,
           "device_memory_gb": dev_cap / GIB, "host_available_gb": host_cap / GIB,
           "host_memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
           "seq": args.seq, "micro_batch": args.micro_batch, "zero_stage": args.zero_stage,
           "activation_checkpointing": args.activation_checkpointing, "presets": args.presets}
    deadline = time.monotonic() + args.budget
    for offload in modes:
        out["offload" if offload else "no_offload"] = search(args, offload, deadline, caps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
