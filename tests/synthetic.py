"""A small synthetic token dataset shared by the training tests and the chaos script."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_synthetic_dataset(prefix: Path) -> str:
    """Token streams built from repeated phrases (vocab 256, EOD 2), so the loss can actually
    fall and a wrong resume shows up in every later step. Returns the prefix."""
    from bloomtrain.data.indexed import write_dataset
    rng = np.random.RandomState(0)
    phrases = [rng.randint(4, 256, size=rng.randint(3, 9)) for _ in range(40)]
    docs = []
    for _ in range(300):
        picks = rng.randint(0, len(phrases), size=rng.randint(4, 14))
        docs.append([np.concatenate([phrases[i] for i in picks] + [[2]]).tolist()])
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_dataset(prefix, docs, dtype=np.uint16)
    return str(prefix)


def tiny_job_yaml(dataset: str, run_dir, extra: str = "") -> str:
    """The YAML of a 6-step tiny-model run on the synthetic dataset, for tests that launch
    `bloomtrain train` as users do; `extra` adds lines (parallel:, checkpoint:, ...)."""
    return (f"model: {{preset: tiny, vocab_size: 256}}\n"
            f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
            f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: 400}}\n"
            f"train: {{micro_batch_size: 4, global_batch_size: 8, train_iters: 6, precision: fp32,"
            f" log_interval: 1, device: cpu, eval_iters: 1}}\n"
            f"{extra}run_dir: {run_dir}\n")
