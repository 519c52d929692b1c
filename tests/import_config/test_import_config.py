"""`bloomtrain import-config`: Megatron-DeepSpeed launches and ds_configs as bloomtrain configs.

The main input is BLOOM-176B's own launch script and ds_config (tests/fixtures/megatron_args/,
see its README), converted and checked key by key against the values the script sets, against
Megatron's defaults for what it leaves out, and against the bloom-176b preset's shape
(docs/bloom_facts.md's published model).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bloomtrain.cli import main
from bloomtrain.config import Config, ModelConfig, parse_data_paths
from bloomtrain.import_config import megatron_to_config
from bloomtrain.import_config.bash import read_launch
from bloomtrain.import_config.megatron_args import OPTIONS, REASONS, parse_argv
from bloomtrain.validate import validate
from bloomtrain.model.presets import resolve_model_config
from bloomtrain.errors import UserError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron_args"
TR11 = FIXTURES / "tr11-176B-ml.slurm"
TR11_FINAL = FIXTURES / "tr11-176B-ml-final.slurm"
TR11_DS = FIXTURES / "tr11-176B-ml.ds_config.json"
# The two variables the script takes from the environment of Jean Zay (its `source`d file).
ENV = ["--var", "six_ALL_CCFRWORK=/gpfswork", "--var", "six_ALL_CCFRSCRATCH=/gpfsscratch"]

BLOOM_176B = {
    "model": {"preset": None, "num_layers": 70, "hidden_size": 14336, "num_heads": 112,
              "ffn_hidden_size": 57344, "init_method_std": 0.0048,
              # Not in the script: Megatron's defaults, which BLOOM trained with.
              "hidden_dropout": 0.1, "attention_dropout": 0.1, "layer_norm_epsilon": 1e-5,
              "vocab_size": 250880, "make_vocab_size_divisible_by": 512},
    "parallel": {"tp": 4, "pp": 12, "pp_partition": "type:transformer|embedding",
                 # ds_config stage 0 in bf16 is DeepSpeed's BF16_Optimizer: ZeRO-1.
                 "zero_stage": 1},
    "data": {"seq_length": 2048, "seed": 42, "eod_mask_loss": False,
             "tokenizer": "bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-no-norm-250k-"
                          "whitespace-and-eos-regex-alpha-v3-dedup-lines-articles"},
    "optim": {"lr": 6e-5, "min_lr": 6e-6, "decay_style": "cosine", "decay_samples": 200_000_000,
              "warmup_samples": 183_105, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
              "eps": 1e-8, "clip_grad": 1.0},
    "train": {"micro_batch_size": 2, "global_batch_size": 2048,
              "rampup_batch_size": [192, 16, 9_765_625], "train_samples": 220_000_000,
              "activation_checkpointing": "full", "seed": 42, "log_interval": 1,
              "eval_interval": 1000, "eval_iters": 1, "exit_duration_minutes": 5990.0,
              "kill_switch_path": "/gpfswork/code/tr11-176B-ml/Megatron-DeepSpeed/"
                                  "kill-switch-tr11-176B-exp1",
              "precision": "bf16"},
    "checkpoint": {"dir": "/gpfsscratch/checkpoints/tr11-176B-ml/checkpoints/main",
                   "save_interval": 100},
    "run": {"tensorboard": True},
}


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["import-config", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bloom_176b_recipe(tmp_path, capsys):
    out_yaml = tmp_path / "bloom.yaml"
    rc, out, err = _run(capsys, "--megatron-args", TR11, *ENV, "--output", out_yaml)
    # BLOOM's data came from BigScience's weighted split groups, which bloomtrain does not read:
    # without --allow-unsupported nothing is written.
    assert rc == 2 and not out_yaml.exists()
    assert "--train-weighted-split-paths-path /gpfswork/code/tr11-176B-ml/Megatron-DeepSpeed/" \
           "data/train-splits.txt: BigScience's weighted split groups" in err
    assert "--allow-unsupported" in err

    rc, out, err = _run(capsys, "--megatron-args", TR11, *ENV, "--output", out_yaml,
                        "--allow-unsupported")
    assert rc == 0, err
    assert yaml.safe_load(out_yaml.read_text()) == BLOOM_176B
    assert "world size: 384 (48 node(s) x 8 process(es) per node" in out
    assert "ds_config: ./ds_config.$SLURM_JOB_ID.json (written by the script)" in out
    cfg = Config.load(str(out_yaml))
    run = validate(cfg, 384)
    assert (run.layout.tp, run.layout.pp, run.layout.dp) == (4, 12, 8)
    assert run.layout.num_micro_batches(2048, 2) == 128
    assert run.batches.global_batch_size_at(0) == 192
    # The shape is the published one: the bloom-176b preset's (docs/bloom_facts.md §1).
    preset = resolve_model_config(ModelConfig(preset="bloom-176b"))
    assert run.shape.replace(hidden_dropout=0.0, attention_dropout=0.0) == preset
    header = out_yaml.read_text().split("\nmodel:")[0]
    assert "# UNSUPPORTED in the source run" in header and "valid-splits.txt" in header


def test_bloom_176b_report(tmp_path, capsys):
    rc, out, err = _run(capsys, "--megatron-args", TR11, *ENV, "--output", tmp_path / "b.yaml",
                        "--allow-unsupported")
    mapped, ignored = out.split("\nignored (")
    for line in ("--tensor-model-parallel-size -> parallel.tp = 4",
                 "--rampup-batch-size -> train.rampup_batch_size = [192, 16, 9765625]",
                 "--hidden-dropout (not given: Megatron's default) -> model.hidden_dropout = 0.1",
                 "--position-embedding-type -> (no key: alibi)",
                 "--bf16 + ds_config bf16.enabled -> train.precision = \"bf16\"",
                 "ds_config zero_optimization.stage -> parallel.zero_stage = 1",
                 "ds_config gradient_clipping -> optim.clip_grad = 1.0",
                 "ds_config train_batch_size -> (no key: 2048)"):
        assert line in mapped, line
    for name in ("--distributed-backend nccl: process setup", "--deepspeed: ",
                 "--deepspeed_config ./ds_config.$SLURM_JOB_ID.json: ",
                 "--deepspeed-activation-checkpointing: ", "--tensorboard-queue-size 5: logging",
                 "--log-timers-to-tensorboard: logging", "--max-position-embeddings 2048: ALiBi",
                 "--abort-on-unmet-fused-kernel-constraints: a kernel choice",
                 "--num-workers 2: ", "--data-impl mmap: ", "--clip-grad 1.0: DeepSpeed clips",
                 "--zero-stage 0: DeepSpeed takes the stage from the ds_config",
                 "--load /gpfsscratch/checkpoints/tr11-176B-ml/checkpoints/main: bloomtrain "
                 "resumes its own", "ds_config steps_per_print: 2000: logging"):
        assert f"\n  {name}" in ignored, name
    assert err.count("!!   ") == 2  # exactly the two split-group files


def test_final_script_and_explicit_ds_config(tmp_path, capsys):
    """BLOOM's last script (24 nodes, --sync-tp-duplicated-parameters), with the ds_config
    given as a file: dp 4 and the rest as before."""
    out_yaml = tmp_path / "final.yaml"
    rc, out, err = _run(capsys, "--megatron-args", TR11_FINAL, *ENV, "--deepspeed-config",
                        TR11_DS, "--output", out_yaml, "--allow-unsupported")
    assert rc == 0, err
    assert yaml.safe_load(out_yaml.read_text()) == BLOOM_176B
    assert "world size: 192 (24 node(s) x 8 process(es)" in out
    assert "--sync-tp-duplicated-parameters: a Megatron-DeepSpeed workaround" in out
    assert validate(Config.load(str(out_yaml)), 192).layout.dp == 4
    # --world-size overrides the script's launch, and says so.
    rc, out, _ = _run(capsys, "--megatron-args", TR11_FINAL, *ENV, "--output", out_yaml,
                      "--allow-unsupported", "--world-size", "384")
    assert rc == 0 and "world size: 384 (--world-size (the script launches 192" in out


def _ds(tmp_path, **changes) -> Path:
    ds = json.loads(TR11_DS.read_text())
    ds.update(changes)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return path


def test_batch_rule_mismatch_shows_the_arithmetic(tmp_path, capsys):
    common = ["--megatron-args", TR11, *ENV, "--output", tmp_path / "x.yaml",
              "--allow-unsupported"]
    rc, _, err = _run(capsys, *common, "--world-size", "768", "--deepspeed-config",
                      _ds(tmp_path, gradient_accumulation_steps=128))
    assert rc == 2
    assert "train_batch_size 2048 != train_micro_batch_size_per_gpu 2 x " \
           "gradient_accumulation_steps 128 x dp 16 (768 GPUs / (tp 4 x pp 12)) = 4096" in err
    rc, _, err = _run(capsys, *common, "--deepspeed-config", _ds(tmp_path, train_batch_size=4096))
    assert rc == 2 and "ds_config train_batch_size 4096 != --global-batch-size 2048" in err
    rc, _, err = _run(capsys, *common, "--world-size", "144")
    assert rc == 2 and "--global-batch-size 2048 is not a multiple of --micro-batch-size 2 x " \
                       "dp 3 (144 GPUs / (tp 4 x pp 12)) = 6" in err
    rc, _, err = _run(capsys, *common, "--world-size", "100")
    assert rc == 2 and "100 GPUs are not divisible by tp 4 x pp 12" in err
    assert not (tmp_path / "x.yaml").exists()


def test_auto_values_resolve(tmp_path, capsys):
    ds = _ds(tmp_path, train_micro_batch_size_per_gpu="auto", train_batch_size="auto",
             gradient_accumulation_steps="auto", gradient_clipping="auto", bf16={"enabled": "auto"},
             zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                  "pin_memory": True},
                                "overlap_comm": True})
    out_yaml = tmp_path / "auto.yaml"
    rc, out, err = _run(capsys, "--megatron-args", TR11, *ENV, "--deepspeed-config", ds,
                        "--output", out_yaml, "--allow-unsupported")
    assert rc == 0, err
    converted = yaml.safe_load(out_yaml.read_text())
    assert converted["train"]["precision"] == "bf16" and converted["optim"]["clip_grad"] == 1.0
    assert converted["parallel"]["zero_stage"] == 1
    assert converted["parallel"]["offload_optimizer"] is True
    assert converted["parallel"]["offload_pin_memory"] is True
    for line in ("ds_config train_micro_batch_size_per_gpu -> (no key: 2)\n      note: auto",
                 "ds_config train_batch_size -> (no key: 2048)\n      note: auto",
                 # at 384 GPUs: 2048 / (2 x dp 8)
                 "ds_config gradient_accumulation_steps -> (no key: 128)",
                 "--clip-grad -> optim.clip_grad = 1.0\n      note: ds_config gradient_clipping "
                 "\"auto\"",
                 "ds_config zero_optimization.offload_optimizer.device -> "
                 "parallel.offload_optimizer = true",
                 "ds_config zero_optimization.offload_optimizer.pin_memory -> "
                 "parallel.offload_pin_memory = true"):
        assert line in out, line
    assert "ds_config zero_optimization.overlap_comm: True: a memory or speed setting" in out


ARGS_FILE = """\
# Megatron-LM's GPT-2 345M example as an args file: one or several arguments a line
--num-layers 24 --hidden-size 1024 --num-attention-heads 16
--seq-length 1024 --max-position-embeddings 1024
--micro-batch-size 8
--global-batch-size 64
--lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 \\
  --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
