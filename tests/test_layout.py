"""bloomtrain.layout: the rules that combine the config's sections (stage partitions,
micro-batches and schedules, the attention kernel, the run's settings across sections), each
checked against its message."""
from __future__ import annotations

import os

import pytest

from bloomtrain.errors import UserError
from bloomtrain.layout import partition_layers, ParallelLayout
from bloomtrain.model.attention import resolve_attention
from bloomtrain.model.kernel_choice import EAGER_MAX_SEQ, FLEX_MAX_HEAD_DIM
from bloomtrain.validate import validate
from bloomtrain.model import attention
from tests import helpers


# ---- partitions, micro-batches and schedules (moved with the functions from test_pipeline) ----

def test_bloom_176b_partition():
    ranges = partition_layers(70, 12, "type:transformer|embedding")
    assert [e - s for s, e in ranges] == [5] + [6] * 10 + [5]
    assert ranges[0] == (0, 5) and ranges[-1] == (65, 70)
    # The embedding weighs like a block: stage 0 is [embed + 5 blocks], stage 11 [5 blocks + head].
    assert [e - s for s, e in partition_layers(70, 12, "type:transformer")] == [6] * 10 + [5, 5]


def test_uniform_and_explicit_partitions():
    assert partition_layers(70, 12) == [(i * 6, i * 6 + 6) for i in range(10)] + [(60, 65),
                                                                                  (65, 70)]
    assert partition_layers(8, 4, "uniform") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    counts = [5] + [6] * 10 + [5]
    explicit = partition_layers(70, 12, ",".join(map(str, counts)))
    assert explicit == partition_layers(70, 12, counts) == partition_layers(70, 12, str(counts))
    assert explicit == partition_layers(70, 12, "type:transformer|embedding")
    # Embedding-only first / head-only last stage: allowed without interleaving.
    assert partition_layers(4, 4, "type:transformer|embedding") == [(0, 1), (1, 3), (3, 4),
                                                                     (4, 4)]
    assert partition_layers(4, 3, "0,4,0") == [(0, 0), (0, 4), (4, 4)]


@pytest.mark.parametrize("args, message", [
    ((3, 4, "uniform"), "model.num_layers (3) must be >= the number of stages (pp x "
                        "num_virtual_stages = 4) with uniform partitioning"),
    ((8, 4, "1,2,3"), "parallel.pp_partition lists 3 block counts but there are 4 stages "
                      "(pp x num_virtual_stages); give one count per stage"),
    ((8, 4, "1,2,3,1"), "parallel.pp_partition [1, 2, 3, 1] assigns 7 blocks but the model "
                        "has 8 (model.num_layers)"),
    ((8, 4, "type:foo"), "parallel.pp_partition 'type:foo' matches no layer; the layer "
                         "types are EmbeddingPipe and ParallelTransformerLayerPipe"),
    ((8, 4, "bogus"), "parallel.pp_partition 'bogus' is unknown; use 'uniform', "
                      "'type:REGEX' (BLOOM: 'type:transformer|embedding') or a list of block "
                      "counts like '5,6,6,5'"),
    ((8, 4, "4,0,0,4"), "pipeline stage 1 of 4 gets no transformer block (block counts "
                        "[4, 0, 0, 4]); use fewer stages (parallel.pp, "
                        "parallel.num_virtual_stages), more layers, or another "
                        "parallel.pp_partition"),
    ((4, 4, "type:transformer|embedding", True),
     "pipeline virtual stage 3 of 4 gets no transformer block (block counts [1, 2, 1, 0]); use "
     "fewer stages (parallel.pp, parallel.num_virtual_stages), more layers, or another "
     "parallel.pp_partition"),
])
def test_partition_errors(args, message):
    with pytest.raises(UserError) as e:
        partition_layers(*args)
    assert str(e.value) == message


