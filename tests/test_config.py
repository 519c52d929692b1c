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


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path):
    """YAML keeps the last of a repeated key without a word: a second `parallel:` section
    dropped the first's tp and zero_stage, and the run started on another layout. A merge key
    (`<<: *base`) still merges, and the same key in two mappings is two keys."""
    import yaml

    cases = {"sections.yaml": ("parallel: {tp: 2, zero_stage: 1}\ntrain: {train_iters: 1}\n"
                               "parallel: {pp: 1}\n",
                               "'parallel' is given twice in one mapping (line 1 column 1, and "
                               "line 3 column 1); keep one"),
             "keys.yaml": ("optim: {lr: 1e-3, lr: 2e-3}\n",
                           "'lr' is given twice in one mapping (line 1 column 9, and line 1 "
                           "column 19); keep one")}
    for name, (text, said) in cases.items():
        (tmp_path / name).write_text(text)
        assert yaml.safe_load(text)  # PyYAML itself takes it, keeping the last
        with pytest.raises(UserError) as e:
            Config.load(str(tmp_path / name))
        assert str(e.value) == f"config file {tmp_path / name} is not valid YAML: {said}"
    (tmp_path / "merge.yaml").write_text(
        "x-common: &lr {lr: 1.0e-3}\noptim:\n  <<: *lr\n  min_lr: 1.0e-5\n"
        "model: {preset: tiny}\ntrain: {train_iters: 2}\n")
    with pytest.raises(UserError, match=r"unknown config section\(s\) \['x-common'\]"):
        Config.load(str(tmp_path / "merge.yaml"))  # merged fine; the anchor's key is unknown
    apply_override(d := {}, "optim={lr: 1, min_lr: 0.1}")
    assert d == {"optim": {"lr": 1, "min_lr": 0.1}}


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
    with pytest.raises(UserError, match=r"rampup_batch_size \[3, 1, 30\]: the interleaved "
                                        r"schedule needs the number of micro-batches \(3"):
        validate(cfg, 2)


def test_a_ramp_that_does_not_split_names_the_ramp():
    """The ramp's own size, not train.global_batch_size (16, which splits): "global_batch_size
    (2) must be divisible" named a value the user never set."""
    cfg = base(**{"train.global_batch_size": 16, "train.micro_batch_size": 2,
                  "train.rampup_batch_size": "[2,2,100]", "train.train_samples": 1000,
                  "train.train_iters": "null"})
    with pytest.raises(UserError) as e:
        validate(cfg, 2)
    text = str(e.value)
    assert "rampup_batch_size [2, 2, 100]: its batch 2 must be divisible by" in text, text
    assert "global_batch_size (2)" not in text and "start or increment" in text


# ---- every key's domain (bloomtrain.config.DOMAINS), inside accepted and outside refused ---------
# The table is the documentation of each key's values; check() enforces it. The oracle here reads
# the table's bounds and choices itself (never Domain.check): every key at the edges of its domain
# below, and random values inside and outside each one in tests/robustness/test_fuzz.py, so a check() that
# skipped a key, or skipped everything, fails.

import re  # noqa: E402

from bloomtrain.config import DOMAINS  # noqa: E402
from tests.domains import KEY_TYPES, companions, config_with, edges  # noqa: E402


def test_every_key_has_a_domain():
    assert set(DOMAINS) == set(KEY_TYPES)