--lr-warmup-fraction .01 --clip-grad 0.8 --fp16
--data-path 0.3 ${DATA}/a_text_document 0.7 ${DATA}/b_text_document
--tokenizer-type GPT2BPETokenizer
--vocab-file ${DATA}/gpt2-vocab.json --merge-file ${DATA}/gpt2-merges.txt
--split 949,50,1
--position-embedding-type alibi --embed-layernorm
--loss-scale-window 500 --initial-loss-scale 4096
--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--save /ckpt --load /ckpt --distributed-backend nccl
"""


def test_args_file(tmp_path, capsys):
    args_file = tmp_path / "gpt2.args"
    args_file.write_text(ARGS_FILE)
    out_yaml = tmp_path / "gpt2.yaml"
    rc, out, err = _run(capsys, "--megatron-args", args_file, "--var", "DATA=/data",
                        "--output", out_yaml)
    assert rc == 0, err
    c = yaml.safe_load(out_yaml.read_text())
    assert c["data"]["paths"] == ["0.3 /data/a_text_document", "0.7 /data/b_text_document"]
    assert c["data"]["split"] == "949,50,1" and c["data"]["tokenizer"] == "/data/gpt2-vocab.json"
    assert c["train"]["train_iters"] == 500_000 and "train_samples" not in c["train"]
    # Iterations become samples: 320,000 x 64, and warm-up 1% of that.
    assert (c["optim"]["decay_samples"], c["optim"]["warmup_samples"]) == (20_480_000, 204_800)
    assert c["train"]["precision"] == "fp16" and c["parallel"]["zero_stage"] == 0
    assert c["optim"]["clip_grad"] == 0.8
    # Megatron's own fp16 loss scaling (no DeepSpeed), with its defaults where not given.
    assert (c["optim"]["initial_loss_scale"], c["optim"]["loss_scale_window"],
            c["optim"]["hysteresis"], c["optim"]["min_loss_scale"]) == (4096.0, 500, 2, 1.0)
    assert (c["optim"]["beta2"], c["optim"]["weight_decay"], c["model"]["init_method_std"]) == \
        (0.999, 0.01, 0.02)
    assert c["model"]["make_vocab_size_divisible_by"] == 128 and "vocab_size" not in c["model"]
    assert "not checked: the batch rules" in out and "pass --world-size" in out
    Config.load(str(out_yaml)).check()
    rc, _, err = _run(capsys, "--megatron-args", args_file, "--var", "DATA=/data", "--output",
                      out_yaml, "--world-size", "8")
    assert rc == 0, err
    validate(Config.load(str(out_yaml)), 8)
    rc, _, err = _run(capsys, "--megatron-args", args_file, "--output", out_yaml)
    assert rc == 2 and "--data-path is 0.3 $DATA/a_text_document" in err
    assert "pass --var DATA=VALUE" in err


def test_ignored_and_unsupported_name_what_they_should(capsys):
    args = parse_argv(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-samples 100 "
        "--tokenizer-type BertWordPieceCase --vocab-file v.txt --untie-embeddings "
        "--position-embedding-type rotary --no-masked-softmax-fusion --foo-bar 3 "
        "--distributed-backend gloo --deepspeed --glu-activation swiglu --bf16".split())
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
          "data_types": {"grad_accum_dtype": "bf16"}, "flops_profiler": {"enabled": True},
          "no_such_key": 1}
    _, report = megatron_to_config(args, ds, world_size=4)
    unsupported = {s.source.split(":")[0] for s in report.unsupported}
    assert unsupported == {"--tokenizer-type BertWordPieceCase", "--untie-embeddings",
                           "--position-embedding-type rotary", "--foo-bar 3",
                           "--glu-activation swiglu", "--embed-layernorm",
                           "ds_config zero_optimization.offload_param.device",
                           "ds_config data_types.grad_accum_dtype", "ds_config no_such_key"}
    ignored = {s.source for s in report.ignored}
    assert {"--no-masked-softmax-fusion", "--distributed-backend gloo", "--deepspeed",
            "--vocab-file v.txt"} <= ignored
    assert "ds_config flops_profiler: {'enabled': True}" in ignored
    assert all(r for r in REASONS.values())


def _namespace(**values) -> dict:
    """A Megatron args Namespace as a checkpoint's `args` holds it: every option at its
    default, the run's values, and what Megatron derives at start."""
    ns = {o.dest: o.default for o in OPTIONS.values()}
    ns.update(values)
    ns.update(rank=0, world_size=384, data_parallel_size=8, padded_vocab_size=250880,
              params_dtype=object(), consumed_train_samples=0, kv_channels=128,
              encoder_seq_length=values["seq_length"], iteration=0)
    return ns


