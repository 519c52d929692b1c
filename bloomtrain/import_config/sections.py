"""The Megatron arguments of each part of a run, mapped onto bloomtrain's config sections. Each
function takes the Conversion (bloomtrain.import_config.conversion) and runs in the order
megatron_to_config calls them: the layout first (the vocabulary padding and the batch rules need
tp, pp and dp), the batch before the LR schedule (iteration counts become samples)."""
from __future__ import annotations

import math
import os

from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.data.gpt2_bpe import merges_beside
from bloomtrain.import_config.conversion import Conversion
from bloomtrain.layout import rampup_batch_size_at

_ARCH = "bloomtrain's BLOOM is built with it"


def parallel(c: Conversion) -> None:
    c.tp = c.int("tensor_model_parallel_size")
    c.pp = c.int("pipeline_model_parallel_size")
    for dest, size in (("tensor_model_parallel_size", c.tp), ("pipeline_model_parallel_size",
                                                               c.pp)):
        if size <= 0:
            raise UserError(f"{c.given_text(dest)}: a parallel size must be positive")
    c.set("parallel.tp", c.tp, "tensor_model_parallel_size")
    c.set("parallel.pp", c.pp, "pipeline_model_parallel_size")
    if c.world is None and c.has("world_size"):
        c.world = c.int("world_size")  # a checkpoint's Namespace records the run's size
    if c.world is not None:
        if c.world <= 0 or c.world % (c.tp * c.pp):
            raise UserError(f"{c.world} GPUs are not divisible by tp {c.tp} x pp {c.pp}; "
                            f"check --world-size and the parallel sizes")
        c.dp = c.world // (c.tp * c.pp)
    method = c.str("pp_partition_method")
    if method is None or method.startswith("type:"):
        c.set("parallel.pp_partition", method or "type:transformer", "pp_partition_method",
              "" if method else "the default of Megatron-DeepSpeed's GPTModelPipe")
    else:
        c.ignore("pp_partition_method", f"DeepSpeed's {method!r} partition places blocks by its "
                                        f"own rule; where blocks sit changes speed and memory "
                                        f"only, so bloomtrain's default is kept")
    if c.flag("sequence_parallel"):
        c.set("parallel.sequence_parallel", True, "sequence_parallel")