def test_validation():
    def layout(pp, schedule, v=1, dp=1):
        return ParallelLayout(pp=pp, dp=dp, schedule=schedule, num_virtual_stages=v,
                              partition="uniform")
    assert layout(1, "1f1b", dp=4).num_micro_batches(64, 2) == 8
    with pytest.raises(UserError, match=r"train.global_batch_size \(60\) must be divisible by "
                                        r"train.micro_batch_size \* dp \(2 \* 4 = 8\)"):
        layout(1, "1f1b", dp=4).num_micro_batches(60, 2)
    layout(4, "interleaved", 2).check_pipeline(8)
    assert layout(4, "interleaved", 2).num_micro_batches(8, 1) == 8
    with pytest.raises(UserError, match=r"number of micro-batches \(6 = global_batch / "
                                        r"\(micro_batch \* dp\)\) to be divisible by "
                                        r"parallel.pp \(4\)"):
        layout(4, "interleaved", 2).num_micro_batches(6, 1)
    with pytest.raises(UserError, match="needs parallel.num_virtual_stages >= 2"):
        layout(4, "interleaved", 1).check_pipeline(8)
    with pytest.raises(UserError, match=r"num_virtual_stages \(2\) > 1 needs "
                                        r"parallel.pp_schedule=interleaved"):
        layout(4, "1f1b", 2).check_pipeline(8)
    with pytest.raises(UserError,
                       match="parallel.pp_schedule must be gpipe, 1f1b, interleaved or zb-h1"):
        helpers.config(parallel={"pp_schedule": "zero-bubble"}).check()
    # Fewer micro-batches than stages works, but is mostly bubble: the config check warns.
    cfg = helpers.config(parallel={"pp": 4, "pp_partition": "uniform"}, global_batch_size=2)
    with pytest.warns(UserWarning, match="2 micro-batches for 4 pipeline stages"):
        validate(cfg, 4)


# ---- the attention kernel (moved with resolve_attention from test_attention) ------------------

def test_resolve_attention(monkeypatch):
    assert resolve_attention("auto", 0.0, "cpu") == "sdpa"  # the fastest on CPU, with backward
    assert resolve_attention("auto", 0.0, "cuda", head_dim=64) == "flex"
    assert resolve_attention("sdpa", 0.0, "cuda") == "sdpa"
    assert resolve_attention("flex", 0.0, "cuda") == "flex"
    assert resolve_attention("sdpa", 0.1, "cpu") == "sdpa"
    # CPU in bf16/fp16 up to EAGER_MAX_SEQ: HF's eager math (faster than SDPA's CPU kernel there)
    assert resolve_attention("auto", 0.0, "cpu", "bf16", EAGER_MAX_SEQ) == "eager"
    assert resolve_attention("auto", 0.1, "cpu", "fp16", 64) == "eager"  # it has dropout
    assert resolve_attention("auto", 0.0, "cpu", "bf16", EAGER_MAX_SEQ + 1) == "sdpa"
    assert resolve_attention("auto", 0.0, "cpu", "fp32", 64) == "sdpa"  # fp32 numerics kept
    assert resolve_attention("auto", 0.0, "cuda", "bf16", 64, head_dim=64) == "flex"
    assert resolve_attention("eager", 0.1, "cuda") == "eager"
    assert resolve_attention("sdpa", 0.0, "cpu", "bf16", 64) == "sdpa"
    with pytest.warns(UserWarning, match="FlexAttention has no dropout"):
        assert resolve_attention("auto", 0.1, "cuda", head_dim=64) == "sdpa"
    with pytest.raises(UserError, match=r"set model.attention_dropout=0 \(it is 0.1\) or "
                                        r"train.attention=sdpa"):
        resolve_attention("flex", 0.1, "cuda")
    with pytest.raises(UserError, match="cannot train on cpu: FlexAttention has no backward"):
        resolve_attention("flex", 0.0, "cpu")
    with pytest.raises(UserError, match="train.attention must be auto, sdpa, flex or eager, "
                                        "got 'flash'"):
        resolve_attention("flash", 0.0, "cuda")
    # On CUDA auto follows the GPU run's measurements by head dimension: flex at bloom-560m's
    # 64, SDPA at the larger BLOOMs' 128 (and at the unmeasured 80 between).
    assert resolve_attention("auto", 0.0, "cuda", "bf16", 2048,
                             head_dim=FLEX_MAX_HEAD_DIM) == "flex"
    for head_dim in (80, 128):
        assert resolve_attention("auto", 0.0, "cuda", "bf16", 2048, head_dim=head_dim) == "sdpa"
    assert resolve_attention("flex", 0.0, "cuda", head_dim=128) == "flex"  # asked for: given
    with pytest.raises(ValueError, match="needs the model's head_dim"):
        resolve_attention("auto", 0.0, "cuda")
    monkeypatch.setattr(attention, "flex_attention_available", lambda: False)
    assert resolve_attention("auto", 0.0, "cuda", head_dim=64) == "sdpa"
    with pytest.raises(UserError, match="lacks; set train.attention=sdpa or auto"):
        resolve_attention("flex", 0.0, "cuda")