def test_function_on_a_checkpoint_namespace(tmp_path, capsys):
    """The form the Megatron-DeepSpeed importer calls: a Namespace dict and a ds_config dict,
    no files; it converts to the same config as the launch script."""
    launch = read_launch(TR11.read_text(), {"six_ALL_CCFRWORK": "/gpfswork",
                                            "six_ALL_CCFRSCRATCH": "/gpfsscratch"})
    given = parse_argv(launch.argv)
    typed = {k: (v.replace("_", "") if isinstance(v, str) and v.replace("_", "").isdigit()
                 else v) for k, v in given.items()}

    class Alibi:  # the enum member a checkpoint's Namespace holds
        name = "alibi"

    typed["position_embedding_type"] = Alibi()
    ds = json.loads(TR11_DS.read_text())
    config, report = megatron_to_config(_namespace(**typed), ds)
    assert report.world_size == 384
    assert config == BLOOM_176B
    assert {s.source.split(" ")[0] for s in report.unsupported} == {
        "--train-weighted-split-paths-path", "--valid-weighted-split-paths-path"}
    # Megatron saves the Namespace after update_train_iters derived train_iters from
    # train_samples with the ramp-up [192, 16, 9,765,625]: 115,311, the iterations BLOOM's logs
    # planned (docs/bloom_facts.md). Both counts there is not a second choice: the same config.
    saved, saved_report = megatron_to_config(_namespace(**typed, train_iters=115_311), ds,
                                             saved=True)
    assert saved == BLOOM_176B and not saved_report.warnings
    assert any("= 115311" in s.reason for s in saved_report.ignored)
    # Without --pad-vocab-size-to the Namespace's padded_vocab_size still gives the rows.
    del typed["pad_vocab_size_to"]
    config, _ = megatron_to_config(_namespace(**typed), ds)
    assert (config["model"]["vocab_size"], config["model"]["make_vocab_size_divisible_by"]) == \
        (250880, 512)


