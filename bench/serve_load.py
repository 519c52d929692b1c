"""Serving under load: `bloomtrain serve` on loopback, driven by 1, 4 and 16 concurrent streaming
clients through the same 64 requests of mixed prompt and output lengths, against the same load
served one request at a time by our own `generate` (bloomtrain.generate, KV cache, batch 1) in
this process. Greedy decoding on both sides, so both produce the same tokens.

Per concurrency: output tokens/s over the wall time of the 64 requests, time to first token
(send -> first streamed text) p50/p99, inter-token latency (gaps between streamed chunks, each
normally one token) p50/p99, and the throughput ratio to the baseline. Also, for INT8 weights
(bloomtrain.serve.quantize): model bytes against fp32 and bf16, and the perplexity change on the
demo's validation split.

The model is a trained demo-size one (hidden 128, 4 layers, vocab 4096): `--run-dir DIR` is a
`bloomtrain demo` run directory; when DIR has no checkpoint yet, the bench trains one there first
(`bloomtrain demo --run-dir DIR train.train_iters=100 train.precision=fp32`, a few minutes on a
2-core CPU). The server and the baseline use the same torch thread count (--threads). Rounds
(--rounds, 5) each run the baseline in two halves (the first and the last half of the
requests) with the largest client count, the one the goal is set on, between them, then the
other client counts: a shared machine's speed drifts (this one's by up to 2x within minutes), and
so the measurement the goal is judged on sits in the middle of its own baseline. Reported are the
medians over the rounds, the ratio being each round's against its own baseline (both halves'
tokens over both halves' time). Measures; asserts nothing. Prints a table, then one JSON line.

    python bench/serve_load.py
    python bench/serve_load.py --run-dir /tmp/demo --clients 1,4,16 --requests 64 --threads 1
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bloomtrain import checkpoint as ckpt  # noqa: E402
from bloomtrain import load_model  # noqa: E402
from bloomtrain.generate import generate  # noqa: E402
from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer  # noqa: E402

PROMPT_LENGTHS = (8, 16, 32, 64, 96)
OUTPUT_LENGTHS = (16, 32, 64, 128)


def ensure_demo(run_dir: Path, iters: int) -> Path:
    """The checkpoint root of the demo run in `run_dir`, training it first if there is none."""
    root = run_dir / "checkpoints"
    try:
        ckpt.resolve(root)
        return root
    except Exception:
        pass
    print(f"[bench] no checkpoint in {run_dir}: training the demo model ({iters} steps, fp32)",
          flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "bloomtrain", "demo", "--run-dir", str(run_dir),
                    f"train.train_iters={iters}", "train.precision=fp32"], check=True, env=env)
    ckpt.resolve(root)
    return root


def validation_samples(run_dir: Path, tokenizer, num: int) -> list[np.ndarray]:
    """`num` samples (seq_length + 1 tokens) of the demo run's validation split."""
    from bloomtrain.config import Config
    from bloomtrain.data.loader import build_train_valid_test_datasets

    cfg = Config.load(str(run_dir / "demo_config.yaml"), [])
    _, valid, _ = build_train_valid_test_datasets(cfg.data, tokenizer, [1, num, 0],
                                                  cfg.data.seq_length)
    return [np.asarray(valid[i]) for i in range(num)]


