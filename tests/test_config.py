import pytest

from bloomtrain.config import Config, apply_override, parse_data_paths
from bloomtrain.validate import validate
from bloomtrain.errors import UserError


def base(**over):
    d = {"data": {"paths": ["x_text_document"]}, "train": {"train_iters": 10}}
    for k, v in over.items():
        apply_override(d, f"{k}={v}")
    return Config.from_dict(d)


def test_yaml_and_dotted_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  preset: tiny\ntrain:\n  train_iters: 5\n  global_batch_size: 16\n")
    cfg = Config.load(str(p), ["train.micro_batch_size=2", "optim.lr=1e-4",
                               "train.rampup_batch_size=[4,4,100]", "checkpoint.dir=null",
                               "data.paths=['0.3 a', '0.7 b']"])
    assert cfg.train.train_iters == 5 and cfg.train.micro_batch_size == 2
    assert cfg.optim.lr == 1e-4 and cfg.train.rampup_batch_size == [4, 4, 100]
    assert cfg.checkpoint.dir is None
    assert parse_data_paths(cfg.data.paths) == [(0.3, "a"), (0.7, "b")]
    again = Config.from_dict(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("over,match", [
    ({"train.global_batch_size": 10, "train.micro_batch_size": 4}, "divisible by"),
    ({"train.precision": "fp8"}, "bf16, fp16 or fp32"),
    ({"train.train_samples": 100}, "exactly one"),
    ({"optim.min_lr": 1.0}, "min_lr"),
    ({"model.preset": "nope"}, "unknown"),
    ({"data.split": "a,b"}, "data.split"),
    ({"optim.decay_style": "step"}, "cosine, linear or constant"),
    ({"train.rampup_batch_size": "[3,2,100]"}, "divisible"),
])
def test_validation_messages(over, match):
    cfg = base(**over)
    with pytest.raises(UserError, match=match):
        validate(cfg, 1)


def test_the_three_timeouts_and_the_watchdog_before_the_collective_timeout():
    cfg = base()
    p = cfg.parallel
    assert (p.timeout_minutes, p.hang_timeout_minutes, p.rdzv_timeout_minutes) == (10, None, 10)
    assert p.hang_timeout_s == 540  # 90% of the collective timeout unless set
    p.hang_timeout_minutes = 2
    assert p.hang_timeout_s == 120
    validate(cfg, 1)
    # The watchdog must report before the collective timeout ends a rank without a report.
    for hang in (10, 12):
        p.hang_timeout_minutes = hang
        with pytest.raises(UserError) as e:
            validate(cfg, 1)
        assert str(e.value) == (
            f"parallel.hang_timeout_minutes ({hang}) must be less than parallel.timeout_minutes "
            f"(10): the watchdog reports a hung rank before the collective timeout ends it "
            f"without a report; lower it or raise parallel.timeout_minutes")
    p.timeout_minutes = 20  # the companion key makes it valid
    validate(cfg, 1)


def test_unknown_keys_and_types():
    with pytest.raises(UserError, match="unknown key"):
        Config.from_dict({"train": {"microbatch": 2}})
    with pytest.raises(UserError, match="unknown config section"):
        Config.from_dict({"trian": {}})
    with pytest.raises(UserError, match="must be an integer"):
        Config.from_dict({"train": {"micro_batch_size": "two"}})
    with pytest.raises(UserError, match="section.key=value"):
        apply_override({}, "train.micro_batch_size")


@pytest.mark.parametrize("data,guess", [
    ({"train": {"micro_batch_sise": 2}}, "train.micro_batch_size"),   # the closest of the section
    ({"parallel": {"zero": 1}}, "parallel.zero_stage"),
    ({"train": {"lr": 1e-3}}, "optim.lr"),                           # the key of another section
    ({"trian": {"train_iters": 5}}, "train"),                         # a section
    ({"lr": 1e-3}, "optim.lr"),                                       # a key outside its section
])
def test_a_mistyped_key_gets_the_closest_valid_one(data, guess):
    with pytest.raises(UserError) as e:
        Config.from_dict(data)
    assert f"(did you mean {guess}?)" in str(e.value)


def test_nothing_close_suggests_nothing_and_several_keys_each_theirs():
    with pytest.raises(UserError) as e:
        Config.from_dict({"train": {"qqqqqqq": 1}})
    assert "did you mean" not in str(e.value)
    with pytest.raises(UserError) as e:
        Config.load(None, ["train.glboal_batch_size=8", "train.micro_batch_sise=2"])
    assert ("(did you mean train.global_batch_size for train.glboal_batch_size, "
            "train.micro_batch_size for train.micro_batch_sise?)") in str(e.value)


def test_every_bad_key_and_value_in_one_error():
    # Unknown keys, values of the wrong type and values out of their domain come together, each
    # on its own line, not one per attempt.
    with pytest.raises(UserError) as e:
        Config.load(None, ["train.micro_batch_sise=2", "optim.lr=abc", "parallel.tp=x"])
    lines = str(e.value).splitlines()
    assert lines[0] == "3 problems; change each of these:"
    assert any("unknown key(s) ['train.micro_batch_sise']" in line for line in lines)
    assert any("optim.lr must be a finite number" in line for line in lines)
    assert any("parallel.tp must be an integer" in line for line in lines)
    cfg = base(**{"optim.lr": -1, "train.micro_batch_size": 0, "optim.beta1": 2})
    with pytest.raises(UserError) as e:
        cfg.check()
    assert str(e.value).splitlines() == [
        "3 problems; change each of these:", "  - optim.lr must be positive, got -1.0",
        "  - optim.beta1 must be in [0, 1), got 2.0",
        "  - train.micro_batch_size must be positive, got 0"]


def test_batch_must_split_over_data_parallel():
    cfg = base(**{"train.global_batch_size": 8, "train.micro_batch_size": 4})
    validate(cfg, 2)
    with pytest.raises(UserError, match=r"micro_batch_size \* dp \(4 \* 3 = 12\)"):
        validate(cfg, 3)


def test_rampup_sizes_must_fit_the_interleaved_schedule():
    cfg = base(**{"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                  "parallel.num_virtual_stages": 2, "parallel.pp_partition": "uniform",
                  "train.global_batch_size": 8, "train.rampup_batch_size": "[3,1,30]",
                  "train.train_samples": 100, "train.train_iters": "null"})
    with pytest.raises(UserError, match=r"rampup_batch_size: at global batch 3: the interleaved "
                                        r"schedule needs the number of micro-batches \(3"):
        validate(cfg, 2)


# ---- every key's domain (bloomtrain.config.DOMAINS), inside accepted and outside refused ---------
# The table is the documentation of each key's values; check() enforces it. The oracle here reads
# the table's bounds and choices itself (never Domain.check): every key at the edges of its domain
# below, and random values inside and outside each one in tests/test_fuzz.py, so a check() that
# skipped a key, or skipped everything, fails.

import dataclasses  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import typing  # noqa: E402

from bloomtrain.config import DOMAINS, Domain, parse_split  # noqa: E402


def _key_types() -> dict[str, typing.Any]:
    out = {"run_dir": str}
    for section in dataclasses.fields(Config):
        cls = type(getattr(Config(), section.name))
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            out.update({f"{section.name}.{f.name}": hints[f.name] for f in dataclasses.fields(cls)})
    return out


KEY_TYPES = _key_types()


def _base_type(key: str):
    """int, float, str, bool or list for a key, without its Optional (a Literal of choices: the
    type of its choices)."""
    tp = KEY_TYPES[key]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = args[0] if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"),
                                                                   "UnionType", None)) else tp
    if typing.get_origin(tp) is typing.Literal:
        return type(typing.get_args(tp)[0])
    return list if typing.get_origin(tp) is list else tp


