"""The checkpoint conversion commands' parsers: `bloomtrain import-hf` and `export-hf`
(bloomtrain/hf.py) and `bloomtrain import-deepspeed` (checkpoint/interop/importer.py). Each
command imports its library module when it runs, so that parsing and `--help` load no torch."""
from __future__ import annotations


def register_hf(subparsers) -> None:
    p = subparsers.add_parser(
        "import-hf",
        description="Read an HF BloomForCausalLM/BloomModel directory (config.json plus "
        "model.safetensors, pytorch_model.bin, or their sharded *.index.json) and write a "
        "bloomtrain checkpoint (step 0) with the same tensors, bit for bit, and its tokenizer.")
    p.add_argument("--input", required=True, metavar="HF_DIR")
    p.add_argument("--output", required=True, metavar="DIR", help="checkpoint root to create")
    p.set_defaults(func=_import_hf)

    p = subparsers.add_parser(
        "export-hf",
        description="Write config.json, model.safetensors (tied head stored once), "
        "generation_config.json and the tokenizer files of a bloomtrain checkpoint, loadable "
        "with transformers' BloomForCausalLM.from_pretrained.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a checkpoint step directory or a root holding `latest`")
    p.add_argument("--output", required=True, metavar="DIR")
    p.set_defaults(func=_export_hf)


def _import_hf(args) -> int:
    from bloomtrain.checkpoint.hf.convert import import_hf
    import_hf(args.input, args.output)
    return 0


def _export_hf(args) -> int:
    from bloomtrain.checkpoint.hf.convert import export_hf
    export_hf(args.checkpoint, args.output)
    return 0


def register_deepspeed(subparsers) -> None:
    p = subparsers.add_parser(
        "import-deepspeed",
        description="Read a DeepSpeed checkpoint (an HF BloomForCausalLM under ZeRO 1/2/3 or the "
        "BF16_Optimizer, a Megatron-DeepSpeed BLOOM pipeline checkpoint at any tp x pp x dp, or a "
        "DeepSpeed universal checkpoint) and write a bloomtrain checkpoint with its weights, fp32 "
        "masters, Adam moments and step, and the run's iteration and consumed samples; "
        "`bloomtrain train --config OUT/bloomtrain.yaml` continues it on any layout. deepspeed "
        "is not needed: the pickles are read with torch.load(weights_only=True) and stand-ins for "
        "the few DeepSpeed classes they name.")
    p.add_argument("--input", required=True, metavar="DIR",
                   help="a save directory (with `latest`), HF Trainer's checkpoint-N/, a "
                        "global_stepN/ directory, or a universal checkpoint")
    p.add_argument("--output", required=True, metavar="CKPT", help="checkpoint root to create")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the run's tokenizer (an HF tokenizer directory or Megatron's vocab.json "
                        "+ merges.txt), stored with the checkpoint")
    p.add_argument("--weights-only", action="store_true",
                   help="import the weights alone: a new optimizer and schedule start from them")
    p.add_argument("--model-config", metavar="FILE",
                   help="for an HF model trained under DeepSpeed without its config.json beside "
                        "the checkpoint: the model's HF config.json, or a bloomtrain YAML whose "
                        "model section gives the shape (a preset or explicit keys)")
    p.set_defaults(func=_import_deepspeed)


def _import_deepspeed(args) -> int:
    from bloomtrain.checkpoint.interop.importer import import_deepspeed
    import_deepspeed(args.input, args.output, args.tokenizer, args.weights_only,
                     model_config=args.model_config)
    return 0
