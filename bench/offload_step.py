"""ZeRO-Offload's optimizer step on the host, per parameter: bloomtrain's against DeepSpeed's
DeepSpeedCPUAdam and torch's fused AdamW on the CPU, on the same ~100M fp32 parameters, with 1 to
N threads.

- bloomtrain: a real offloading engine (one process, ZeRO-1, bf16, the BLOOM shape of
  `--hidden` x `--layers`, default 2048 x 2: 100.7M parameters, in the default 25 MB buckets),
  stepped as ZeroAdamW steps it (bloomtrain/parallel/zero/optimizer.py): chunk by chunk as the
  gradients land in its staging ring, torch's fused AdamW with weight decay on the matrices
  only, then the chunk's updated masters cast to bf16 into its slot (HostCopies.cast), the bytes
  that go back to the device. The copies into and out of the ring
  (on a GPU, the device's copy engines; here memcpy) are outside the timing. `update` is AdamW
  alone; `step` adds the cast, the host's whole part.
- deepspeed: what DeepSpeed's ZeRO-Offload (stages 1-2, runtime/zero/stage_1_and_2.py `step`)
  runs on the host per parameter group, on its two flat fp32 groups (weight decay and none) of
  the same sizes: DeepSpeedCPUAdam's step (its C++/AVX op, built on first use; `update`), then
  the updated fp32 partition cast into its host bf16 buffer
  (`param_buffer_of_bit16_for_cpu_offload_groups[i].copy_(fp32_partition)`), the bytes its
  non-blocking copy sends to the device. `step` is both, the same work as bloomtrain's `step`.
- torch: torch.optim.AdamW(fused=True) on the same two groups (foreach where the CPU has no fused
  kernel).

Data cold, code warm, as in a real run, where the states (16 bytes per parameter, far beyond any
cache) stream through the caches once a step and leave the interpreter's and the kernels' code
there but not the data. Before its step each side reads a buffer twice the size of the
last-level cache (evict()), then warms its code with the same calls on a tiny copy of its own
work (a tiny engine's chunk; a tiny DeepSpeedCPUAdam group; a tiny fused AdamW). DeepSpeed does
so before each of its two groups, torch before its step, bloomtrain once its ring holds the
first chunks' gradients. bloomtrain then runs ZeroAdamW's loop: landed() copies chunk k + 4's
gradients into the slot chunk k has just left (untimed: on a GPU host the device's DMA writes
them, here a memcpy, which puts them in the cache), so that each chunk's gradients were written
four chunks (about 50 MB of streaming) before it reads them, by then gone from the cache. `python
bench/offload_cold.py` checks that timing on torch alone: 100M fp32 elements, torch's fused
AdamW per 512K chunk as that loop runs it (`ahead`), against one call on the whole tensor with
everything cold (`whole`), against the loop with each chunk's gradients copied in just before
its step (`hot`, what this timing must not be: a review found it in an earlier version of this
benchmark) and against the loop with the cache evicted before every chunk (`evict`). On the
2-core CI machine (2026-12-07 14:00 UTC, AdamW time, median paired ratios to `whole`): at one
thread (7 rounds) ahead 1.039x, hot 0.930x, evict 1.078x; at two (11 rounds) 0.907x, 0.830x,
0.915x. So the loop's gradients come from memory (ahead well over hot), and an eviction per
chunk costs a chunked step more than cold data does at one thread (it also clears what a real
run's previous chunk leaves warm, such as the page-walk caches). That
harsher timing is still reported, as bloomtrain's `evict each` row, the same step with the cache
evicted before every chunk.

Modelled only roughly: a real run's device-to-host and host-to-device copies share the memory's
bandwidth with the host step (bloomtrain overlaps them with it; DeepSpeed copies the gradients
during the backward). Here bloomtrain's stand-in copies leave their writes (the ring's gradients,
the copy back into the CPU `device` buffer) in the cache, and the timed step writes them back to
memory, about the bytes the DMA would move beside it (the copy back alone: ~5% of the step at one
thread); DeepSpeed's side carries no copies.

No clipping (a clip coefficient of 1: each system skips its multiply). Each system runs in a
worker process of its own at each thread count (torch.set_num_threads and OMP_NUM_THREADS, which
DeepSpeed's OpenMP loop reads), all alive at once; after a warm-up step each, `--rounds` rounds
take one step of every system in turn (alternating, so that load from elsewhere falls on all of
them), and the median is reported (and, for bloomtrain's whole step against DeepSpeed's, the
median of each round's ratio, which drift over the run moves less): wall time, and the process's CPU time (which a machine shared
with other work disturbs less at one thread; with more, OpenMP's spin-waiting counts in it). DeepSpeed runs under `--deepspeed-python` (an interpreter with
deepspeed; DS_ACCELERATOR=cpu), or is reported as missing.

    python bench/offload_step.py --deepspeed-python /work/dsvenv/bin/python
    python bench/offload_step.py --threads 1,2,4,8 --rounds 7

Prints a table, then one JSON line. Measures; asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("bloomtrain", "deepspeed", "torch")
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


# ---- workers: one system, driven over stdin ----------------------------------------------------
@functools.cache
def _sweep():
    """A buffer twice the last-level cache (at least 256 MiB), read before every timed region:
    what a timed region reads comes from memory on every side. Without it our side read its
    gradients hot from the cache, where the untimed copy into the ring had just put them (on a
    GPU host the device's DMA writes them; DeepSpeed's were copied during backward, long before
    its step): a review measured that 17% of the step."""
    import torch
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0)
    except (OSError, ValueError):
        llc = 64 << 20
    return torch.ones(max(2 * llc, 256 << 20) // 4)


def evict() -> None:
    float(_sweep().sum())


def cold(warm) -> None:
    """Data cold, code warm: evict, then `warm()`, a tiny call on the timed region's path."""
    evict()
    warm()