def perplexity(model, samples) -> float:
    x = torch.tensor(np.stack(samples), dtype=torch.long)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), 16):
            batch = x[i:i + 16]
            logits = model(batch[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     batch[:, 1:].flatten(), reduction="sum")
            total += loss.item()
            count += batch[:, 1:].numel()
    return math.exp(total / count)


def int8_report(checkpoint, samples) -> dict:
    from bloomtrain.serve.quantize import model_bytes, quantize_model

    fp32 = load_model(checkpoint, dtype="fp32")
    int8 = quantize_model(copy.deepcopy(fp32))
    bf16_bytes = model_bytes(load_model(checkpoint, dtype="bf16"))
    ppl, ppl_q = perplexity(fp32, samples), perplexity(int8, samples)
    return {"bytes_fp32": model_bytes(fp32), "bytes_bf16": bf16_bytes,
            "bytes_int8": model_bytes(int8), "ppl_fp32": ppl, "ppl_int8": ppl_q,
            "ppl_delta_rel": (ppl_q - ppl) / ppl, "valid_samples": len(samples)}


def workload(samples, num: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        length = int(rng.choice(PROMPT_LENGTHS))
        out.append((samples[i % len(samples)][:length].tolist(), int(rng.choice(OUTPUT_LENGTHS))))
    return out


def baseline(model, requests, eos, vocab_limit) -> dict:
    """The same requests, one at a time, through `generate`."""
    generate(model, torch.tensor([requests[0][0]]), 4)  # warm up the kernels
    tokens = 0
    t0 = time.perf_counter()
    for prompt, max_tokens in requests:
        out = generate(model, torch.tensor([prompt]), max_tokens, eos_token_id=eos,
                       vocab_limit=vocab_limit)[0, len(prompt):].tolist()
        tokens += out.index(eos) if eos in out else len(out)
    wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def joined(halves: list[dict]) -> dict:
    tokens = sum(h["output_tokens"] for h in halves)
    wall = sum(h["wall_s"] for h in halves)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


class Server:
    def __init__(self, checkpoint, threads: int, max_num_seqs: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bloomtrain", "serve", "--checkpoint", str(checkpoint),
             "--port", "0", "--threads", str(threads), "--max-num-seqs", str(max_num_seqs),
             "--max-batched-tokens", str(max(256, 64 + max_num_seqs)),
             "--max-model-len", "512"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout],
                         daemon=True).start()
        log = []
        while True:
            line = self.lines.get(timeout=600)
            log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError("bloomtrain serve exited:\n" + "".join(log))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


async def run_load(url: str, requests, clients: int) -> dict:
    import aiohttp

    todo = list(range(len(requests)))
    ttft, itl, tokens = [], [], 0

    async def client(session):
        nonlocal tokens
        while todo:
            prompt, max_tokens = requests[todo.pop(0)]
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            t_send = time.perf_counter()
            last = None
            async with session.post("/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "usage" in event:
                        tokens += event["usage"]["completion_tokens"]
                    if not any(c["text"] for c in event.get("choices", [])):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t_send)
                    else:
                        itl.append(now - last)
                    last = now

    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=None)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(itl, 50)),
            "itl_p99_s": float(np.percentile(itl, 99))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=str(Path(tempfile.gettempdir()) / "bloomtrain_serve_load"),
                    help="a `bloomtrain demo` run directory (trained here when it has none)")
    ap.add_argument("--demo-iters", type=int, default=100)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the server and of the baseline (default: 1)")
    ap.add_argument("--valid-samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of (half the baseline, the most clients, the other half, "
                         "the other client counts); medians reported")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(args.threads)

    from bloomtrain.data.tokenizer import load_tokenizer
    run_dir = Path(args.run_dir)
    checkpoint = ensure_demo(run_dir, args.demo_iters)
    tokenizer = load_tokenizer(checkpoint_tokenizer(str(checkpoint), None))
    eos = tokenizer.eod_id
    samples = validation_samples(run_dir, tokenizer, args.valid_samples)
    requests = workload(samples, args.requests, args.seed)

    quant = int8_report(checkpoint, samples)
    print(f"int8: {quant['bytes_int8'] / 2**20:.2f} MiB vs fp32 {quant['bytes_fp32'] / 2**20:.2f}"
          f" ({quant['bytes_int8'] / quant['bytes_fp32']:.3f}x), bf16 "
          f"{quant['bytes_bf16'] / 2**20:.2f} ({quant['bytes_int8'] / quant['bytes_bf16']:.3f}x);"
          f" valid perplexity {quant['ppl_fp32']:.4f} -> {quant['ppl_int8']:.4f} "
          f"({100 * quant['ppl_delta_rel']:+.3f}%)", flush=True)

    # Rounds alternate the baseline and the server's loads, so that a machine whose speed
    # drifts (a shared one) moves both sides alike; each round's ratio uses its own baseline,
    # and the medians are reported.
    server = Server(checkpoint, args.threads, max(clients))
    model = load_model(checkpoint)
    bases, runs = [], {c: [] for c in clients}
    half = len(requests) // 2
    order = sorted(clients, reverse=True)
    try:
        asyncio.run(run_load(server.url, requests[:2], 1))  # warm-up
        for r in range(args.rounds):
            first = baseline(model, requests[:half], eos, tokenizer.vocab_size)
            loads = {order[0]: asyncio.run(run_load(server.url, requests, order[0]))}
            base = joined([first, baseline(model, requests[half:], eos, tokenizer.vocab_size)])
            bases.append(base)
            print(f"round {r + 1}: baseline (generate, one request at a time, in two halves "
                  f"around the {order[0]}-client load) {base['output_tokens']} tokens in "
                  f"{base['wall_s']:.1f} s = {base['tokens_per_s']:.1f} tokens/s", flush=True)
            for c in order:
                run = loads.get(c) or asyncio.run(run_load(server.url, requests, c))
                run["vs_baseline"] = run["tokens_per_s"] / base["tokens_per_s"]
                runs[c].append(run)
                print(f"  {c:>2} clients: {run['tokens_per_s']:8.1f} tokens/s "
                      f"({run['vs_baseline']:.2f}x baseline)", flush=True)
    finally:
        server.stop()
    base = {"tokens_per_s": statistics.median(b["tokens_per_s"] for b in bases),
            "output_tokens": bases[0]["output_tokens"], "rounds": bases}
    rows = []
    for c in clients:
        row = {"clients": c, "output_tokens": runs[c][0]["output_tokens"]}
        for key in ("tokens_per_s", "vs_baseline", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                    "itl_p99_s"):
            row[key] = statistics.median(run[key] for run in runs[c])
        row["vs_baseline_rounds"] = [run["vs_baseline"] for run in runs[c]]
        rows.append(row)

    print(f"\nmodel {checkpoint}, {args.requests} requests (prompts {PROMPT_LENGTHS}, outputs "
          f"{OUTPUT_LENGTHS} tokens, greedy), torch threads {args.threads}, medians of "
          f"{args.rounds} rounds (x base: of each round's ratio to its own baseline)")
    print(f"{'clients':>7} {'tok/s':>8} {'x base':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}")
    print(f"{'base':>7} {base['tokens_per_s']:>8.1f} {1.0:>6.2f}")
    for r in rows:
        print(f"{r['clients']:>7} {r['tokens_per_s']:>8.1f} {r['vs_baseline']:>6.2f} "
              f"{1e3 * r['ttft_p50_s']:>7.1f}ms {1e3 * r['ttft_p99_s']:>7.1f}ms "
              f"{1e3 * r['itl_p50_s']:>6.1f}ms {1e3 * r['itl_p99_s']:>6.1f}ms")
    print(json.dumps({"bench": "serve_load", "checkpoint": str(checkpoint),
                      "requests": args.requests, "threads": args.threads,
                      "rounds": args.rounds, "baseline": base,
                      "results": rows, "int8": quant}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
