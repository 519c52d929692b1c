"""The config keys' types and domains as the tests read them, independently of bloomtrain's checks:
each key's type from the Config dataclasses, an oracle for "is this value inside the key's
domain", configs that set one key with what its cross-key rules need, and each domain's edges.
Used by tests/test_config.py (every key at its edges) and tests/robustness/test_fuzz.py (random configs)."""
from __future__ import annotations

import dataclasses
import math
import typing

from bloomtrain.config import DOMAINS, Config


def key_types() -> dict[str, typing.Any]:
    out = {"run_dir": str}
    for section in dataclasses.fields(Config):
        cls = type(getattr(Config(), section.name))
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            out.update({f"{section.name}.{f.name}": hints[f.name] for f in dataclasses.fields(cls)})
    return out


KEY_TYPES = key_types()


def base_type(key: str):
    """int, float, str, bool or list for a key, without its Optional (a Literal of choices: the
    type of its choices)."""
    tp = KEY_TYPES[key]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = args[0] if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"),
                                                                   "UnionType", None)) else tp
    if typing.get_origin(tp) is typing.Literal:
        return type(typing.get_args(tp)[0])
    return list if typing.get_origin(tp) is list else tp


def optional(key: str) -> bool:
    return type(None) in typing.get_args(KEY_TYPES[key])


def inside(key: str, value) -> bool:
    """The test's own reading of DOMAINS[key]: is `value` (as loaded) one of the key's values?"""
    d = DOMAINS[key]
    if value is None:
        return optional(key)
    if d.kind == "free":
        return True
    if d.kind == "choice":
        return value in d.choices
    if d.kind == "interval":
        return ((value > d.low if d.low_open else value >= d.low)
                and (value < d.high if d.high_open else value <= d.high))
    if key == "data.split":  # "969,30,1" or "98/2": up to three numbers, one separator
        text = str(value)
        try:
            nums = [float(p) for p in text.split("," if "," in text else "/")]
        except ValueError:
            return False
        # and training (the first part) gets a share: a run with none has nothing to train
        return len(nums) <= 3 and all(math.isfinite(x) and x >= 0 for x in nums) and \
            nums[0] > 0
    if key == "data.paths":
        # An entry whose first word is a number is "WEIGHT PREFIX" (the prefix may hold
        # spaces); any other entry is a prefix alone, which only a lone entry may be.
        weights = []
        for e in value:
            words = str(e).strip().split(None, 1)
            if not words:
                return False
            try:
                weights.append(float(words[0]) if len(words) == 2 else None)
            except ValueError:
                weights.append(None)
        if len(weights) == 1 and weights[0] is None:
            return True
        return all(w is not None and math.isfinite(w) and w > 0 for w in weights) and \
            math.isfinite(sum(weights))
    raise AssertionError(f"no oracle for {key}")


def assert_in_domains(cfg: Config) -> None:
    """A config that check() accepted: every key inside its domain, the rules between keys of a
    section hold (those across sections are bloomtrain.layout's: tests/test_layout.py)."""
    for key in DOMAINS:
        assert inside(key, cfg.get(key)), (key, cfg.get(key))
    t, o, c = cfg.train, cfg.optim, cfg.checkpoint
    assert (t.train_iters is None) != (t.train_samples is None)
    assert o.min_lr <= o.lr
    assert o.min_loss_scale <= o.initial_loss_scale
    assert o.decay_samples is None or o.decay_samples > o.warmup_samples
    assert not (c.save_interval or c.save_interval_minutes) or c.dir


def companions(key: str, value) -> dict:
    """Other keys set so that check()'s cross-key rules hold for any value of `key` inside its
    domain: the case then stands or falls on `key` alone."""
    if key == "optim.min_lr":
        return {"optim.lr": max(value, 1.0)}
    if key == "optim.lr":
        return {"optim.min_lr": 0.0}
    if key == "optim.min_loss_scale":  # Megatron's rule: min <= initial
        return {"optim.initial_loss_scale": max(value, 2.0 ** 32)}
    if key == "optim.initial_loss_scale":
        return {"optim.min_loss_scale": min(value, 1.0)}
    if key == "train.train_samples":
        return {"train.train_iters": None}
    if key == "parallel.weight_gather_dtype":
        return {"parallel.zero_stage": 3}
    if key == "parallel.grad_error_feedback":
        return {"parallel.grad_reduce_dtype": "int8"}
    if key == "parallel.zero_secondary_shard":
        return {"parallel.zero_stage": 3}
    if key == "parallel.offload_pin_memory":  # it pins the offloaded states
        return {"parallel.offload_optimizer": True}
    if key == "parallel.hang_timeout_minutes":  # the watchdog fires before the collective timeout
        from bloomtrain.config import WEEK_MINUTES
        return {"parallel.timeout_minutes": min(max(2 * value, 1.0), WEEK_MINUTES)}
    return {}


def config_with(key: str, value) -> Config:
    d = {"train": {"train_iters": 1}, "checkpoint": {"dir": "ck"}}
    for k, v in {**companions(key, value), key: value}.items():
        if "." in k:
            section, name = k.split(".")
            d.setdefault(section, {})[name] = v
        else:
            d[k] = v
    cfg = Config.from_dict(d)
    cfg.check()
    return cfg


def edges(key: str) -> list[tuple[object, bool]]:
    """(value, inside) at each edge of the key's domain, read from the table's bounds and
    choices, and the documented examples of the parsed ones."""
    d = DOMAINS[key]
    is_int = base_type(key) is int
    step = 1 if is_int else 1e-9
    out = []
    if d.kind == "interval":
        for bound, is_open, outward in ((d.low, d.low_open, -1), (d.high, d.high_open, 1)):
            if math.isinf(bound):
                continue
            bound = int(bound) if is_int else float(bound)
            out += [(bound, not is_open), (bound + outward * step, False),
                    (bound - outward * step, True)]
        if math.isinf(d.high):
            out.append((10 ** 9 if is_int else 1e9, True))
    elif d.kind == "choice":
        out += [(c, True) for c in d.choices]
        out += [(-1 if is_int else "none_of_them", False)]
    elif key == "data.split":
        out += [("969,30,1", True), ("98/2", True), ("1", True), ("1,2,3,4", False),
                ("0,0", False), ("-1,2", False), ("1,,2", False), ("a", False),
                ("0,1,0", False)]
    elif key == "data.paths":
        out += [(["a"], True), (["0.3 a", "0.7 b"], True), (["a", "0.5 b"], False),
                (["0 a"], False), (["1 a b"], True), (["a b"], True), (["a b", "1 c"], False),
                (["1e308 a", "1e308 b"], False)]
    return out