def _bloomtrain(args):
    """(step, update seconds of the last step, parameters)."""
    sys.path.insert(0, str(REPO))
    from bench.common import unseeded_init
    from bloomtrain.model.presets import BloomShape
    from bloomtrain.parallel.zero.optimizer import step_chunks
    from tests import helpers

    shape = BloomShape(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=16, ffn_hidden_size=4 * args.hidden)
    optim = {"lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WD}
    cfg = helpers.config(shape, parallel={"zero_stage": 1, "offload_optimizer": True},
                         optim=optim, precision="bf16", seed=1)
    with unseeded_init():
        parts = helpers.build(cfg, device="cpu")
    engine, opt = parts.engine, parts.optimizer
    bufs, host = engine.bufs, engine.host_copies
    bufs.grad.normal_(0.0, 1e-3)
    count = [0]
    split = {"update": 0.0}

    # The warm-up's tiny engine: the same code path on 16K parameters.
    tiny_cfg = helpers.config(BloomShape(vocab_size=128, hidden_size=16, num_layers=1,
                                         num_heads=2, ffn_hidden_size=64),
                              parallel={"zero_stage": 1, "offload_optimizer": True},
                              optim=optim, precision="bf16", seed=1)
    tiny = helpers.build(tiny_cfg, device="cpu").engine
    tiny_chunk = tiny.host_copies.order[0]

    def warm():
        step_chunks(tiny.bufs, [tiny_chunk], opt.cfg, LR, count[0], 1.0)
        tiny.host_copies.copy_back(tiny_chunk, tiny.host_copies.cast(tiny_chunk))

    def run(evict_each: bool):
        """ZeroAdamW's offloaded loop (bloomtrain/parallel/zero/optimizer.py), the host's work
        timed: chunk by chunk as they land in the ring, each stepped and cast; the copies into
        the ring (memcpy here, in grads_to_host and landed) and back are untimed. The cache is
        evicted once the first chunks have been copied in, or before every chunk
        (`evict_each`)."""
        count[0] += 1
        wall = cpu = update = update_cpu = 0.0
        host.grads_to_host()
        if not evict_each:
            cold(warm)
        for chunk in host.landed():
            if evict_each:
                cold(warm)
            t0, c0 = time.perf_counter(), time.process_time()
            step_chunks(bufs, [chunk], opt.cfg, LR, count[0], 1.0)
            t1, c1 = time.perf_counter(), time.process_time()
            cast = host.cast(chunk)
            update, update_cpu = update + t1 - t0, update_cpu + c1 - c0
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            host.copy_back(chunk, cast)
        return wall, cpu, update, update_cpu

    def step():
        wall, cpu, update, update_cpu = run(evict_each=False)
        split.update(update=update, update_cpu=update_cpu)
        # The same step with the cache evicted before every chunk: the old, harsher timing.
        split["evict_each_s"] = run(evict_each=True)[0]
        return wall, cpu
    return step, split, engine.num_local_parameters()


def _flat_groups(args):
    """The decay and no-decay group sizes of the same model, as DeepSpeed flattens them."""
    h, f, layers = args.hidden, 4 * args.hidden, args.layers
    decayed = 256 * h + layers * (3 * h * h + h * h + f * h + h * f)
    plain = 2 * h + layers * (3 * h + h + f + h + 4 * h) + 2 * h
    return decayed, plain


def _deepspeed(args):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    groups = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in _flat_groups(args)]
    for p in groups:
        p.grad = torch.randn_like(p) * 1e-3
    opt = DeepSpeedCPUAdam([{"params": [groups[0]], "weight_decay": WD},
                            {"params": [groups[1]], "weight_decay": 0.0}],
                           lr=LR, betas=BETAS, eps=EPS, adamw_mode=True)
    # ZeRO-Offload's host bf16 buffer per group (pinned with offload_optimizer.pin_memory, true
    # by default in DeepSpeed 0.19; pinning changes nothing on the CPU), which the updated masters
    # are cast into before going to the device.
    bit16 = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in groups]
    split = {"update": 0.0}
    tiny = torch.nn.Parameter(torch.randn(16384) * 0.02)
    tiny.grad = torch.randn_like(tiny) * 1e-3
    tiny_opt = DeepSpeedCPUAdam([{"params": [tiny], "weight_decay": WD}], lr=LR, betas=BETAS,
                                eps=EPS, adamw_mode=True)
    tiny_bit16 = torch.zeros(tiny.shape, dtype=torch.bfloat16)

    def warm():
        tiny_opt.step()
        tiny_bit16.copy_(tiny.data)

    def step():
        """stage_1_and_2.py's offloaded step, group by group as its `_optimizer_step(i)` runs
        it (the optimizer's param_groups narrowed to group i for one step() call), then the
        cast of that group into its bf16 buffer."""
        wall = cpu = update = update_cpu = 0.0
        every = opt.param_groups
        for i, (buf, p) in enumerate(zip(bit16, groups)):
            cold(warm)
            t0, c0 = time.perf_counter(), time.process_time()
            opt.param_groups = [every[i]]
            opt.step()
            opt.param_groups = every
            t1, c1 = time.perf_counter(), time.process_time()
            buf.copy_(p.data)
            update, update_cpu = update + t1 - t0, update_cpu + c1 - c0
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
        split.update(update=update, update_cpu=update_cpu)
        return wall, cpu
    return step, split, sum(p.numel() for p in groups)