def _optional(key: str) -> bool:
    return type(None) in typing.get_args(KEY_TYPES[key])


def inside(key: str, value) -> bool:
    """The test's own reading of DOMAINS[key]: is `value` (as loaded) one of the key's values?"""
    d = DOMAINS[key]
    if value is None:
        return _optional(key)
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
        return len(nums) <= 3 and all(math.isfinite(x) and x >= 0 for x in nums) and sum(nums) > 0
    if key == "data.paths":
        entries = [str(e).split() for e in value]
        if len(entries) == 1 and len(entries[0]) == 1:
            return True
        for e in entries:
            if len(e) != 2:
                return False
            try:
                w = float(e[0])
            except ValueError:
                return False
            if not (math.isfinite(w) and w > 0):
                return False
        return True
    raise AssertionError(f"no oracle for {key}")


def assert_in_domains(cfg: Config) -> None:
    """A config that check() accepted: every key inside its domain, the rules between keys of a
    section hold (those across sections are bloomtrain.layout's: tests/test_layout.py)."""
    for key in DOMAINS:
        assert inside(key, cfg.get(key)), (key, cfg.get(key))
    t, o, c = cfg.train, cfg.optim, cfg.checkpoint
    assert (t.train_iters is None) != (t.train_samples is None)
    assert o.min_lr <= o.lr
    assert o.decay_samples is None or o.decay_samples > o.warmup_samples
    assert not (c.save_interval or c.save_interval_minutes) or c.dir