def test_flex_with_attention_dropout_is_refused_before_any_device_is_known():
    cfg = helpers.config(attention="flex")
    cfg.model.attention_dropout = 0.1
    with pytest.raises(UserError, match=r"train.attention=flex has no attention dropout"):
        validate(cfg, 1)


# ---- rules across sections, once in validate ----------------------------------------------------

@pytest.mark.parametrize("over, kw, message", [
    ({"train": {"on_loss_spike": "rollback"}}, {},
     "train.on_loss_spike=rollback needs checkpoint.dir (it reloads the last checkpoint)"),
    ({"train": {"eval_harness_tasks": "a, b"}}, {},
     "train.eval_harness_tasks needs data.tokenizer: the harness sends text"),
    ({"checkpoint": {"dir": "ck", "resume": "none"}}, {"max_restarts": 1},
     "--max-restarts 1 restarts the workers, which then resume from checkpoint.resume='none': "
     "set checkpoint.dir and checkpoint.resume=auto so that a restart continues from the job's "
     "last checkpoint"),
    ({}, {"max_restarts": 2}, "resume from checkpoint.resume='auto' with no checkpoint.dir"),
])
def test_rules_across_sections(over, kw, message):
    cfg = helpers.config()
    for section, values in over.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    cfg.check()  # each key is fine on its own
    with pytest.raises(UserError) as e:
        validate(cfg, 1, **kw)
    assert message in str(e.value)
    for section, values in over.items():  # the companion key makes it valid
        if section == "train" and "on_loss_spike" in values:
            cfg.checkpoint.dir = "ck"
        if section == "train" and "eval_harness_tasks" in values:
            cfg.data.tokenizer = "tok"
        if section == "checkpoint":
            cfg.checkpoint.resume = "auto"
    if not over:
        cfg.checkpoint.dir = "ck"
    validate(cfg, 1, **kw)


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path, monkeypatch):
    # Found at the first save, it let a run with on_save_error=continue train to its end and keep
    # nothing. A read-only filesystem (os.access says no; root ignores permission bits, so the
    # test says it for it) and a file in the way are both refused, naming the part at fault.
    from bloomtrain import files
    cfg = helpers.config()
    cfg.checkpoint.dir = str(tmp_path / "new" / "ck")
    validate(cfg, 1)  # missing parts are created at the first save
    (tmp_path / "f").write_text("")
    cfg.checkpoint.dir = str(tmp_path / "f" / "ck")
    with pytest.raises(UserError, match=f"checkpoint.dir {tmp_path}/f/ck cannot be written: "
                                        f"{tmp_path}/f is a file, not a directory"):
        validate(cfg, 1)
    cfg.checkpoint.dir = str(tmp_path / "ro" / "ck")
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(files.os, "access",
                        lambda p, mode: False if str(p) == str(tmp_path / "ro") else real(p, mode))
    with pytest.raises(UserError, match=f"cannot be written: {tmp_path}/ro is not writable by "
                                        f"this user; point checkpoint.dir at a writable"):
        validate(cfg, 1)
    # The run directory alike (a file there was a NotADirectoryError traceback from train()).
    cfg.checkpoint.dir = None
    cfg.run_dir = str(tmp_path / "f")
    with pytest.raises(UserError, match=f"run_dir {tmp_path}/f cannot be written: {tmp_path}/f "
                                        f"is a file, not a directory; point run_dir at"):
        validate(cfg, 1)