@pytest.mark.parametrize("key", sorted(k for k, d in DOMAINS.items() if d.kind != "free"))
def test_each_key_at_the_edges_of_its_domain(key):
    # A key whose check is missing fails here whatever the random draws above (model.hidden_dropout
    # = 5 once passed every config test).
    cases = edges(key)
    assert any(not ok for _, ok in cases) and any(ok for _, ok in cases)
    for value, ok in cases:
        if ok:
            assert config_with(key, value).get(key) == value
        else:
            with pytest.raises(UserError, match=key.split(".")[-1]):
                config_with(key, value)
    if key == "model.hidden_dropout":
        with pytest.raises(UserError, match=r"model.hidden_dropout must be in \[0, 1\), got 5"):
            config_with(key, 5)


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
    "data.paths": ([["a"], ["0.3 a", "0.7 b"], ["1 a b"]], [["0 a"], ["a", "0.5 b"]]),
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
    "train.compile", "train.ignore_plan", "train.kill_switch_path", "optim.override_schedule", "data.override_order",
    "train.eval_harness_tasks",
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
        over = {**companions(key, value if value in accepted else 1),
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


def test_a_minimum_loss_scale_above_the_initial_is_refused():
    # Megatron's DynamicGradScaler asserts min_scale <= initial_scale; accepted, an overflow
    # raised the scale to the minimum.
    cfg = Config.from_dict({"train": {"train_iters": 1},
                            "optim": {"initial_loss_scale": 2.0, "min_loss_scale": 64.0}})
    with pytest.raises(UserError, match=r"optim.min_loss_scale \(64\) must not exceed "
                                        r"optim.initial_loss_scale \(2\)"):
        cfg.check()


def test_a_string_key_takes_an_override_as_typed():
    """Overrides are YAML, but a string-typed key keeps the text typed: run_dir=0100 wrote the
    run into a directory named 64 (YAML's octal), run_dir=2026-12-07 was refused as a date,
    data.tokenizer=1.10 read 1.1. Other keys still read YAML's value."""
    cfg = Config.load(None, ["run_dir=0100", "data.tokenizer=1.10", "parallel.tp=2.0",
                             "train.train_iters=0x10", "optim.lr=1e-4",
                             "checkpoint.dir=~", "run.tensorboard=yes"])
    assert (cfg.run_dir, cfg.data.tokenizer, cfg.parallel.tp, cfg.train.train_iters,
            cfg.optim.lr, cfg.checkpoint.dir, cfg.run.tensorboard) == \
        ("0100", "1.10", 2, 16, 1e-4, None, True)
    assert Config.load(None, ["run_dir=2026-12-07"]).run_dir == "2026-12-07"
    with pytest.raises(UserError, match="parallel.tp must be an integer, got True"):
        Config.load(None, ["parallel.tp=true"])


def test_data_paths_keep_their_text_and_their_spaces():
    """data.paths=0100 became ['64'] (YAML's octal), as run_dir did before. A prefix with a
    space (preprocess writes `my data/c` without complaint) was refused with a message whose
    every suggestion failed too."""
    from bloomtrain.config import data_paths_weighted, parse_data_paths
    assert Config.load(None, ["data.paths=0100"]).data.paths == ["0100"]
    assert Config.load(None, ["data.paths=1_000"]).data.paths == ["1_000"]
    assert Config.load(None, ["data.paths=[0100, 1e3]"]).data.paths == ["0100", "1e3"]
    assert Config.load(None, ["train.rampup_batch_size=[2, 2, 0x10]"]).train.rampup_batch_size \
        == [2, 2, 16]  # other lists still read YAML's values
    assert parse_data_paths(["my data/c_text_document"]) == [(1.0, "my data/c_text_document")]
    assert parse_data_paths(["0.3 my data/a", "0.7 b c/d"]) == [(0.3, "my data/a"),
                                                                (0.7, "b c/d")]
    assert not data_paths_weighted(["my data/c"]) and data_paths_weighted(["1 my data/c"])
    with pytest.raises(UserError, match="give each a weight"):
        parse_data_paths(["0.3 a", "my data/b"])
    with pytest.raises(UserError, match="weight must be positive"):
        parse_data_paths(["-1 a"])


@pytest.mark.parametrize("typed,said", [
    ("train.fp16=true", "train.precision=fp16"), ("train.bf16=true", "train.precision=bf16"),
    ("optim.learning_rate=1e-4", "optim.lr"), ("train.iters=3", "train.train_iters"),
    ("train.max_steps=3", "train.train_iters"), ("optim.zero_stage=1", "parallel.zero_stage"),
    ("train.micro_batch_sise=2", "train.micro_batch_size")])
def test_megatron_and_hf_names_get_ours(typed, said):
    # difflib alone sent train.fp16 to train.compile and train.iters to train.eval_iters.
    with pytest.raises(UserError, match=rf"\(did you mean {re.escape(said)}\?\)"):
        Config.load(None, [typed])


def test_run_tensorboard_auto_and_a_dp_key_say_what_they_mean(tmp_path):
    """`auto`, the default the README names for run.tensorboard, was refused; parallel.dp was
    told to be parallel.tp, another axis."""
    assert Config.load(None, ["run.tensorboard=auto"]).run.tensorboard is None
    (tmp_path / "c.yaml").write_text("run: {tensorboard: auto}\n")
    assert Config.load(str(tmp_path / "c.yaml")).run.tensorboard is None
    with pytest.raises(UserError, match=r"run.tensorboard must be true or false \(or auto\)"):
        Config.load(None, ["run.tensorboard=maybe"])
    with pytest.raises(UserError, match=r"\(parallel.dp is not a key: the data-parallel size is "
                                        r"the number of processes / \(parallel.tp \* "
                                        r"parallel.pp\); set it with --nproc"):
        Config.load(None, ["parallel.dp=2"])