def test_every_key_has_a_domain():
    assert set(DOMAINS) == set(KEY_TYPES)


def _companions(key: str, value) -> dict:
    """Other keys set so that check()'s cross-key rules hold for any value of `key` inside its
    domain: the case then stands or falls on `key` alone."""
    if key == "optim.min_lr":
        return {"optim.lr": max(value, 1.0)}
    if key == "optim.lr":
        return {"optim.min_lr": 0.0}
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


def _config_with(key: str, value) -> Config:
    d = {"train": {"train_iters": 1}, "checkpoint": {"dir": "ck"}}
    for k, v in {**_companions(key, value), key: value}.items():
        if "." in k:
            section, name = k.split(".")
            d.setdefault(section, {})[name] = v
        else:
            d[k] = v
    cfg = Config.from_dict(d)
    cfg.check()
    return cfg


def _edges(key: str) -> list[tuple[object, bool]]:
    """(value, inside) at each edge of the key's domain, read from the table's bounds and
    choices, and the documented examples of the parsed ones."""
    d = DOMAINS[key]
    is_int = _base_type(key) is int
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
                ("0,0", False), ("-1,2", False), ("1,,2", False), ("a", False)]
    elif key == "data.paths":
        out += [(["a"], True), (["0.3 a", "0.7 b"], True), (["a", "0.5 b"], False),
                (["0 a"], False), (["1 a b"], False)]
    return out


@pytest.mark.parametrize("key", sorted(k for k, d in DOMAINS.items() if d.kind != "free"))
def test_each_key_at_the_edges_of_its_domain(key):
    # A key whose check is missing fails here whatever the random draws above (model.hidden_dropout
    # = 5 once passed every config test).
    edges = _edges(key)
    assert any(not ok for _, ok in edges) and any(ok for _, ok in edges)
    for value, ok in edges:
        if ok:
            assert _config_with(key, value).get(key) == value
        else:
            with pytest.raises(UserError, match=key.split(".")[-1]):
                _config_with(key, value)
    if key == "model.hidden_dropout":
        with pytest.raises(UserError, match=r"model.hidden_dropout must be in \[0, 1\), got 5"):
            _config_with(key, 5)


# ---- each key's values as its meaning has them, written here, not read from DOMAINS -------------
# The oracle above reads the table itself, so a wrong table passes it: model.hidden_dropout made a
# free key, or attention_dropout's upper bound dropped, passed every test above and the fuzzers.
# Here each key's values come from what the key is (README's configuration reference): a count is
# at least 1, a probability below 1, a seed fits numpy's 32-bit RandomState, and so on.
COUNT_KEYS = (  # positive numbers: 0 and -1 refused, 1 accepted
    "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
    "model.ffn_hidden_size", "model.layer_norm_epsilon", "model.init_method_std",
    "model.make_vocab_size_divisible_by", "parallel.tp", "parallel.pp",
    "parallel.num_virtual_stages", "parallel.bucket_size_mb", "parallel.timeout_minutes",
    "parallel.hang_timeout_minutes", "parallel.rdzv_timeout_minutes",
    "data.seq_length", "optim.lr", "optim.decay_samples", "optim.eps", "optim.initial_loss_scale",
    "optim.loss_scale_window", "optim.hysteresis", "optim.min_loss_scale",
    "train.micro_batch_size", "train.global_batch_size", "train.train_iters",
    "train.train_samples", "train.log_interval", "train.eval_interval", "train.eval_iters",
    "train.loss_spike_window", "train.loss_spike_zscore", "train.exit_duration_minutes",
    "train.eval_harness_interval", "train.eval_harness_limit", "checkpoint.save_interval",
    "checkpoint.save_interval_minutes", "checkpoint.keep_last")
NON_NEGATIVE_KEYS = ("optim.min_lr", "optim.warmup_samples", "optim.weight_decay",
                     "optim.clip_grad", "train.grad_stats_interval")  # 0 means none or off