def model(c: Conversion) -> None:
    c.put("model.preset", None)
    layers = c.int("num_layers", required=True)
    hidden = c.int("hidden_size", required=True)
    heads = c.int("num_attention_heads", required=True)
    c.set("model.num_layers", layers, "num_layers")
    c.set("model.hidden_size", hidden, "hidden_size")
    c.set("model.num_heads", heads, "num_attention_heads")
    c.set("model.ffn_hidden_size", c.int("ffn_hidden_size") or 4 * hidden, "ffn_hidden_size",
          "" if c.has("ffn_hidden_size") else "4 x hidden")
    per_chunk = c.int("num_layers_per_virtual_pipeline_stage")
    if per_chunk:
        if layers % (c.pp * per_chunk):
            raise UserError(f"--num-layers-per-virtual-pipeline-stage {per_chunk}: {layers} "
                            f"layers do not split into chunks of {per_chunk} on pp {c.pp}")
        dests = ["num_layers_per_virtual_pipeline_stage", "num_layers"]
        c.set("parallel.pp_schedule", "interleaved", dests)
        c.set("parallel.num_virtual_stages", layers // (c.pp * per_chunk), dests,
              "layers / (pp x layers per chunk)")
    for dest, expected, what in (("kv_channels", hidden // max(heads, 1), "channels per head"),
                                 ("num_key_value_heads", heads, "key/value heads")):
        if c.has(dest) and c.int(dest) != expected:
            c.unsupported(dest, f"{c.int(dest)} {what} where BLOOM has {expected}")
        else:
            c.ignore(dest, f"the value BLOOM has ({expected} {what})")
    c.set("model.init_method_std", c.float("init_method_std"), "init_method_std")
    c.set("model.hidden_dropout", c.float("hidden_dropout"), "hidden_dropout")
    c.set("model.attention_dropout", c.float("attention_dropout"), "attention_dropout")
    c.set("model.layer_norm_epsilon", c.float("layernorm_epsilon"), "layernorm_epsilon")
    position = (c.str("position_embedding_type") or "absolute").rsplit(".", 1)[-1].lower()
    if position == "alibi":
        c.builtin("position_embedding_type", f"ALiBi: {_ARCH}")
    else:
        c.unsupported("position_embedding_type", f"{position} position embeddings"
                      f"{'' if c.has('position_embedding_type') else ' (Megatron default)'}; "
                      f"bloomtrain's BLOOM uses ALiBi")
    if c.flag("embed_layernorm"):
        c.builtin("embed_layernorm", f"the LayerNorm after the embedding: {_ARCH}")
    else:
        c.unsupported("embed_layernorm", "not given: without it the model has no LayerNorm "
                                         "after the embedding, which bloomtrain's BLOOM has")
    _vocab(c)


def _vocab(c: Conversion) -> None:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x tp, or to
    exactly --pad-vocab-size-to; bloomtrain pads to model.make_vocab_size_divisible_by alone."""
    multiple = c.int("make_vocab_size_divisible_by")
    pad_to = c.int("pad_vocab_size_to")
    if pad_to is None and c.has("padded_vocab_size"):
        # A checkpoint's Namespace records the rows Megatron padded to: the model then has
        # them without its tokenizer.
        rows = c.int("padded_vocab_size")
        c.set("model.vocab_size", rows, "padded_vocab_size",
              source=c.labels.get("padded_vocab_size", "the checkpoint's args.padded_vocab_size"),
              note="the embedding rows of the checkpoint")
    if pad_to is None:
        c.set("model.make_vocab_size_divisible_by", multiple * c.tp,
              ["make_vocab_size_divisible_by", "tensor_model_parallel_size"],
              f"Megatron pads to a multiple of {multiple} x tp {c.tp}")
        return
    if pad_to % c.tp:
        c.unsupported("pad_vocab_size_to", f"{pad_to} rows do not split over tp {c.tp}")
        c.ignore("make_vocab_size_divisible_by", "--pad-vocab-size-to decides the rows")
        return
    c.set("model.vocab_size", pad_to, "pad_vocab_size_to",
          "the embedding has exactly these rows, as with Megatron's --pad-vocab-size-to")
    # Any multiple that divides pad_to keeps the rows as they are; tp's must split them.
    keep = multiple * c.tp if pad_to % (multiple * c.tp) == 0 else c.tp
    c.set("model.make_vocab_size_divisible_by", keep,
          ["make_vocab_size_divisible_by", "tensor_model_parallel_size"],
          f"a multiple that {pad_to} already is")


def _weighted_pairs(words: list[str]) -> bool:
    return len(words) >= 2 and len(words) % 2 == 0 and all(_is_number(w) for w in words[::2])


def data(c: Conversion) -> None:
    paths = c.list("data_path")
    if paths:
        # Megatron's words as bash gives them: one is a prefix, spaces and all; more are
        # WEIGHT PREFIX pairs. A quoted "$DATA_PATH" of pairs (one word, which Megatron would
        # take for one prefix) is read as its pairs.
        words = " ".join(paths).split()
        if _weighted_pairs(paths):
            blend = [f"{w} {p}" for w, p in zip(paths[::2], paths[1::2])]
        elif _weighted_pairs(words):
            blend = [f"{w} {p}" for w, p in zip(words[::2], words[1::2])]
        elif len(paths) == 1:
            blend = paths
        else:
            raise UserError(f"--data-path {' '.join(paths)}: give one prefix or WEIGHT PREFIX "
                            f"pairs, as Megatron reads it")
        c.set("data.paths", blend, "data_path")
        c.set("data.split", c.str("split") or "969, 30, 1", "split")
    else:
        c.ignore("split", "no --data-path to split")
    seq_dest = "seq_length" if c.has("seq_length") else "encoder_seq_length"
    c.set("data.seq_length", c.int(seq_dest, required=True), seq_dest)
    c.ignore("encoder_seq_length", "the same as --seq-length (Megatron sets one from the other)")
    c.set("data.seed", c.int("seed"), "seed", "Megatron's --seed also seeds the data order")
    c.set("data.eod_mask_loss", c.flag("eod_mask_loss"), "eod_mask_loss")
    if c.has("data_cache_path"):
        c.set("data.cache_dir", c.str("data_cache_path"), "data_cache_path")
    impl = c.str("data_impl")
    if impl in ("mmap", "infer"):
        c.ignore("data_impl", "bloomtrain reads Megatron's mmap .bin/.idx")
    else:
        c.unsupported("data_impl", f"{impl!r} datasets: bloomtrain reads Megatron's mmap "
                                   f"format (MMIDIDX) only; convert them with Megatron's "
                                   f"tools/preprocess_data.py --dataset-impl mmap")
    loader = c.str("dataloader_type")
    if loader in (None, "single"):
        c.ignore("dataloader_type", "bloomtrain's loader goes through the samples once, as "
                                    "Megatron's single")
    else:
        c.unsupported("dataloader_type", "a cyclic data loader")
    _tokenizer(c)


def _tokenizer(c: Conversion) -> None:
    kind = c.str("tokenizer_type")
    vocab, merges = c.str("vocab_file"), c.str("merge_file")
    name = c.str("tokenizer_name_or_path")
    if kind == "PretrainedFromHF" or kind is None and name and not vocab:
        note = "" if os.path.isabs(name or "") else \
            "bloomtrain reads a local tokenizer directory and never downloads: if this is a " \
            "Hub name, download it and set data.tokenizer to the directory"
        c.set("data.tokenizer", name, ["tokenizer_type", "tokenizer_name_or_path"], note)
        for dest in ("vocab_file", "merge_file"):
            c.ignore(dest, "PretrainedFromHF does not use it")
    elif kind == "GPT2BPETokenizer" or kind is None and vocab:
        if not vocab or not merges:
            raise UserError("GPT2BPETokenizer needs both --vocab-file and --merge-file")
        expected = str(merges_beside(Path(vocab)))  # where bloomtrain looks
        note = "" if os.path.normpath(merges) == os.path.normpath(expected) else \
            f"bloomtrain reads the merges from {expected}, beside the vocab file: copy " \
            f"{merges} there"
        c.set("data.tokenizer", vocab, ["tokenizer_type", "vocab_file", "merge_file"], note)
        c.ignore("tokenizer_name_or_path", "GPT2BPETokenizer does not use it")
    elif kind is None:
        c.unchecked("the arguments name no tokenizer: set data.tokenizer")
    else:
        c.unsupported("tokenizer_type", f"{kind}: bloomtrain reads byte-level BPE tokenizers "
                                        f"(a tokenizer.json, or GPT-2's vocab.json + merges.txt)")
        for dest in ("vocab_file", "merge_file", "tokenizer_name_or_path"):
            c.ignore(dest, "the files of that tokenizer")


def batch(c: Conversion) -> None:
    micro = c.int("micro_batch_size", required=True)
    if micro <= 0:
        raise UserError(f"{c.given_text('micro_batch_size')}: must be positive")
    c.micro = micro
    c.set("train.micro_batch_size", micro, "micro_batch_size")
    if c.has("global_batch_size"):
        c.gbs = c.int("global_batch_size")
        c.set("train.global_batch_size", c.gbs, "global_batch_size")
    elif c.dp is not None:
        c.gbs = micro * c.dp
        c.set("train.global_batch_size", c.gbs, "global_batch_size",
              f"micro x dp {c.dp}, as Megatron sets it")
    elif c.ds is not None and str(c.ds.get("train_batch_size", "auto")).isdigit():
        c.gbs = int(c.ds["train_batch_size"])
        c.set("train.global_batch_size", c.gbs, "global_batch_size",
              source="ds_config train_batch_size")
    else:
        raise UserError("--global-batch-size is not given and the world size is unknown, so "
                        "the global batch (micro x dp) is too: pass --world-size")
    if c.gbs <= 0:
        raise UserError(f"the global batch must be positive, got {c.gbs}")
    rampup = c.list("rampup_batch_size")
    if rampup is not None:
        try:
            values = [int(v) for v in rampup]
        except ValueError:
            values = []
        if len(values) != 3:
            raise UserError(f"--rampup-batch-size {' '.join(rampup)}: give three integers, "
                            f"start, increment and ramp-up samples")
        c.set("train.rampup_batch_size", values, "rampup_batch_size")


def schedule(c: Conversion) -> None:
    """Megatron's AnnealingLR counts samples: iteration counts are taken times the global batch
    and a fraction of the decay; a decay by tokens is one by samples at a fixed sequence."""
    c.set("optim.lr", c.float("lr", required=True), "lr")
    c.set("optim.min_lr", c.float("min_lr"), "min_lr")
    style = c.str("lr_decay_style")
    if style in ("constant", "linear", "cosine"):
        c.set("optim.decay_style", style, "lr_decay_style")
    else:
        c.unsupported("lr_decay_style", f"the {style} LR schedule")
    iters, samples = c.int("train_iters"), c.int("train_samples")
    if c.saved and iters is not None and samples is not None:
        _derived_train_iters(c, iters, samples)
        iters = None
    if (iters is None) == (samples is None):
        raise UserError("give exactly one of --train-iters and --train-samples, as Megatron "
                        "requires")
    unit = "iters" if iters else "samples"
    for dest in ("lr_decay_samples", "lr_warmup_samples", "rampup_batch_size") if iters else \
            ("lr_decay_iters", "lr_warmup_iters"):
        if c.has(dest) and c.raw(dest) not in (0, "0"):
            raise UserError(f"{c.given_text(dest)} with --train-{unit}: Megatron refuses the "
                            f"mix; count in {unit}")
    c.set(f"train.train_{unit}", iters or samples, f"train_{unit}")
    if iters:
        decay_dest = "lr_decay_iters" if c.has("lr_decay_iters") else "train_iters"
        decay = c.int(decay_dest) * c.gbs
        decay_from = [decay_dest, "global_batch_size"]
    else:
        decay_dest = "lr_decay_samples" if c.has("lr_decay_samples") else "train_samples"
        decay, decay_from = c.int(decay_dest), [decay_dest]
    # Megatron's warmup fraction is of the decay in samples (get_learning_rate_scheduler), even
    # where AnnealingLR then decays by tokens.
    fraction_of, fraction_from = decay, decay_from
    if c.has("lr_decay_tokens"):
        decay = c.int("lr_decay_tokens") / c.config["data"]["seq_length"]
        decay_from = ["lr_decay_tokens", "seq_length"]
    _set_samples(c, "optim.decay_samples", decay, decay_from)
    if c.has("lr_warmup_fraction"):
        warmup = c.float("lr_warmup_fraction") * fraction_of
        warmup_from = ["lr_warmup_fraction", *fraction_from]
    elif c.has("lr_warmup_tokens"):
        warmup = c.int("lr_warmup_tokens") / c.config["data"]["seq_length"]
        warmup_from = ["lr_warmup_tokens", "seq_length"]
    elif iters:
        warmup, warmup_from = c.int("lr_warmup_iters") * c.gbs, ["lr_warmup_iters",
                                                                 "global_batch_size"]
    else:
        warmup, warmup_from = c.int("lr_warmup_samples"), ["lr_warmup_samples"]
    _set_samples(c, "optim.warmup_samples", warmup, warmup_from)
    if c.has("lr_decay_tokens"):
        _token_decay(c, warmup, decay)
    for dest in ("lr_decay_iters", "lr_decay_samples", "lr_decay_tokens", "lr_warmup_iters",
                 "lr_warmup_samples", "lr_warmup_tokens"):
        if dest not in c.accounted:
            c.ignore(dest, "superseded by the arguments named for optim.decay_samples and "
                           "optim.warmup_samples")


def _token_decay(c: Conversion, warmup: float, decay: float) -> None:
    """What bloomtrain's decay by samples does not reproduce of Megatron's by tokens."""
    if not c.has("lr_warmup_tokens"):
        _token_decay_after_warmup(c, warmup)
    if decay > 0:
        # training.py adds a step's tokens to consumed_train_tokens after the scheduler has
        # stepped, so AnnealingLR's token count is one global batch behind its samples.
        c.unchecked(f"Megatron decays by tokens one global batch late (it counts a step's "
                    f"tokens after stepping the scheduler); bloomtrain decays by samples on "
                    f"time, so its LR leads Megatron's by one batch, {c.gbs / decay:.2%} of the "
                    f"decay (at most about that relative difference in the LR)")


def _token_decay_after_warmup(c: Conversion, warmup: float) -> None:
    """Megatron's AnnealingLR decays by tokens from the token count at which warmup ended, but
    notes that count only at a step whose consumed samples equal the warmup exactly; where the
    batches step over it, the decay counts from token 0. bloomtrain always decays from the end
    of warmup, so that case is said, with the size of the shift."""
    if warmup <= 0:
        return
    rampup = c.list("rampup_batch_size")
    ramp = tuple(int(v) for v in rampup) if rampup else None
    consumed = 0
    while consumed < warmup:
        consumed += rampup_batch_size_at(consumed, c.gbs, ramp) if ramp else c.gbs
    if consumed != warmup:
        decay = c.config["optim"]["decay_samples"]
        c.warn(f"the warmup ({warmup:g} samples) ends inside a global batch (the batches reach "
               f"{consumed} samples), so Megatron never noted the token count at its end and "
               f"decayed by --lr-decay-tokens from token 0; bloomtrain decays from the end of "
               f"warmup, {warmup / decay:.2%} of the decay later")


def megatron_train_iters(train_samples: int, global_batch_size: int,
                         rampup: tuple[int, int, int] | None) -> int:
    """The train_iters Megatron derives from --train-samples (update_train_iters in
    megatron/training.py, run by get_learning_rate_scheduler before any save): the ramp-up's
    steps while at most ramp_samples are consumed, then whole global batches; a partial last
    batch is dropped."""
    if rampup is None:
        return train_samples // global_batch_size
    iterations = consumed = 0
    while consumed <= rampup[2]:
        consumed += rampup_batch_size_at(consumed, global_batch_size, rampup)
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch_size


def _derived_train_iters(c: Conversion, iters: int, samples: int) -> None:
    """A saved Namespace of a sample-based run has both counts: train_iters is Megatron's own
    derivation from train_samples, not a second choice. One that does not follow Megatron's
    arithmetic is reported, and train_samples, the run's choice, is kept."""
    rampup = c.list("rampup_batch_size")
    try:
        ramp = tuple(int(float(v)) for v in rampup) if rampup else None
        expected = megatron_train_iters(samples, c.gbs, ramp if ramp and len(ramp) == 3 else None)
    except (ValueError, ZeroDivisionError):
        expected = None
    how = f"train_samples {samples} // global_batch_size {c.gbs}" + \
        (f" after the ramp-up {list(ramp)}" if rampup else "")
    if expected == iters:
        c.ignore("train_iters", f"Megatron's derivation from train_samples ({how} = {iters}, "
                                f"update_train_iters in megatron/training.py)")
        return
    c.ignore("train_iters", "superseded by train_samples, the run's own choice")
    c.warn(f"the checkpoint's args.train_iters is {iters}, but Megatron derives "
           f"{expected} from args.train_samples ({how}); train.train_samples {samples} is "
           f"kept, so the run lasts {expected} iterations, not {iters}: check the launch's "
           f"--train-samples and --global-batch-size")


def optimizer(c: Conversion) -> None:
    kind = c.str("optimizer")
    if kind == "adam":
        c.builtin("optimizer", "AdamW, bloomtrain's optimizer (Megatron's adam is apex "
                               "FusedAdam in AdamW mode)")
        c.ignore("sgd_momentum", "SGD's; the optimizer is Adam")
    else:
        c.unsupported("optimizer", f"{kind}: bloomtrain's optimizer is AdamW")
        c.ignore("sgd_momentum", "SGD is not supported")
    c.set("optim.weight_decay", c.float("weight_decay"), "weight_decay")
    c.set("optim.beta1", c.float("adam_beta1"), "adam_beta1")
    c.set("optim.beta2", c.float("adam_beta2"), "adam_beta2")
    c.set("optim.eps", c.float("adam_eps"), "adam_eps")
    if c.flag("cpu_optimizer"):
        c.set("parallel.offload_optimizer", True, "cpu_optimizer",
              "the optimizer step on the CPU, with the fp32 masters and moments there")


def train(c: Conversion) -> None:
    if c.flag("checkpoint_activations"):
        c.set("train.activation_checkpointing", "full", "checkpoint_activations")
    elif c.str("recompute_granularity") in ("full", "selective"):
        c.set("train.activation_checkpointing", c.str("recompute_granularity"),
              "recompute_granularity")
    elif c.flag("recompute_activations"):
        c.set("train.activation_checkpointing", "selective", "recompute_activations")
    else:
        c.set("train.activation_checkpointing", "none", "checkpoint_activations")
    for dest in ("recompute_granularity", "recompute_activations"):
        if dest not in c.accounted:
            c.ignore(dest, "superseded by the argument named for "
                           "train.activation_checkpointing")
    c.set("train.seed", c.int("seed"), "seed")
    c.set("train.log_interval", c.int("log_interval"), "log_interval")
    iters, interval = c.int("eval_iters"), c.int("eval_interval")
    if iters == 0 or interval == 0:  # Megatron evaluates nothing; bloomtrain says it with null
        c.set("train.eval_interval", None, ["eval_interval", "eval_iters"],
              "0 turns evaluation off in Megatron")
    else:
        c.set("train.eval_interval", interval, "eval_interval")
        c.set("train.eval_iters", iters, "eval_iters")
    if c.has("exit_duration_in_mins"):
        c.set("train.exit_duration_minutes", c.float("exit_duration_in_mins"),
              "exit_duration_in_mins")
    if c.has("kill_switch_path"):
        c.set("train.kill_switch_path", c.str("kill_switch_path"), "kill_switch_path")
    if c.has("tensorboard_dir"):
        c.set("run.tensorboard", True, "tensorboard_dir",
              "bloomtrain writes the event files under run_dir/tensorboard (it needs the "
              "tensorboard package; run.tensorboard=null writes them only when installed)")


def checkpoint(c: Conversion) -> None:
    save, load = c.str("save"), c.str("load")
    if save is not None:
        c.set("checkpoint.dir", save, "save", "Megatron keeps every checkpoint; bloomtrain "
                                              "keeps the last checkpoint.keep_last (3)")
        if c.has("save_interval"):  # 0: no periodic saves in Megatron, null here
            c.set("checkpoint.save_interval", c.int("save_interval") or None, "save_interval")
    else:
        c.ignore("save_interval", "no --save, so Megatron saved nothing")
    c.ignore("load", "bloomtrain resumes its own checkpoints (checkpoint.resume=auto finds them "
                     "in checkpoint.dir); a Megatron-DeepSpeed checkpoint is imported with "
                     f"`bloomtrain import-deepspeed --input {load} --output CKPT` and resumed "
                     f"with checkpoint.resume=CKPT")


def _set_samples(c: Conversion, key: str, value: float, dests: list[str]) -> None:
    whole = math.floor(value + 1e-9)
    note = "in samples" if len(dests) > 1 else ""
    if abs(value - whole) > 1e-9:
        note = f"{value:g} samples, rounded down (Megatron compares with the fraction)"
    c.set(key, whole, dests, note)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
