"""metrics.jsonl's JSON: strict, as the format promises. Python's json writes NaN and Infinity
bare, which no strict parser reads (JavaScript's, Go's, serde's stop at the whole line), and a
diverged run or a skipped step's gradient norm has them. They are written as the strings
"NaN", "Infinity" and "-Infinity" (the spelling JavaScript's Number() reads), and bloomtrain's
readers (`loads`) turn them back into floats."""
from __future__ import annotations

import json
import math

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _restore(value):
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return value


def dumps(record: dict) -> str:
    """One record as a line of strict JSON (no newline)."""
    return json.dumps(_strict(record), allow_nan=False)


def loads(line: str | bytes):
    """A line `dumps` wrote (or an older one with bare NaN), non-finite floats restored."""
    return _restore(json.loads(line))
