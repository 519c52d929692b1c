"""Is bench/offload_step.py's timing of the offloaded host step cold? On torch alone, no engine.

The offloaded step (bloomtrain/parallel/zero/offload.py, optimizer.py) runs torch's fused AdamW
and the bf16 cast chunk by chunk (512K elements) as each chunk's gradients land in a ring of four
staging slots; the slot a chunk leaves takes chunk k + 4's gradients at once. Here, on `--numel`
fp32 elements (default 100M, far beyond any cache), the same kernels run four ways, each timed
over the step's kernels only (the copies into the slots stand for the device's DMA, untimed):

- whole:  one AdamW call and one cast on the whole tensors, the cache evicted before: the cold
          reference, every byte from memory (DeepSpeed steps a whole group so);
- ahead:  per chunk, each slot filled four chunks ahead as landed() fills it, the cache evicted
          once before the step: offload_step.py's timing;
- hot:    per chunk, each chunk's gradients copied into its slot just before its step: what a
          benchmark must not time (the gradients read from the cache);
- evict:  per chunk as `hot`, with the cache evicted (and the code warmed again) before every
          chunk: offload_step.py's harsher `evict each` row.

Reported: each way's AdamW time (the part that reads the gradients) and its median paired ratio
to `whole`'s (each round's against that round's: a shared machine's speed drifts), and the
cast's time apart (the whole tensor's cast reads the masters back from memory, the chunks' from
the cache). `ahead` near 1.0x says its gradients come from memory as the whole step's do; `hot`
under it shows what gradients read from the cache would gain.

    python bench/offload_cold.py --threads 2 --rounds 11

Prints a table, then one JSON line. Measures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CHUNK, SLOTS = 1 << 19, 4
KW = dict(amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
          maximize=False, grad_scale=None, found_inf=None)


class Step:
    def __init__(self, numel: int, largest_chunk: int):
        n = numel // largest_chunk * largest_chunk
        self.p, self.g, self.m, self.v = (torch.randn(n) * 0.02 for _ in range(4))
        self.v.abs_()
        self.ring = torch.zeros(SLOTS * largest_chunk)
        self.out = torch.zeros(n, dtype=torch.bfloat16)
        self.step = torch.tensor(3.0)
        self.sweep = torch.ones(256 << 18)  # 256 MiB, twice and more any last-level cache here
        self.tiny = [torch.rand(16384) for _ in range(4)]
        self.tiny_out = torch.zeros(16384, dtype=torch.bfloat16)

    def cold(self) -> None:
        """Evict the data, then warm the code with the same kernels on tiny tensors."""
        float(self.sweep.sum())
        torch._fused_adamw_(*([t] for t in self.tiny), [], [self.step], **KW)
        self.tiny_out.copy_(self.tiny[0])

    def kernels(self, a: int, b: int, grad: torch.Tensor, cast: torch.Tensor) -> tuple:
        """(AdamW's seconds, the cast's) on elements [a, b)."""
        t0 = time.perf_counter()
        torch._fused_adamw_([self.p[a:b]], [grad], [self.m[a:b]], [self.v[a:b]], [],
                            [self.step], **KW)
        t1 = time.perf_counter()
        cast.copy_(self.p[a:b])
        return t1 - t0, time.perf_counter() - t1

    def whole(self) -> tuple:
        self.cold()
        return self.kernels(0, self.p.numel(), self.g, self.out)

    def chunked(self, way: str, chunk: int = CHUNK) -> tuple:
        count, total = self.p.numel() // chunk, (0.0, 0.0)
        slots = [self.ring[i * chunk:(i + 1) * chunk] for i in range(SLOTS)]
        fill = lambda k: slots[k % SLOTS].copy_(self.g[k * chunk:(k + 1) * chunk])  # noqa: E731
        if way == "ahead":
            for k in range(min(SLOTS, count)):
                fill(k)
            self.cold()
        for k in range(count):
            slot = slots[k % SLOTS]
            if way != "ahead":
                fill(k)
            if way == "evict":
                self.cold()
            took = self.kernels(k * chunk, (k + 1) * chunk, slot,
                                slot.view(torch.bfloat16)[:chunk])
            total = (total[0] + took[0], total[1] + took[1])
            if way == "ahead" and k + SLOTS < count:
                fill(k + SLOTS)
        return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=100 << 20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", default="",
                    help="also time `ahead` with these chunk sizes (elements: 1M,2M,...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    more = [int(float(c.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(c[-1], 1))
            for c in args.chunks.split(",") if c]
    s = Step(args.numel, max([CHUNK, *more]))
    ways = {"whole": s.whole, "ahead": lambda: s.chunked("ahead"),
            "hot": lambda: s.chunked("hot"), "evict": lambda: s.chunked("evict")}
    for c in more:
        ways[f"ahead@{c >> 10}K"] = lambda c=c: s.chunked("ahead", c)
    for run in ways.values():  # warm-up
        run()
    times = {w: [] for w in ways}
    for _ in range(args.rounds):
        for w, run in ways.items():
            times[w].append(run())
    result = {"bench": "offload_cold", "numel": s.p.numel(), "threads": args.threads,
              "rounds": args.rounds, "ways": {}}
    print(f"{'way':<12} {'AdamW ms':>9} {'x whole':>8} {'cast ms':>8}")
    for w in ways:
        med = statistics.median(t[0] for t in times[w])
        ratio = statistics.median(x[0] / y[0] for x, y in zip(times[w], times["whole"]))
        cast = statistics.median(t[1] for t in times[w])
        result["ways"][w] = {"adamw_median_s": med, "adamw_vs_whole_paired": ratio,
                             "cast_median_s": cast}
        print(f"{w:<12} {med * 1e3:>9.1f} {ratio:>7.3f}x {cast * 1e3:>8.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