def test_shell_forms(tmp_path):
    script = r"""#!/bin/bash
#SBATCH --nodes=2   # two nodes
#SBATCH --gres=gpu:a100:8
set -euo pipefail
NNODES=$SLURM_NNODES
GPUS=${GPUS_PER_NODE:-8}
TP=2; PP=$(( NNODES * 1 ))
ROOT=$(pwd)
# a comment ending in a backslash does not continue the line \
TP=99
export DS=ds_$SLURM_JOB_ID.json
cat <<'EOT' > $DS
{"train_micro_batch_size_per_gpu": 1, "train_batch_size": 64, "bf16": {"enabled": true}}
EOT
ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
      --pp-partition-method 'type:transformer|embedding'"
echo torchrun pretrain_gpt.py --bogus
srun bash -c 'torchrun --nnodes=$NNODES --nproc-per-node $GPUS --rdzv_endpoint $ROOT:1 \
   pretrain_gpt.py $ARGS --save "$ROOT/ckpt" --deepspeed --deepspeed_config $DS' 2>&1 | tee log
"""
    launch = read_launch(script, {"ROOT": "/r"})
    assert (launch.world_size, launch.world_note.split(" (")[0]) == (16, "2 node(s) x 8 "
                                                                         "process(es) per node")
    args = parse_argv(launch.argv)
    assert args["tensor_model_parallel_size"] == "99"  # the comment did not swallow TP=99
    assert args["pipeline_model_parallel_size"] == "2"
    assert args["pp_partition_method"] == "type:transformer|embedding"
    assert args["save"] == "/r/ckpt"  # --var replaces what $(pwd) would have given
    assert json.loads(launch.files[args["deepspeed_config"]])["train_batch_size"] == 64
    ds = read_launch("deepspeed --num_nodes 2 --num_gpus 4 pretrain_gpt.py --seq-length 8")
    assert ds.world_size == 8 and ds.argv == ["--seq-length", "8"]
    with pytest.raises(UserError, match="found 2 launches"):
        read_launch("torchrun a.py\ntorchrun b.py\n")
    with pytest.raises(UserError, match="found no launch"):
        read_launch("python helper.py --x 1\n")
    assert read_launch("python pretrain_gpt.py --lr 1").world_size == 1
    assert read_launch("deepspeed --hostfile h pretrain_gpt.py").world_size is None


