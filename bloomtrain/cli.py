"""`bloomtrain` command line. Thin: each subcommand lives next to the code it drives and
registers itself through a `register(subparsers)` function."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from bloomtrain.errors import UserError

# Each module defines register(subparsers), which adds its parser(s) and sets `func`.
COMMAND_MODULES = [
    "bloomtrain.demo",
    "bloomtrain.train",
    "bloomtrain.data.tokenizer",
    "bloomtrain.data.preprocess",
    "bloomtrain.data.inspect",
    "bloomtrain.hf",
    "bloomtrain.checkpoint.interop.importer",
    "bloomtrain.generate",
    "bloomtrain.eval.cli",
    "bloomtrain.serve.cli",
    "bloomtrain.pipeline_timeline",
    "bloomtrain.planner.cli",
    "bloomtrain.report.cli",
    "bloomtrain.import_config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloomtrain",
        description="Train BLOOM-architecture language models with 3D parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"bloomtrain {args.command}: error: {e}", file=sys.stderr)
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
