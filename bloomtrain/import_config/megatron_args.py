"""Megatron-DeepSpeed's command-line options (megatron/arguments.py of bigscience-workshop's
fork, the one BLOOM trained with, plus DeepSpeed's own and a few common ones of microsoft's fork):
how each is spelled and parsed, its default, and what import-config does with it.

Each option is mapped by bloomtrain.import_config.mapping ("map"), ignored because it has no
meaning for bloomtrain ("ignore:" and a reason), or unsupported because it changes training in a
way bloomtrain does not reproduce ("unsupported:" and a reason; only when it differs from its
default). Parsing follows argparse as Megatron configures it (no abbreviations; `--opt=value`).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from bloomtrain.errors import UserError
from bloomtrain.import_config.bash.lexer import show, unresolved_in

REASONS = {
    # ---- ignored --------------------------------------------------------------------------
    "log": "logging and monitoring; bloomtrain logs to run_dir/metrics.jsonl (TensorBoard with "
           "run.tensorboard)",
    "kernel": "a kernel choice that leaves the math as it is; bloomtrain has no custom CUDA "
              "kernels (train.compile fuses with torch.compile)",
    "launch": "process setup; bloomtrain takes the launcher's environment (torchrun) and picks "
              "its backend itself (parallel.backend)",
    "loader": "data-loader workers and warm-up: speed only",
    "memory": "a memory or speed tuning of Megatron/DeepSpeed that leaves the math as it is; "
              "bloomtrain's own are parallel.bucket_size_mb and train.activation_checkpointing",
    "ddp": "how Megatron's DDP reduces gradients; bloomtrain's ZeRO engine accumulates and "
           "reduces them in fp32 (BLOOM's BF16Optimizer)",
    "deepspeed": "DeepSpeed's engine switches; bloomtrain is its own engine, and the ds_config is "
                 "read from --deepspeed-config or from the file the script writes",
    "derived": "set by Megatron itself from the other arguments",
    "alibi_pos": "ALiBi has no position table and no position ids",
    "other_model": "an option of Megatron's BERT, T5, ICT, retriever or ViT models",
    "ckpt_content": "bloomtrain checkpoints always hold the optimizer state and the RNG",
    "partition": "DeepSpeed splits each checkpointed activation over the tp ranks to save "
                 "memory; bloomtrain's nearest is parallel.sequence_parallel=true (activations "
                 "split along the sequence over tp), left off here: turn it on if memory needs it",
    "ckpt_chunks": "bloomtrain's full checkpointing recomputes one block at a time; the chunk size "
                   "changes memory and speed only",
    "sync_tp": "a Megatron-DeepSpeed workaround for bf16 tp ranks drifting apart in their "
               "replicated LayerNorms; bloomtrain checkpoints hold replicated parameters once",
    "lr_ckpt": "bloomtrain computes the LR from the config's optim keys at the consumed samples, "
               "also after a resume",
    "universal": "bloomtrain's checkpoints load on any layout; to continue from a "
                 "Megatron-DeepSpeed checkpoint, import it with `bloomtrain import-deepspeed`",
    "exit_interval": "bloomtrain stops at train_iters/train_samples, on the kill switch or at "
                     "train.exit_duration_minutes, not at an iteration multiple",
    "gelu": "Megatron's GeLU variants differ in the last bits; bloomtrain's is BLOOM's tanh "
            "approximation (that of Megatron's fused bias-GeLU)",
    "qk_scaling": "a rescaling of Q·K^T undone inside the softmax; same result",
    "mpu": "Megatron's parallel-state setup",
    # ---- unsupported ----------------------------------------------------------------------
    "arch": "a model architecture bloomtrain's BLOOM does not have",
    "data_groups": "BigScience's weighted split groups (a START:END range per dataset, validation "
                   "per group): bloomtrain takes data.paths ('WEIGHT PREFIX') with one "
                   "data.split; list the datasets in data.paths",
    "data_files": "separate train/valid/test datasets: bloomtrain splits data.paths by "
                  "data.split",
    "resume_mode": "bloomtrain resumes everything of its own checkpoints (weights, optimizer, "
                   "RNG); for the weights alone import the Megatron-DeepSpeed checkpoint with "
                   "`bloomtrain import-deepspeed --weights-only`",
    "no_training": "a run that does not train",
    "refused": "Megatron itself refuses it (a removed argument)",
    "skip_iters": "skipping iteration ranges; bloomtrain skips data only when it rolls back "
                  "after a loss spike (train.on_loss_spike=rollback)",
    "train_tokens": "a stop by tokens; bloomtrain stops at train.train_samples or train_iters",
    "optimizer": "bloomtrain's optimizer is AdamW (Megatron's adam: apex FusedAdam in AdamW mode)",
    "fp32_residual": "bloomtrain keeps the residual stream in the compute dtype",
    "fp16_loss": "bloomtrain computes the loss in fp32",
    "loss_mask": "prefix-LM loss masking",
    "attn_mask": "attention blocked between documents; bloomtrain's attention is causal over the "
                 "whole sample, as BLOOM's",
    "cyclic": "a cyclic data loader; bloomtrain's goes through the blended samples once, as "
              "Megatron's single",
    "data_impl": "bloomtrain reads Megatron's mmap format (MMIDIDX) only",
    "init": "bloomtrain initializes with a normal of model.init_method_std",
    "extra_ids": "T5 sentinel tokens",
    "seq_parallel_ds": "DeepSpeed-Ulysses sequence parallelism",
}


@dataclass(frozen=True)
class Option:
    flag: str         # as written on the command line
    dest: str         # argparse's attribute name
    kind: str         # flag (store_true), off (store_false), value, list (nargs)
    default: Any      # Megatron's default
    action: str       # map, ignore:REASON or unsupported:REASON


# flag[>dest]  kind  default  action (an indented line continues the one before). Defaults are
# Megatron-DeepSpeed's (bigscience fork).
_TABLE = """
--num-layers value None map
--hidden-size value None map
--ffn-hidden-size value None map
--num-attention-heads value None map
--kv-channels value None map
--max-position-embeddings value None ignore:alibi_pos
--make-vocab-size-divisible-by value 128 map
--pad-vocab-size-to value None map
--layernorm-epsilon value 1e-05 map
--sync-tp-duplicated-parameters flag False ignore:sync_tp
--apply-residual-connection-post-layernorm flag False unsupported:arch
--embed-layernorm flag False map
--openai-gelu flag False ignore:gelu
--onnx-safe value None ignore:kernel
--bert-no-binary-head>bert_binary_head off True ignore:other_model
--position-embedding-type value 'absolute' map
--glu-activation value None unsupported:arch
--kill-switch-path value None map
--log-level value None ignore:log
--log-level-replica value None ignore:log
--log-params-norm flag False ignore:log
--log-num-zeros-in-grad flag False ignore:log
--tensorboard-log-interval value 1 ignore:log
--tensorboard-queue-size value 1000 ignore:log
--log-timers-to-tensorboard flag False ignore:log
--log-batch-size-to-tensorboard flag False ignore:log
--no-log-learnig-rate-to-tensorboard>log_learning_rate_to_tensorboard off True ignore:log
--no-log-loss-scale-to-tensorboard>log_loss_scale_to_tensorboard off True ignore:log
--log-validation-ppl-to-tensorboard flag False ignore:log
--attention-dropout value 0.1 map
--hidden-dropout value 0.1 map
--weight-decay value 0.01 map
--clip-grad value 1.0 map
--adam-beta1 value 0.9 map
--adam-beta2 value 0.999 map
--adam-eps value 1e-08 map
--sgd-momentum value 0.9 map
--micro-batch-size value None map
--batch-size value None unsupported:refused
--global-batch-size value None map
--rampup-batch-size list None map
--checkpoint-activations flag False map
--distribute-checkpointed-activations flag False ignore:partition
--checkpoint-num-layers value 1 ignore:ckpt_chunks
--train-iters value None map
--train-samples value None map
--train-tokens value None unsupported:train_tokens
--log-interval value 100 map
--exit-interval value None ignore:exit_interval
--exit-duration-in-mins value None map
--tensorboard-dir value None map
--no-masked-softmax-fusion>masked_softmax_fusion off True ignore:kernel
--no-bias-gelu-fusion>bias_gelu_fusion off True ignore:gelu
--no-bias-dropout-fusion>bias_dropout_fusion off True ignore:kernel
--optimizer value 'adam' map
--use-bnb-optimizer flag False unsupported:optimizer
--dataloader-type value None map
--cpu-optimizer flag False map
--cpu_torch_adam flag False ignore:kernel
--codecarbon-dir value None ignore:log
--eval-only value None unsupported:no_training
--skip-train-iteration-range list None unsupported:skip_iters
--inference flag False unsupported:no_training
--abort-on-unmet-fused-kernel-constraints flag False ignore:kernel
--pp-partition-method value None map
--seed value 1234 map
--init-method-std value 0.02 map
--init-method-xavier-uniform flag False unsupported:init
--lr value None map
--lr-decay-style value 'linear' map
--lr-decay-iters value None map
--lr-decay-samples value None map
--lr-decay-tokens value None map
--lr-warmup-fraction value None map
--lr-warmup-iters value 0 map
--lr-warmup-samples value 0 map
--warmup value None unsupported:refused
--min-lr value 0.0 map
--override-lr-scheduler flag False ignore:lr_ckpt
--use-checkpoint-lr-scheduler flag False ignore:lr_ckpt
--universal-checkpoint flag False ignore:universal
--save value None map
--save-interval value None map
--no-save-optim flag None ignore:ckpt_content
--no-save-rng flag None ignore:ckpt_content
--load value None map
--no-load-optim flag None unsupported:resume_mode
--no-load-rng flag None unsupported:resume_mode
--finetune flag False unsupported:resume_mode
--fp16 flag False map
--bf16 flag False map
--loss-scale value None map
--initial-loss-scale value 4294967296.0 map
--min-loss-scale value 1.0 map
--loss-scale-window value 1000 map
--hysteresis value 2 map
--fp32-residual-connection flag False unsupported:fp32_residual
--no-query-key-layer-scaling>apply_query_key_layer_scaling off True ignore:qk_scaling
--attention-softmax-in-fp32 flag False ignore:kernel
--accumulate-allreduce-grads-in-fp32 flag False ignore:ddp
--fp16-lm-cross-entropy flag False unsupported:fp16_loss
--tensor-model-parallel-size value 1 map
--pipeline-model-parallel-size value 1 map
--model-parallel-size value None unsupported:refused
--num-layers-per-virtual-pipeline-stage value None map
--distributed-backend value 'nccl' ignore:launch
--DDP-impl value 'local' ignore:ddp
--use-contiguous-buffers-in-ddp flag False ignore:ddp
--no-scatter-gather-tensors-in-pipeline>scatter_gather_tensors_in_pipeline off True ignore:memory
--local_rank value None ignore:launch
--lazy-mpu-init value None ignore:mpu
--use-cpu-initialization flag None ignore:memory
--eval-iters value 100 map
--eval-interval value 1000 map
--data-path list None map
--split value None map
--train-weighted-split-paths list None unsupported:data_groups
--valid-weighted-split-paths list None unsupported:data_groups
--test-weighted-split-paths list None unsupported:data_groups
--train-weighted-split-paths-path value None unsupported:data_groups
--valid-weighted-split-paths-path value None unsupported:data_groups
--test-weighted-split-paths-path value None unsupported:data_groups
--log-path value None ignore:log
--vocab-file value None map
--merge-file value None map
--vocab-extra-ids value 0 unsupported:extra_ids
--seq-length value None map
--encoder-seq-length value None map
--decoder-seq-length value None ignore:other_model
--retriever-seq-length value 256 ignore:other_model
--sample-rate value 1.0 ignore:other_model
--mask-prob value 0.15 ignore:other_model
--short-seq-prob value 0.1 ignore:other_model
--mmap-warmup flag False ignore:loader
--num-workers value 2 ignore:loader
--valid-num-workers value 2 ignore:loader
--tokenizer-type value None map
--tokenizer-name-or-path value None map
--data-impl value 'infer' map
--reset-position-ids flag False ignore:alibi_pos
--reset-attention-mask flag False unsupported:attn_mask
--eod-mask-loss flag False map
--loss-on-targets-only flag False unsupported:loss_mask
--reweight-loss-based-on-position-frequency flag False unsupported:loss_mask
--noise-density value None ignore:other_model
--mean-noise-span-length value None ignore:other_model
--adlr-autoresume flag False ignore:launch
--adlr-autoresume-interval value 1000 ignore:launch
--ict-head-size value None ignore:other_model
--biencoder-projection-dim value 0 ignore:other_model
--biencoder-shared-query-context-model flag False ignore:other_model
--ict-load value None ignore:other_model
--bert-load value None ignore:other_model
--titles-data-path value None ignore:other_model
--query-in-block-prob value 0.1 ignore:other_model
--use-one-sent-docs flag False ignore:other_model
--evidence-data-path value None ignore:other_model
--retriever-report-topk-accuracies list [] ignore:other_model
--retriever-score-scaling flag False ignore:other_model
--block-data-path value None ignore:other_model
--embedding-path value None ignore:other_model
--indexer-batch-size value 128 ignore:other_model
--indexer-log-interval value 1000 ignore:other_model
--num-classes value 1000 ignore:other_model
--img-dim value 224 ignore:other_model
--num-channels value 3 ignore:other_model
--patch-dim value 16 ignore:other_model
--zero-stage value 1.0 map
--zero-reduce-scatter flag False ignore:memory
--zero-contigious-gradients flag False ignore:memory
--zero-reduce-bucket-size value 0.0 ignore:memory
--zero-allgather-bucket-size value 0.0 ignore:memory
--remote-device value 'none' ignore:memory
--use-pin-memory flag False ignore:memory
--scattered-embeddings flag False ignore:memory
--split-transformers flag False ignore:memory
--memory-centric-tiled-linear flag False ignore:memory
--tile-factor value 1 ignore:memory
--deepspeed-activation-checkpointing flag False ignore:memory
--partition-activations flag False ignore:partition
--contigious-checkpointing flag False ignore:memory
--checkpoint-in-cpu flag False ignore:memory
--synchronize-each-layer flag False ignore:memory
--profile-backward flag False ignore:log
--deepspeed flag False map
--deepspeed_config value None ignore:deepspeed
--deepspeed-config>deepspeed_config value None ignore:deepspeed
--deepscale flag False ignore:deepspeed
--deepscale_config value None ignore:deepspeed
--deepspeed_mpi flag False ignore:launch
--sequence-parallel flag False map
--use-distributed-optimizer flag False map
--recompute-activations flag False map
--recompute-granularity value None map
--recompute-method value None ignore:ckpt_chunks
--recompute-num-layers value 1 ignore:ckpt_chunks
--use-flash-attn flag False ignore:kernel
--use-flash-attn-v2 flag False ignore:kernel
--no-pipeline-parallel flag False ignore:memory
--no-async-tensor-model-parallel-allreduce>async_tensor_model_parallel_allreduce off True
  ignore:memory