def test_every_option_has_a_known_action():
    kinds = {o.action.partition(":")[0] for o in OPTIONS.values()}
    assert kinds == {"map", "ignore", "unsupported"}
    assert all(o.action == "map" or o.action.split(":")[1] in REASONS for o in OPTIONS.values())


SMALL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-samples 800 "
         "--position-embedding-type alibi --embed-layernorm ")


def _convert(argv: str, ds=None, world_size=None):
    return megatron_to_config(parse_argv((SMALL + argv).split()), ds, world_size=world_size)


def test_vocab_padding_as_megatron():
    """Megatron pads to a multiple of --make-vocab-size-divisible-by x tp, or to exactly
    --pad-vocab-size-to."""
    model = _convert("--tensor-model-parallel-size 4")[0]["model"]
    assert model["make_vocab_size_divisible_by"] == 512 and "vocab_size" not in model
    shape = resolve_model_config(ModelConfig(**model), vocab_size=50257)
    assert shape.vocab_size == 50688  # Megatron's padded GPT-2 vocabulary at tp 4
    model = _convert("--tensor-model-parallel-size 8 --pad-vocab-size-to 1000")[0]["model"]
    assert (model["vocab_size"], model["make_vocab_size_divisible_by"]) == (1000, 8)
    assert resolve_model_config(ModelConfig(**model)).vocab_size == 1000
    _, report = _convert("--tensor-model-parallel-size 2 --pad-vocab-size-to 1001")
    assert report.unsupported[0].source == "--pad-vocab-size-to 1001"


FP16_DS = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": 0},
           # tr1-13B's fp16 section (bigscience train/tr1-13B-base/tr1-13B-round1.slurm)
           "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500,
                    "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 12}}


def test_fp16_loss_scaling_from_the_ds_config():
    config, report = _convert("--fp16 --deepspeed --loss-scale 12 --clip-grad 1.0", FP16_DS, 8)
    optim = config["optim"]
    assert (optim["initial_loss_scale"], optim["loss_scale_window"], optim["hysteresis"],
            optim["min_loss_scale"], optim["clip_grad"]) == (4096.0, 500, 2, 1.0, 0.5)
    assert config["parallel"]["zero_stage"] == 0 and config["train"]["precision"] == "fp16"
    # Under DeepSpeed the ds_config's scaling and clipping ran, not Megatron's arguments.
    ignored = {s.source: s.reason for s in report.ignored}
    assert "the ds_config's fp16 section" in ignored["--loss-scale 12"]
    assert "(0.5), not this" in ignored["--clip-grad 1.0"]
    static = dict(FP16_DS, fp16={"enabled": True, "loss_scale": 128,
                                 "consecutive_hysteresis": True})
    _, report = _convert("--fp16 --deepspeed", static, 8)
    assert [s.source.split(":")[0] for s in report.unsupported] == [
        "ds_config fp16.loss_scale", "ds_config fp16.consecutive_hysteresis"]
    # DeepSpeed's defaults where the section is silent: 2^16, window 1000.
    scaling = {m.source: (m.value, m.note) for m in report.mapped if "fp16." in m.source}
    assert scaling["ds_config fp16.initial_scale_power"] == (65536.0, "not given: DeepSpeed's "
                                                                      "default")
    assert scaling["ds_config fp16.loss_scale_window"][0] == 1000
    assert any("sets no initial_scale_power" in u and "was 32 before" in u
               for u in report.unchecked)
    # No gradient_clipping: DeepSpeed's default clipped (0, off, until its PR #8068 of June
    # 2026), never Megatron's --clip-grad, which the plain optimizer Megatron hands DeepSpeed
    # does not apply.
    unset = {k: v for k, v in FP16_DS.items() if k != "gradient_clipping"}
    config, report = _convert("--fp16 --deepspeed --clip-grad 0.7", unset, 8)
    assert config["optim"]["clip_grad"] == 0.0
    assert any(s.source.startswith("--clip-grad 0.7") for s in report.ignored)
    assert any("sets no gradient_clipping" in u for u in report.unchecked)
    with pytest.raises(UserError, match="runs DeepSpeed in fp16 but the Megatron arguments "
                                        "build the model in bf16"):
        _convert("--bf16 --deepspeed", FP16_DS, 8)


