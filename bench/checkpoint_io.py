"""Checkpoint I/O: save and load time, bytes and write throughput of bloomtrain's sharded
checkpoints (bloomtrain/checkpoint/) for a model of >= 50M parameters at 1 and 4 gloo ranks,
against a plain sequential write + fsync of the same number of bytes in the same directory.

Per layout, on real Trainers (fp32 master weights + Adam moments, 12 bytes per parameter):
- sync save: `CheckpointWriter.save` with async off, barrier to barrier (the slowest rank);
- async save: how long the training thread is blocked (the CPU snapshot) and the total until the
  background commit is done;
- load: `CheckpointReader` in one process, sha256 of every file plus every tensor of every kind
  assembled to full shape; and the Trainer's own resume path (`_maybe_resume`: every rank reads
  the full parameters and keeps its shard), barrier to barrier.
Loads read files just written, so they mostly come from the page cache; the write figures include
fsync. Prints a table, then one JSON line. Measures; asserts nothing.

    python bench/checkpoint_io.py
    python bench/checkpoint_io.py --hidden 768 --layers 8 --vocab 32768 --tp 2 --dir /scratch
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args  # noqa: E402

from bloomtrain import checkpoint as ckpt  # noqa: E402
from bloomtrain.config import Config  # noqa: E402
from bloomtrain.parallel import comm  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

MB = 1e6


def _config(args, data, root, run_dir, tp, zero) -> Config:
    return Config.from_dict({
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
                  "vocab_size": args.vocab},
        "parallel": {"tp": tp, "zero_stage": zero},
        "data": {"paths": [data], "seq_length": 32, "split": "90,10,0"},
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 1,
                  "precision": "fp32", "device": "cpu"},
        "checkpoint": {"dir": str(root), "async_save": False, "keep_last": None,
                       "resume": "none"},
        "run_dir": str(run_dir),
    })


def _slowest(seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    comm.all_reduce(t, comm.world_group(), "bench", op=comm.ReduceOp.MAX)
    return t.tolist()


def _rank_fn(rank, world, args, data, root, run_dir, tp, zero):
    from bloomtrain.train import Trainer
    trainer = Trainer(_config(args, data, root, run_dir, tp, zero), log=lambda *a: None)
    writer = trainer.checkpoints.writer

    comm.barrier(comm.world_group(), "bench")
    trainer.state.step = 1
    t0 = time.perf_counter()
    trainer.checkpoints.save(trainer.state)
    comm.barrier(comm.world_group(), "bench")
    sync_s = time.perf_counter() - t0

    writer.async_save = True
    trainer.state.step = 2
    comm.barrier(comm.world_group(), "bench")
    t0 = time.perf_counter()
    trainer.checkpoints.save(trainer.state)
    blocked_s = time.perf_counter() - t0
    writer.wait()
    comm.barrier(comm.world_group(), "bench")
    async_total_s = time.perf_counter() - t0

    trainer.cfg.checkpoint.resume = str(Path(root) / ckpt.step_dir_name(1))
    comm.barrier(comm.world_group(), "bench")
    t0 = time.perf_counter()
    trainer.checkpoints.resume()
    comm.barrier(comm.world_group(), "bench")
    resume_s = time.perf_counter() - t0
    sync_s, blocked_s, async_total_s, resume_s = _slowest(
        [sync_s, blocked_s, async_total_s, resume_s])
    return {"params": trainer.shape.num_parameters(), "sync_save_s": sync_s,
            "async_blocked_s": blocked_s, "async_total_s": async_total_s,
            "trainer_resume_s": resume_s}


def write_dataset(prefix: Path, vocab: int) -> str:
    from bloomtrain.data.indexed import write_dataset as write
    rng = np.random.RandomState(0)
    docs = [[rng.randint(4, vocab, size=rng.randint(16, 64)).tolist()] for _ in range(200)]
    write(prefix, docs, dtype=np.uint16 if vocab < 65536 else np.int32)
    return str(prefix)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plain_write(path: Path, num_bytes: int, chunk: int = 1 << 24) -> float:
    """Sequential write of `num_bytes` in 16 MiB chunks, then fsync: what the disk gives one
    writer with no format, checksums or renames."""
    block = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = num_bytes
        while left > 0:
            f.write(block[:min(left, chunk)])
            left -= chunk
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def reader_load(path: Path) -> float:
    t0 = time.perf_counter()
    reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    for name in reader.names():
        for kind in ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS:
            reader.load(name, kind)
    reader.close()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p, hidden=768, layers=8, heads=12, vocab=32768)
    p.add_argument("--tp", type=int, default=1, help="tp of the 4-rank layout (dp = 4 / tp)")
    p.add_argument("--dir", help="directory on the disk to measure (default: a temporary one)")
    args = p.parse_args(argv)

    base = Path(tempfile.mkdtemp(prefix="bloomtrain-ckpt-io-", dir=args.dir))
    layouts = [("1 rank", 1, 1, 0), (f"4 ranks (tp={args.tp} dp={4 // args.tp} zero 1)", 4,
                                      args.tp, 1)]
    rows = []
    try:
        data = write_dataset(base / "data" / "synth_text_document", args.vocab)
        for label, world, tp, zero in layouts:
            root = base / f"ck{world}"
            r = run_ranks(world, _rank_fn, args, data, str(root), str(base / f"run{world}"),
                          tp, zero, env={"OMP_NUM_THREADS": "1"})[0]
            step1 = root / ckpt.step_dir_name(1)
            num_bytes = dir_bytes(step1)
            plain_s = plain_write(root / "plain.bin", num_bytes)
            load_s = reader_load(step1)
            rows.append({
                "layout": label, "world_size": world, "tp": tp, "dp": world // tp,
                "zero_stage": zero, "params": r["params"],
                "files": len(ckpt.read_manifest(step1)["files"]), "bytes": num_bytes,
                "sync_save_s": r["sync_save_s"],
                "sync_save_MBps": num_bytes / MB / r["sync_save_s"],
                "async_blocked_s": r["async_blocked_s"], "async_total_s": r["async_total_s"],
                "async_total_MBps": num_bytes / MB / r["async_total_s"],
                "plain_write_s": plain_s, "plain_write_MBps": num_bytes / MB / plain_s,
                "save_vs_plain": plain_s / r["sync_save_s"],
                "reader_load_s": load_s, "reader_load_MBps": num_bytes / MB / load_s,
                "trainer_resume_s": r["trainer_resume_s"],
            })
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    psi = rows[0]["params"]
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"Ψ = {psi:,} parameters; checkpoint = fp32 master + exp_avg + exp_avg_sq "
          f"(12 Ψ = {12 * psi / MB:.0f} MB) + manifest; disk: {base.parent}")
    head = (f"{'layout':<28} {'files':>5} {'MB':>7} {'save s':>7} {'MB/s':>7} {'plain s':>8} "
            f"{'MB/s':>7} {'async blk':>9} {'async tot':>9} {'load s':>7} {'resume s':>8}")
    print(head)
    for r in rows:
        print(f"{r['layout']:<28} {r['files']:>5} {r['bytes'] / MB:>7.0f} "
              f"{r['sync_save_s']:>7.2f} {r['sync_save_MBps']:>7.0f} {r['plain_write_s']:>8.2f} "
              f"{r['plain_write_MBps']:>7.0f} {r['async_blocked_s']:>9.2f} "
              f"{r['async_total_s']:>9.2f} {r['reader_load_s']:>7.2f} "
              f"{r['trainer_resume_s']:>8.2f}")
    print(json.dumps({"bench": "checkpoint_io", "hidden": args.hidden, "layers": args.layers,
                      "vocab": args.vocab, "params": psi, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
