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