def test_merges_elsewhere_is_said():
    config, report = _convert("--tokenizer-type GPT2BPETokenizer --vocab-file /a/vocab.json "
                              "--merge-file /b/merges.txt")
    assert config["data"]["tokenizer"] == "/a/vocab.json"
    note = next(m.note for m in report.mapped if m.key == "data.tokenizer")
    assert note == ("bloomtrain reads the merges from /a/merges.txt, beside the vocab file: "
                    "copy /b/merges.txt there")


def test_mixed_up_values_are_user_errors():
    """Whatever values the arguments and the ds_config hold, the conversion either succeeds or
    says what is wrong (UserError); found ZeroDivision and Overflow errors before."""
    import random

    rng = random.Random(0)
    base = parse_argv(SMALL.split())
    values = [None, True, False, "0", "-1", "abc", "1.5", "auto", ["1", "2"], [], 0, 3, 2.0,
              "nan", "1e400", 10 ** 30, "type:x", "GPT2BPETokenizer"]
    configs = [None, {}, {"train_batch_size": "auto"}, {"fp16": {"enabled": True}},
               {"zero_optimization": 5}, {"fp16": {"enabled": True, "initial_scale_power": 5000}},
               {"gradient_accumulation_steps": 3}, {"train_batch_size": 0}, {"data_types": 3}]
    options = sorted(OPTIONS.values(), key=lambda o: o.flag)
    for _ in range(3000):
        args = dict(base)
        for option in rng.sample(options, rng.randint(1, 5)):
            args[option.dest] = rng.choice(values)
        try:
            megatron_to_config(args, rng.choice(configs), world_size=rng.choice([None, 1, 8]))
        except UserError:
            pass


def test_both_train_lengths_in_a_launch_are_refused(tmp_path, capsys):
    # A launch script gives one of the two (Megatron's own check); only a saved Namespace has
    # both, the second derived by Megatron.
    script = tmp_path / "both.sh"
    script.write_text("python pretrain_gpt.py " + SMALL + "--train-iters 100\n")
    rc, _, err = _run(capsys, "--megatron-args", script, "--world-size", "1", "--output",
                      tmp_path / "out.yaml")
    assert rc == 2
    assert "give exactly one of --train-iters and --train-samples, as Megatron requires" in err
    assert not (tmp_path / "out.yaml").exists()
    with pytest.raises(UserError, match="give exactly one of --train-iters and --train-samples"):
        _convert("--train-iters 100")


def test_train_iters_as_megatron_derives_it():
    # update_train_iters (megatron/training.py): whole global batches, or the ramp-up's steps
    # while at most ramp_samples are consumed (192 + 16 per 84,186 samples for BLOOM) and whole
    # batches after. 115,311: the planned iterations in BLOOM-176B's logs.
    from bloomtrain.import_config.sections import megatron_train_iters

    assert megatron_train_iters(800, 8, None) == 100
    assert megatron_train_iters(805, 8, None) == 100  # the partial last batch is dropped
    assert megatron_train_iters(220_000_000, 2048, (192, 16, 9_765_625)) == 115_311
    # A ramp-up written out step by step: batch 4, and 8 once 8 samples are consumed (one
    # increment of 4 over 8 samples). Consumed 0 -> 4 -> 8 -> 16 in the ramp-up's loop (it runs
    # while consumed <= 8), then (100 - 16) // 8 = 10 whole batches: 3 + 10.
    assert megatron_train_iters(100, 8, (4, 4, 8)) == 13