--no-gradient-accumulation-fusion>gradient_accumulation_fusion off True ignore:kernel
--lr-warmup-tokens value None map
--data-cache-path value None map
--train-data-path list None unsupported:data_files
--valid-data-path list None unsupported:data_files
--test-data-path list None unsupported:data_files
--untie-embeddings-and-output-weights flag False unsupported:arch
--untie-embeddings flag False unsupported:arch
--use-rotary-position-embeddings flag False unsupported:arch
--swiglu flag False unsupported:arch
--disable-bias-linear>add_bias_linear off True unsupported:arch
--normalization value 'layernorm' unsupported:arch
--num-key-value-heads value None map
--ds-sequence-parallel-size value 1 unsupported:seq_parallel_ds
--wandb-project value None ignore:log
--wandb-exp-name value None ignore:log
--wandb-save-dir value None ignore:log
--log-optimizer-states-to-tensorboard flag False ignore:log
--timing-log-level value 0 ignore:log
"""

# Attributes of a saved `args` Namespace that no option sets: Megatron-DeepSpeed derives or
# records them while it starts and trains, so every checkpoint's Namespace has them and no launch
# gives them. They are read as what they are, never reported as unknown arguments. Each with the
# line that sets it in bigscience-workshop/Megatron-DeepSpeed at 8387ae17 (the fork that trained
# BLOOM). Options that Megatron overwrites (train_iters from train_samples in update_train_iters,
# lr_decay_samples/iters, global_batch_size, split, ffn_hidden_size, kv_channels, ...) are in the
# option table above and mapped there: see sections.schedule for train_iters.
SET_BY_MEGATRON = {
    "rank": "megatron/arguments.py:70 parse_args (initialize.py:276 again)",
    "world_size": "megatron/arguments.py:71 parse_args (initialize.py:277 again)",
    "data_parallel_size": "megatron/arguments.py:89 parse_args",
    "valid_weighted_split_names": "megatron/arguments.py:105 parse_args, :825 ParseDataPaths",
    "valid_weighted_split_weights": "megatron/arguments.py:106 parse_args, :823 ParseDataPaths",
    "valid_weighted_split_splits": "megatron/arguments.py:107 parse_args, :824 ParseDataPaths",
    "test_weighted_split_names": "megatron/arguments.py:109 parse_args, :825 ParseDataPaths",
    "test_weighted_split_weights": "megatron/arguments.py:110 parse_args, :823 ParseDataPaths",
    "test_weighted_split_splits": "megatron/arguments.py:111 parse_args, :824 ParseDataPaths",
    "train_weighted_split_names": "megatron/arguments.py:825 ParseDataPaths",
    "train_weighted_split_weights": "megatron/arguments.py:823 ParseDataPaths",
    "train_weighted_split_splits": "megatron/arguments.py:824 ParseDataPaths",
    "virtual_pipeline_model_parallel_size": "megatron/arguments.py:165/169 parse_args",
    "params_dtype": "megatron/arguments.py:172-178 parse_args",
    "consumed_train_samples": "megatron/arguments.py:201 parse_args, megatron/training.py "
                              "train_step's loop and :1153",
    "consumed_valid_samples": "megatron/arguments.py:202 parse_args, megatron/training.py:1160",
    "consumed_train_tokens": "megatron/arguments.py:203 parse_args, megatron/checkpointing.py:351",
    "gigaflos_no_embeds": "megatron/arguments.py:204 parse_args, megatron/checkpointing.py:373",
    "curriculum_learning": "megatron/arguments.py:282 parse_args, megatron/training.py:129",
    "curriculum_seqlen": "megatron/training.py:923/1028/1079, megatron/model/gpt_model.py:108",
    "padded_vocab_size": "megatron/tokenizer/tokenizer.py:64 build_tokenizer",
    "deepspeed_configuration": "megatron/training.py:125 pretrain",
    "parameters_in_billions_no_embedding": "megatron/training.py:142 pretrain",
    "iteration": "megatron/training.py:450/462 setup_model_and_optimizer, :932 train",
    "do_train": "megatron/training.py:1232 build_train_valid_test_data_iterators",
    "do_valid": "megatron/training.py:1237 build_train_valid_test_data_iterators",
    "do_test": "megatron/training.py:1238 build_train_valid_test_data_iterators",
    "pretrain_causal_attention": "pretrain_gpt.py:57 model_provider",
}


def _parse_table(text: str) -> dict[str, Option]:
    options = {}
    for line in re.sub(r"\n\s+", " ", text.strip()).splitlines():  # indented: continued
        spelled, kind, default, action = line.split()
        flag, _, dest = spelled.partition(">")
        dest = dest or flag.lstrip("-").replace("-", "_")
        options[flag] = Option(flag, dest, kind, ast.literal_eval(default), action)
    return options


OPTIONS = _parse_table(_TABLE)
_KNOWN_DESTS = frozenset(o.dest for o in OPTIONS.values())
# One Option per dest; where two spellings share a dest the first listed is the one reported.
BY_DEST: dict[str, Option] = {}
for _option in OPTIONS.values():
    BY_DEST.setdefault(_option.dest, _option)


def flag_of(dest: str) -> str:
    """How a dest is written on the command line (`--no-...` for a store_false option)."""
    option = BY_DEST.get(dest)
    return option.flag if option else "--" + dest.replace("_", "-")


def _is_option(word: str) -> bool:
    if not word.startswith("-") or word == "-":
        return False
    try:  # a negative number is a value
        float(word)
        return False
    except ValueError:
        return True


def parse_argv(words: list[str]) -> dict[str, Any]:
    """Megatron's arguments as argparse would set them: {dest: value}, values as written (str,
    a list of str for nargs options, True/False for flags). Options this table does not know
    are kept under their derived dest (a flag as True, else its value(s)) for the mapping to
    report."""
    args: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not _is_option(word):
            raise UserError(f"{show(word)!r} in the program's arguments follows no option that "
                            f"takes a value; Megatron (argparse) would refuse it{_hint([word])}")
        flag, eq, inline = word.partition("=")
        option = OPTIONS.get(flag)
        values, i = ([inline], i + 1) if eq else _values(words, i + 1)
        if option is None:
            dest = flag.lstrip("-").replace("-", "_")
            if dest in _KNOWN_DESTS:
                # argparse (allow_abbrev=False) matches option strings, not dests: the script
                # would not have run ("unrecognized arguments").
                spelled = [f for f, o in OPTIONS.items() if o.dest == dest]
                raise UserError(f"{flag} is not one of Megatron's options (it spells it "
                                f"{' or '.join(spelled)}); Megatron (argparse) would refuse "
                                f"the script with 'unrecognized arguments'")
            args[dest] = True if not values else values[0] if len(values) == 1 else values
            continue
        if option.kind in ("flag", "off"):
            if values:
                raise UserError(f"{flag} takes no value, but {show(values[0])!r} follows it")
            args[option.dest] = option.kind == "flag"
        elif option.kind == "value":
            if len(values) != 1:
                raise UserError(f"{flag} takes one value, got {len(values)}: "
                                f"{[show(v) for v in values]}{_hint(values)}")
            args[option.dest] = values[0]
        else:
            args[option.dest] = values
    return args


def _hint(words: list[str]) -> str:
    """For a word that is an unresolved variable (bash drops an unset one): how to give it."""
    name = unresolved_in(words)
    if name is None or not name[1:].isidentifier():
        return ""
    return (f"; {name} is not known without running the script: pass --var {name[1:]}=VALUE "
            f"(an empty VALUE if it is unset when the job runs)")


def _values(words: list[str], i: int) -> tuple[list[str], int]:
    start = i
    while i < len(words) and not _is_option(words[i]):
        i += 1
    return words[start:i], i
