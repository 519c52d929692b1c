import pytest

from bloomtrain.config import Config, apply_override, parse_data_paths
from bloomtrain.layout import validate
from bloomtrain.utils import UserError


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


def test_unknown_keys_and_types():
    with pytest.raises(UserError, match="unknown key"):
        Config.from_dict({"train": {"microbatch": 2}})
    with pytest.raises(UserError, match="unknown config section"):
        Config.from_dict({"trian": {}})
    with pytest.raises(UserError, match="must be an integer"):
        Config.from_dict({"train": {"micro_batch_size": "two"}})
    with pytest.raises(UserError, match="section.key=value"):
        apply_override({}, "train.micro_batch_size")


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