def test_a_warmup_fraction_is_of_the_decay_in_samples_even_under_token_decay():
    """Megatron's get_learning_rate_scheduler takes --lr-warmup-fraction of the decay in samples
    (lr_decay_samples, or train_samples), whatever --lr-decay-tokens then makes AnnealingLR
    decay by: 1% of 1M samples is 10,000, where the fraction of the token decay's 2M gave
    20,000."""
    config, _ = megatron_to_config(
        {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 1024,
         "micro_batch_size": 1, "global_batch_size": 8, "train_samples": 1_000_000, "lr": 1e-4,
         "lr_decay_samples": 1_000_000, "lr_decay_tokens": 2_048_000_000,
         "lr_warmup_fraction": 0.01, "position_embedding_type": "alibi",
         "embed_layernorm": True}, world_size=8)
    assert (config["optim"]["decay_samples"], config["optim"]["warmup_samples"]) == \
        (2_000_000, 10_000)


def test_zero_eval_iters_and_save_interval_turn_them_off():
    """0 turns evaluation (--eval-iters, --eval-interval) and periodic saves (--save-interval)
    off in Megatron: the config says it with null. Copied as 0, they made a config
    `bloomtrain` refused, naming keys the user never wrote."""
    for flag in ("--eval-iters 0", "--eval-interval 0"):
        config, _ = _convert(f"{flag} --save /ck --save-interval 0", world_size=8)
        assert config["train"]["eval_interval"] is None
        assert config["checkpoint"]["save_interval"] is None
        Config.from_dict(config).check()


def test_the_output_is_never_one_of_the_inputs(tmp_path, capsys):
    """--output naming the launch script replaced it with the YAML, exit code 0."""
    script = tmp_path / "run.args"
    script.write_text(SMALL + "--tokenizer-type PretrainedFromHF --tokenizer-name-or-path /t\\n")
    before = script.read_text()
    rc, _, err = _run(capsys, "--megatron-args", str(script), "--world-size", "8",
                      "--output", str(script))
    assert rc == 2 and "is one of the inputs" in err
    assert script.read_text() == before


def test_a_token_decay_whose_warmup_ends_inside_a_batch_is_said():
    """Megatron's AnnealingLR notes the token count at the end of warmup only at a step whose
    consumed samples equal the warmup; 1000 samples in batches of 16 are stepped over (1008),
    and Megatron then decayed by tokens from token 0 (learning_rates.py get_lr)."""
    base = ("--seq-length 32 --global-batch-size 16 --train-samples 12000 "
            "--lr-decay-tokens 320000 --lr-decay-style linear --lr-warmup-samples ")
    _, report = _convert(base + "1000", world_size=16)
    assert any("warmup (1000 samples) ends inside a global batch (the batches reach 1008 "
               "samples)" in w and "10.00% of the decay later" in w for w in report.warnings)
    _, report = _convert(base + "1008", world_size=16)
    assert not any("ends inside a global batch" in w for w in report.warnings)


def test_a_continuation_script_refused_for_its_ramp_up_says_what_to_drop(tmp_path, capsys):
    # BigScience's tr11f-6B3-ml-continuation.slurm kept its first run's ramp-up, whose batches
    # a resumed run past the ramp never trains at (Megatron checks them only when reached).
    script = tmp_path / "cont.sh"
    script.write_text("torchrun --nnodes 1 --nproc_per_node 8 pretrain_gpt.py " + SMALL +
                      "--seq-length 32 --micro-batch-size 1 --global-batch-size 16 "
                      "--rampup-batch-size 12 4 1000 --train-samples 5000 --load /ck\n")
    code, _, err = _run(capsys, "--megatron-args", str(script), "--output",
                        str(tmp_path / "out.yaml"))
    assert code == 2 and "its batch 12 must be divisible" in err
    assert "the script resumes (--load): if its checkpoint is past the ramp-up's 1000 samples" \
        in err and not (tmp_path / "out.yaml").exists()


def test_a_value_over_several_lines_is_commented_on_every_line(tmp_path, capsys):
    # BigScience's weighted split groups written over two lines inside one quoted argument: the
    # YAML header copies the unsupported argument, and its second line was left uncommented
    # (a yaml.scanner traceback, nothing written).
    args_file = tmp_path / "split.args"
    args_file.write_text(ARGS_FILE + '--train-weighted-split-paths "TRAIN: 0.5 0:0.95 /d/a,\n'
                                      '    0.5 0:0.95 /d/b"\n')
    out_yaml = tmp_path / "split.yaml"
    rc, _, err = _run(capsys, "--megatron-args", args_file, "--var", "DATA=/data",
                      "--output", out_yaml, "--allow-unsupported")
    assert rc == 0, err
    text = out_yaml.read_text()
    header = text[:text.index("\nmodel:")].splitlines()
    assert all(line.startswith("#") for line in header), header
    assert any("0.5 0:0.95 /d/b" in line for line in header)
    Config.load(str(out_yaml)).check()


# ARGS_FILE's arguments on one line of a script.
_ARGS_LINE = " ".join(line.rstrip("\\") for line in ARGS_FILE.splitlines()
                      if not line.startswith("#"))