def test_restarts_over_nodes_need_a_rendezvous_longer_than_the_hang_timeout():
    # After a failure the nodes that restart first wait at the rendezvous for the others,
    # whose watchdogs notice within the hang timeout (a cut link raises nothing).
    cfg = helpers.config()
    cfg.checkpoint.dir = "ck"
    cfg.parallel.timeout_minutes = 20  # hang timeout 18 min = 1080 s
    validate(cfg, 2, max_restarts=1)  # one node: its agent restarts all its workers at once
    validate(cfg, 2, nnodes=2)  # no restarts: nothing waits after a failure
    with pytest.raises(UserError) as e:
        validate(cfg, 2, max_restarts=1, nnodes=2)
    assert str(e.value) == (
        "--max-restarts 1 over 2 nodes: the rendezvous timeout (600 s, "
        "parallel.rdzv_timeout_minutes or --rdzv-timeout) must exceed the hang timeout (1080 s, "
        "parallel.hang_timeout_minutes) by 30 s or more: after a failure the nodes that restart "
        "first wait that long for the others, whose watchdogs notice it within the hang timeout; "
        "raise the rendezvous timeout or lower the hang timeout")
    cfg.parallel.rdzv_timeout_minutes = 18.5  # exactly 30 s more
    validate(cfg, 2, max_restarts=1, nnodes=2)


def test_the_tokenizers_vocabulary_is_padded_and_split_over_tp():
    cfg = helpers.config(parallel={"tp": 2})
    cfg.model.vocab_size = None
    run = validate(cfg, 2)
    assert run.with_vocab(cfg, 250_680).shape.vocab_size == 250_752  # padded to 128
    cfg.model.make_vocab_size_divisible_by = 3
    with pytest.raises(UserError, match=r"make_vocab_size_divisible_by \(3\) must be divisible "
                                        r"by parallel.tp \(2\)"):
        run.with_vocab(cfg, 250_680)



# ---- every broken rule at once -------------------------------------------------------------------

TP3_ON_TINY = [  # the rules parallel.tp=3 breaks on the tiny model (vocab padded to 128)
    "model.make_vocab_size_divisible_by (128) must be divisible by parallel.tp (3) so the "
    "padded vocabulary splits evenly",
    "model.num_heads (4) must be divisible by parallel.tp (3)",
    "model.ffn_hidden_size (256) must be divisible by parallel.tp (3)",
]
ONE_CHUNK = ("parallel.pp_schedule=interleaved needs parallel.num_virtual_stages >= 2; use 1f1b "
             "for one model chunk per rank")


@pytest.mark.parametrize("world,more", [
    (7, ["the number of processes (7) is not divisible by parallel.tp * parallel.pp (3 * 2 = "
         "6); change --nproc or the tp/pp sizes"]),
    (6, ["the interleaved schedule needs the number of micro-batches (9 = global_batch / "
         "(micro_batch * dp)) to be divisible by parallel.pp (2); change "
         "train.global_batch_size or train.micro_batch_size"]),
], ids=["processes", "batch"])
def test_every_broken_rule_of_a_layout_in_one_error(world, more):
    # tensor parallelism, the pipeline schedule, the process count or the batch: each rule a
    # layout breaks is in the one error, on its own line, not one per attempt.
    cfg = helpers.config(parallel={"tp": 3, "pp": 2, "pp_schedule": "interleaved"},
                         global_batch_size=9, micro_batch_size=1)
    with pytest.raises(UserError) as e:
        validate(cfg, world)
    lines = str(e.value).splitlines()
    want = TP3_ON_TINY + [ONE_CHUNK] + more
    assert lines[0] == f"{len(want)} problems; change each of these:"
    assert sorted(lines[1:]) == sorted(f"  - {m}" for m in want)


def test_one_broken_rule_is_its_message_alone():
    cfg = helpers.config(parallel={"tp": 2, "pp": 2, "pp_schedule": "interleaved"},
                         global_batch_size=8)
    with pytest.raises(UserError) as e:
        validate(cfg, 4)
    assert str(e.value) == ONE_CHUNK


@pytest.mark.parametrize("rampup", [None, (2, 2, 40), (4, 4, 1000)])
def test_the_last_steps_start_is_the_walks(rampup):
    # A plain walk of the steps, each taking the batch size at the samples before it.
    from bloomtrain.layout import BatchSchedule
    lay = ParallelLayout(tp=1, pp=1, dp=2)
    sched = BatchSchedule(global_batch_size=8, micro_batch_size=1, layout=lay, rampup=rampup)
    for train_samples in (0, 1, 7, 8, 9, 16, 41, 100, 333):
        consumed, last = 0, None
        while sched.fits(consumed, train_samples):
            last, consumed = consumed, consumed + sched.global_batch_size_at(consumed)
        assert sched.last_step_start(train_samples) == last, (rampup, train_samples)
