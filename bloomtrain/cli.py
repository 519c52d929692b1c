"""`bloomtrain` command line. Thin: each subcommand lives next to the code it drives and
registers itself through a `register(subparsers)` function.

Only the module of the command being run is imported, and command modules import torch inside
their commands, not at the top: parsing, `--help` and a config's errors then cost a fraction of a
second instead of torch's import (`import torch` alone is 1-2 s of CPU and brings
torch.distributed with it). The one-line helps of `bloomtrain --help` live here for that reason.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from bloomtrain.errors import UserError

# name -> (the module whose register(subparsers) adds it, its line in `bloomtrain --help`),
# in listing order.
COMMANDS = {
    "demo": ("bloomtrain.demo", "run the whole path on built-in data (no download)"),
    "train": ("bloomtrain.train.cli", "train a BLOOM model"),
    "tokenizer": ("bloomtrain.data.tokenizer", "train a byte-level BPE tokenizer"),
    "preprocess": ("bloomtrain.data.preprocess", "tokenize text into a Megatron .bin/.idx dataset"),
    "data": ("bloomtrain.data.inspect", "inspect or merge .bin/.idx datasets"),
    "import-hf": ("bloomtrain.hf", "convert an HF Bloom model directory into a bloomtrain "
                                   "checkpoint"),
    "export-hf": ("bloomtrain.hf", "write a bloomtrain checkpoint as an HF BloomForCausalLM "
                                   "directory"),
    "import-deepspeed": ("bloomtrain.checkpoint.interop.importer",
                         "convert a DeepSpeed / Megatron-DeepSpeed checkpoint into a bloomtrain "
                         "checkpoint"),
    "generate": ("bloomtrain.generate", "continue a prompt with a bloomtrain checkpoint or an HF "
                                        "Bloom model"),
    "eval": ("bloomtrain.eval.cli", "evaluate with EleutherAI's lm-evaluation-harness, in any "
                                    "parallel layout"),
    "serve": ("bloomtrain.serve.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "pipeline-timeline": ("bloomtrain.pipeline_timeline", "print a pipeline step's per-stage "
                                                          "timeline and bubble"),
    "plan": ("bloomtrain.planner.cli", "predict memory and step time of layouts; find the best "
                                       "ones"),
    "plot": ("bloomtrain.report.cli", "plot runs (PNGs and report.html)"),
    "status": ("bloomtrain.report.cli", "one screen on where a run stands"),
    "import-config": ("bloomtrain.import_config", "convert a Megatron-DeepSpeed launch and its "
                                                  "ds_config into a bloomtrain config"),
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. Its positionals (`section.key=value` overrides, run directories)
    may come before, between and after its options; an argument it does not know is its own
    error, shown with its own usage. (Plain argparse takes positionals up to the first option
    only, and hands what it does not know up to the top-level parser, whose usage says nothing
    about the subcommand.)"""

    _intermixing = False  # parse_known_intermixed_args calls parse_known_args itself

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        if self._subparsers is not None:  # `tokenizer`, `data`: their actions parse the rest
            namespace, extras = super().parse_known_args(args, namespace)
        else:
            self._intermixing = True
            try:
                namespace, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixing = False
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        if not hasattr(namespace, "command_prog"):  # the innermost: "bloomtrain tokenizer train"
            namespace.command_prog = self.prog  # its errors' prefix
        return namespace, extras


class _Registrar:
    """What a command module's register() receives: add_parser, with the command's help line
    from COMMANDS (the one a placeholder shows), also its description unless it has one."""

    def __init__(self, subparsers):
        self._sub = subparsers

    def add_parser(self, name, **kwargs):
        kwargs["help"] = COMMANDS[name][1]
        kwargs.setdefault("description", kwargs["help"])
        return self._sub.add_parser(name, **kwargs)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: its command registered by its module, every other one a
    placeholder that only lists it. argv None registers every command."""
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    parser = argparse.ArgumentParser(
        prog="bloomtrain",
        description="Train BLOOM-architecture language models with 3D parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True
    registered = set()
    for name, (module, help_line) in COMMANDS.items():
        if name in sub.choices:  # its module registered it with an earlier one
            continue
        if wanted is None or COMMANDS.get(wanted, ("",))[0] == module:
            if module not in registered:
                importlib.import_module(module).register(_Registrar(sub))
                registered.add(module)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"{args.command_prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and friends: not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