@pytest.mark.parametrize("write,use", [
    ("cat <<EOT > ds.json", "./ds.json"), ("cat <<EOT > ./cfg/../ds.json", "ds.json"),
    ("cat << EOT | tee ds.json", "ds.json"), ("cat <<EOT >| ds.json", "ds.json"),
])
def test_the_ds_config_the_script_writes_is_found_as_the_launch_names_it(tmp_path, capsys,
                                                                        write, use):
    # Each was missed ('ds_config: none'), and Megatron's clipping and ZeRO stage used instead.
    script = tmp_path / "run.sh"
    script.write_text(f"{write}\n"
                      '{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,\n'
                      ' "zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}\nEOT\n'
                      f"torchrun --nproc_per_node 8 pretrain_gpt.py {_ARGS_LINE} "
                      f"--deepspeed --deepspeed_config {use}\n".replace("${DATA}", "/d"))
    out_yaml = tmp_path / "out.yaml"
    rc, out, err = _run(capsys, "--megatron-args", script, "--output", out_yaml)
    assert rc == 0, err
    assert "(written by the script)" in out
    c = yaml.safe_load(out_yaml.read_text())
    assert (c["optim"]["clip_grad"], c["parallel"]["zero_stage"]) == (0.5, 2)


def test_a_ds_config_written_under_an_undecided_condition_is_refused(tmp_path, capsys):
    script = tmp_path / "run.sh"
    body = ('{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": %s, '
            '"fp16": {"enabled": true}}\nEOT\n')
    launch = (f"torchrun --nproc_per_node 8 pretrain_gpt.py {_ARGS_LINE} --deepspeed "
              f"--deepspeed_config ds.json\n").replace("${DATA}", "/d")
    script.write_text("if [ -f /etc/big_cluster ]; then\ncat <<EOT > ds.json\n" + body % "0.3"
                      + "else\ncat <<EOT > ds.json\n" + body % "0.5" + "fi\n" + launch)
    rc, _, err = _run(capsys, "--megatron-args", script, "--output", tmp_path / "out.yaml")
    assert rc == 2 and "under an if, case, loop" in err and "--deepspeed-config" in err
    assert not (tmp_path / "out.yaml").exists()
    # Written where the condition is decided, it is read.
    script.write_text("if [ 1 = 1 ]; then\ncat <<EOT > ds.json\n" + body % "0.3"
                      + "else\ncat <<EOT > ds.json\n" + body % "0.5" + "fi\n" + launch)
    rc, _, err = _run(capsys, "--megatron-args", script, "--output", tmp_path / "out.yaml")
    assert rc == 0, err
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["optim"]["clip_grad"] == 0.3


def test_a_ds_config_lr_scheduler_is_not_dismissed(tmp_path, capsys):
    # DeepSpeed of BLOOM's time (DeepSpeedEngine._configure_lr_scheduler: "First check for
    # scheduler in json configuration") used this section over the schedule Megatron passed:
    # it was ignored as unused, and the YAML got Megatron's cosine schedule without a word.
    ds = _ds(tmp_path, scheduler={"type": "WarmupDecayLR",
                                  "params": {"warmup_num_steps": 10, "total_num_steps": 100}})
    out_yaml = tmp_path / "x.yaml"
    rc, _, err = _run(capsys, "--megatron-args", TR11, *ENV, "--deepspeed-config", ds,
                      "--output", out_yaml)
    assert rc == 2 and not out_yaml.exists()
    assert "ds_config scheduler: {" in err and "a DeepSpeed LR schedule: the DeepSpeed versions" in err


def test_a_data_path_with_a_space_is_one_prefix_as_megatron_reads_it(tmp_path, capsys):
    """Megatron's --data-path is nargs='*': one word (quoted, spaces and all) is the prefix,
    more are WEIGHT PREFIX pairs. The words were joined and split again, so a quoted prefix
    with a space was refused as malformed; data.paths takes such prefixes now."""
    script = tmp_path / "run.sh"
    for quoted, want in (
            ('"/data/my corpus/c_text_document"', ["/data/my corpus/c_text_document"]),
            ('0.3 "/data/my corpus/a" 0.7 /data/b', ["0.3 /data/my corpus/a", "0.7 /data/b"]),
            ('"0.3 /data/a 0.7 /data/b"', ["0.3 /data/a", "0.7 /data/b"])):
        script.write_text("torchrun pretrain_gpt.py " + SMALL + f"--data-path {quoted}\n")
        out_yaml = tmp_path / "c.yaml"
        rc, _, err = _run(capsys, "--megatron-args", script, "--output", out_yaml)
        assert rc == 0, err
        cfg = yaml.safe_load(out_yaml.read_text())
        assert cfg["data"]["paths"] == want, quoted
        assert [p for _, p in parse_data_paths(cfg["data"]["paths"])] == \
            [w.split(" ", 1)[1] if w[0].isdigit() else w for w in want]