def _torch(args):
    import torch
    groups = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in _flat_groups(args)]
    for p in groups:
        p.grad = torch.randn_like(p) * 1e-3
    try:
        opt = torch.optim.AdamW([{"params": [groups[0]], "weight_decay": WD},
                                 {"params": [groups[1]], "weight_decay": 0.0}],
                                lr=LR, betas=BETAS, eps=EPS, fused=True)
        opt.step()
    except RuntimeError:  # no fused kernel for this device in this torch
        opt = torch.optim.AdamW([{"params": [groups[0]], "weight_decay": WD},
                                 {"params": [groups[1]], "weight_decay": 0.0}],
                                lr=LR, betas=BETAS, eps=EPS, foreach=True)
    kernel = "fused" if opt.defaults.get("fused") else "foreach"
    tiny = torch.nn.Parameter(torch.randn(16384) * 0.02)
    tiny.grad = torch.randn_like(tiny) * 1e-3
    tiny_opt = type(opt)([tiny], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         **{kernel: True})

    def step():
        cold(tiny_opt.step)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0
    return step, {"kernel": kernel}, sum(p.numel() for p in groups)


def worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    step, extra, params = {"bloomtrain": _bloomtrain, "deepspeed": _deepspeed,
                           "torch": _torch}[args.worker](args)
    print(json.dumps({"ready": True, "params": params, "threads": torch.get_num_threads()}),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        wall, cpu = step()
        print(json.dumps({"s": wall, "cpu_s": cpu, **(extra or {})}), flush=True)


# ---- the driver ----------------------------------------------------------------------------------
class Worker:
    def __init__(self, system: str, python: str, threads: int, args):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
        cmd = [python, __file__, "--worker", system, "--threads", str(threads),
               "--hidden", str(args.hidden), "--layers", str(args.layers)]
        self.system = system
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.system} worker ended: {self.proc.stderr.read()[-2000:]}")

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def measure(args, threads: int) -> dict:
    pythons = {"bloomtrain": sys.executable, "torch": sys.executable,
               "deepspeed": args.deepspeed_python}
    workers, out = {}, {}
    try:
        for system in SYSTEMS:
            if pythons[system] is None:
                out[system] = {"missing": "no --deepspeed-python with deepspeed"}
                continue
            workers[system] = Worker(system, pythons[system], threads, args)
        for w in workers.values():  # warm-up: first-touch of the states, kernels' first use
            w.step()
        times = {s: [] for s in workers}
        for _ in range(args.rounds):
            for s, w in workers.items():
                times[s].append(w.step())
    finally:
        for w in workers.values():
            w.close()
    for s, w in workers.items():
        n = w.info["params"]
        med = statistics.median(r["s"] for r in times[s])
        cpu = statistics.median(r["cpu_s"] for r in times[s])
        out[s] = {"params": n, "threads_seen": w.info["threads"], "median_s": med,
                  "ns_per_param": med / n * 1e9, "cpu_ns_per_param": cpu / n * 1e9,
                  "rounds_s": [r["s"] for r in times[s]]}
        if "update" in times[s][-1]:  # bloomtrain, deepspeed: the AdamW part of the step
            upd = statistics.median(r["update"] for r in times[s])
            upd_cpu = statistics.median(r["update_cpu"] for r in times[s])
            out[s].update(update_median_s=upd, update_ns_per_param=upd / n * 1e9,
                          update_cpu_ns_per_param=upd_cpu / n * 1e9)
        if "evict_each_s" in times[s][-1]:
            med = statistics.median(r["evict_each_s"] for r in times[s])
            out[s].update(evict_each_median_s=med, evict_each_ns_per_param=med / n * 1e9)
        if s == "torch":
            out[s]["kernel"] = times[s][-1]["kernel"]
    if "median_s" in out.get("deepspeed", {}):
        # Like with like: each system's whole host step against DeepSpeed's, the AdamW updates
        # against DeepSpeed's update (torch's AdamW is an update only).
        d, b = out["deepspeed"], out["bloomtrain"]
        b.update(step_vs_deepspeed=b["ns_per_param"] / d["ns_per_param"],
                 update_vs_deepspeed=b["update_ns_per_param"] / d["update_ns_per_param"],
                 update_cpu_vs_deepspeed=b["update_cpu_ns_per_param"]
                 / d["update_cpu_ns_per_param"],
                 # Each round's ratio, the two steps taken moments apart: drift in the machine's
                 # speed over the run moves both sides of a round alike.
                 step_vs_deepspeed_rounds=[x["s"] / y["s"] for x, y in
                                           zip(times["bloomtrain"], times["deepspeed"])])
        b["step_vs_deepspeed_paired"] = statistics.median(b["step_vs_deepspeed_rounds"])
        b["evict_each_vs_deepspeed"] = b["evict_each_ns_per_param"] / d["ns_per_param"]
        b["evict_each_vs_deepspeed_paired"] = statistics.median(
            x["evict_each_s"] / y["s"] for x, y in zip(times["bloomtrain"], times["deepspeed"]))
        out["torch"]["vs_deepspeed"] = out["torch"]["ns_per_param"] / d["update_ns_per_param"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deepspeed-python", default=None,
                    help="a Python with deepspeed installed (default: this one if it has it)")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return
    if args.deepspeed_python is None:
        import importlib.util
        if importlib.util.find_spec("deepspeed") is not None:
            args.deepspeed_python = sys.executable
    counts = [int(t) for t in args.threads.split(",") if t]
    result = {"bench": "offload_step", "hidden": args.hidden, "layers": args.layers,
              "rounds": args.rounds, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              f"{platform.processor() or platform.platform()}",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "threads": {}}
    print(f"{'threads':>7}  {'system':<12} {'median s':>9} {'ns/param':>9} {'vs DeepSpeed':>12} "
          f"{'CPU ns/param':>12}")
    for t in counts:
        r = result["threads"][str(t)] = measure(args, t)
        for s in SYSTEMS:
            f = r[s]
            if "median_s" not in f:
                print(f"{t:>7}  {s:<12} {f['missing']}")
                continue
            ratio = f.get("step_vs_deepspeed", f.get("vs_deepspeed"))
            paired = (f"   (per round: median {f['step_vs_deepspeed_paired']:.3f}x, "
                      f"{min(f['step_vs_deepspeed_rounds']):.3f}-"
                      f"{max(f['step_vs_deepspeed_rounds']):.3f}x)"
                      if "step_vs_deepspeed_paired" in f else "")
            print(f"{t:>7}  {s:<12} {f['median_s']:>9.4f} {f['ns_per_param']:>9.3f} "
                  f"{'' if ratio is None else format(ratio, '.3f') + 'x':>12} "
                  f"{f['cpu_ns_per_param']:>12.3f}{paired}")
            if "update_median_s" in f:
                ratio = f.get("update_vs_deepspeed")
                print(f"{t:>7}  {'  update':<12} {f['update_median_s']:>9.4f} "
                      f"{f['update_ns_per_param']:>9.3f} "
                      f"{'' if ratio is None else format(ratio, '.3f') + 'x':>12} "
                      f"{f['update_cpu_ns_per_param']:>12.3f}")
            if "evict_each_median_s" in f:
                ratio = f.get("evict_each_vs_deepspeed")
                paired = ("" if ratio is None else "   (per round: median "
                          f"{f['evict_each_vs_deepspeed_paired']:.3f}x)")
                print(f"{t:>7}  {'  evict each':<12} {f['evict_each_median_s']:>9.4f} "
                      f"{f['evict_each_ns_per_param']:>9.3f} "
                      f"{'' if ratio is None else format(ratio, '.3f') + 'x':>12} "
                      f"{'':>12}{paired}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