PROBABILITY_KEYS = ("model.hidden_dropout", "model.attention_dropout", "optim.beta1",
                    "optim.beta2")  # in [0, 1)
SEED_KEYS = ("data.seed", "train.seed")
PROBES: dict[str, tuple[list, list]] = {  # key -> (values accepted, values refused)
    **{k: ([1], [0, -1]) for k in COUNT_KEYS},
    **{k: ([0, 1], [-1]) for k in NON_NEGATIVE_KEYS},
    **{k: ([0, 0.5, 0.999], [1, 5, -0.1]) for k in PROBABILITY_KEYS},
    **{k: ([0, 2 ** 32 - 1], [-1, 2 ** 32]) for k in SEED_KEYS},
    "train.straggler_factor": ([1.5], [1, 0.5]),  # x the median step time: above 1
    "parallel.pp_schedule": (["gpipe", "1f1b", "interleaved"], ["pipedream", ""]),
    "parallel.zero_stage": ([0, 1, 2, 3], [4, -1]),
    "parallel.backend": (["auto", "gloo", "nccl"], ["mpi"]),
    "parallel.grad_reduce_dtype": (["fp32", "bf16", "int8"], ["fp16", "int4"]),
    "parallel.weight_gather_dtype": (["auto", "bf16", "int8"], ["fp32", "int4"]),
    "data.split": (["969,30,1", "98/2", "1"], ["1,2,3,4", "0,0", "-1,2"]),
    "data.paths": ([["a"], ["0.3 a", "0.7 b"]], [["0 a"], ["a", "0.5 b"], ["1 a b"]]),
    "optim.decay_style": (["cosine", "linear", "constant"], ["step", "exponential"]),
    "train.precision": (["bf16", "fp16", "fp32"], ["fp8", "int8"]),
    "train.activation_checkpointing": (["none", "selective", "full"], ["some", "true"]),
    "train.attention": (["auto", "sdpa", "flex", "eager"], ["flash", "math"]),
    "train.device": (["auto", "cpu", "cuda"], ["gpu", "mps"]),
    "train.on_loss_spike": (["log", "skip", "rollback"], ["ignore", "stop"]),
    "checkpoint.on_save_error": (["continue", "stop"], ["retry", "ignore"]),
}
# Keys any value of their type suits: switches, names and paths (checked where they are used).
FREE_KEYS = {
    "model.preset", "parallel.pp_partition", "parallel.pp_timeline", "parallel.sequence_parallel",
    "parallel.comm_stats", "parallel.offload_optimizer", "parallel.grad_error_feedback",
    "parallel.zero_secondary_shard", "parallel.offload_pin_memory",
    "data.tokenizer", "data.cache_dir", "data.eod_mask_loss", "train.rampup_batch_size",
    "train.compile", "train.ignore_plan", "train.kill_switch_path", "train.eval_harness_tasks",
    "train.eval_harness_include_path", "checkpoint.dir", "checkpoint.resume",
    "checkpoint.async_save", "run.tensorboard", "run.wandb", "run_dir"}
PROBE_COMPANIONS = {"parallel.weight_gather_dtype": {"parallel.zero_stage": 3}}


def test_every_key_is_probed_or_free():
    both = FREE_KEYS & set(PROBES)
    missing = set(KEY_TYPES) - FREE_KEYS - set(PROBES)
    assert not both and not missing, (
        f"give each config key values accepted and refused in tests/test_config.py's PROBES, "
        f"from what the key means (or list it in FREE_KEYS): missing {sorted(missing)}, "
        f"in both {sorted(both)}")


@pytest.mark.parametrize("key", sorted(PROBES))
def test_each_key_accepts_and_refuses_what_it_means(key):
    accepted, refused = PROBES[key]
    for value in accepted + refused:
        d = {"train": {"train_iters": 1}, "checkpoint": {"dir": "ck"}}
        over = {**_companions(key, value if value in accepted else 1),
                **PROBE_COMPANIONS.get(key, {}), key: value}
        for k, v in over.items():
            section, name = k.split(".")
            d.setdefault(section, {})[name] = v
        cfg = Config.from_dict(d)
        if value in accepted:
            cfg.check()
            assert cfg.get(key) == value, (key, value)
        else:
            with pytest.raises(UserError, match=re.escape(key)):
                cfg.check()
