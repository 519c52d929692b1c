"""`bloomtrain` command line. Thin: each subcommand lives next to the code it drives and
registers itself through a `register(subparsers)` function.

Only the module of the command being run is imported, and command modules import torch inside
their commands, not at the top: parsing, `--help` and a config's errors then cost a fraction of a
second instead of torch's import (`import torch` alone is 1-2 s of CPU and brings
torch.distributed with it). The one-line helps of `bloomtrain --help` live here for that reason.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import signal
import sys
import threading
import warnings

from bloomtrain.errors import UserError
from bloomtrain.signals import Terminated, take_signal  # noqa: F401 (Terminated: for callers)

# Where bloomtrain's modules are: warnings from them get its one-line form.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# name -> (the cli module whose register(subparsers) adds it, as "module" or
# "module:function" where one cli module registers several commands, and its line in
# `bloomtrain --help`), in listing order. Every parser lives in a cli module.
COMMANDS = {
    "demo": ("bloomtrain.cli:register_demo",
             "run the whole path on built-in data (no download)"),
    "train": ("bloomtrain.train.cli", "train a BLOOM model"),
    "tokenizer": ("bloomtrain.data.cli:register_tokenizer", "train a byte-level BPE tokenizer"),
    "preprocess": ("bloomtrain.data.cli:register_preprocess",
                   "tokenize text into a Megatron .bin/.idx dataset"),
    "data": ("bloomtrain.data.cli:register_data", "inspect or merge .bin/.idx datasets"),
    "import-hf": ("bloomtrain.checkpoint.cli:register_hf",
                  "convert an HF Bloom model directory into a bloomtrain checkpoint"),
    "export-hf": ("bloomtrain.checkpoint.cli:register_hf",
                  "write a bloomtrain checkpoint as an HF BloomForCausalLM directory"),
    "import-deepspeed": ("bloomtrain.checkpoint.cli:register_deepspeed",
                         "convert a DeepSpeed / Megatron-DeepSpeed checkpoint into a bloomtrain "
                         "checkpoint"),
    "generate": ("bloomtrain.cli:register_generate",
                 "continue a prompt with a bloomtrain checkpoint or an HF Bloom model"),
    "eval": ("bloomtrain.eval.cli", "evaluate with EleutherAI's lm-evaluation-harness, in any "
                                    "parallel layout"),
    "serve": ("bloomtrain.serve.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "pipeline-timeline": ("bloomtrain.report.cli:register_timeline",
                          "print a pipeline step's per-stage timeline and bubble"),
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
                name_, _, function = module.partition(":")
                getattr(importlib.import_module(name_), function or "register")(_Registrar(sub))
                registered.add(module)
        else:
            sub.add_parser(name, help=help_line)
    return parser


# ---- the commands that live in no package: demo and generate ----------------------------

def register_demo(sub) -> None:
    p = sub.add_parser("demo",
                       description="Build a corpus from the Python standard library, train a "
                                   "tokenizer, preprocess, train a small BLOOM, evaluate, export "
                                   "to HF and generate text.")
    p.add_argument("--run-dir", default="bloomtrain_demo",
                   help="where everything is written (default: ./bloomtrain_demo)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.train_iters=100")
    p.set_defaults(func=_demo)



def _demo(args) -> int:
    from bloomtrain.demo import run_demo

    run_demo(args.run_dir, args.overrides)
    return 0



def register_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        description="Print the prompt and its continuation. Decoding is greedy unless "
        "--temperature, --top-k or --top-p is given, which switches to sampling (HF order: "
        "temperature, then top-k, then top-p). Generation stops at the tokenizer's end-of-"
        "document token. Tokens beyond the tokenizer's vocabulary (embedding padding) are "
        "never produced.")
    p.add_argument("--checkpoint", required=True, metavar="DIR_OR_HF",
                   help="a bloomtrain checkpoint (step dir or root) or an HF Bloom directory")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample with this temperature")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens (0: no limit)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens with total probability >= P")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed for sampling (default: a fresh random seed)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding (the default when no sampling option is given)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a directory holding one (default: the checkpoint's)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: per-output-channel int8 weights for the linear layers and the "
                   "tied embedding, dequantized in the matmul (a quarter of fp32's bytes)")
    p.set_defaults(func=_generate)



def _generate_options(args) -> tuple[bool, float, float]:
    """(do_sample, temperature, top_p) from generate's flags, each bad value a one-line error."""
    from pathlib import Path

    sampling_flags = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                     ("--top-p", args.top_p)) if v is not None]
    if args.greedy and sampling_flags:
        raise UserError(f"--greedy conflicts with {', '.join(sampling_flags)}")
    do_sample = bool(sampling_flags)
    temperature = 1.0 if args.temperature is None else args.temperature
    top_p = 1.0 if args.top_p is None else args.top_p
    if do_sample and not 0 < temperature < float("inf"):  # nan fails both, as inf the second
        raise UserError(f"--temperature must be a positive number, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.seed is not None and not -2 ** 63 <= args.seed < 2 ** 64:  # torch's seed range
        raise UserError(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if not Path(args.checkpoint).exists():
        raise UserError(f"--checkpoint {args.checkpoint} does not exist")
    return do_sample, temperature, top_p


def _generate(args) -> int:
    import torch

    from bloomtrain import load_model
    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.devices import resolve_device
    from bloomtrain.generate import generate

    do_sample, temperature, top_p = _generate_options(args)
    tokenizer = load_tokenizer(checkpoint_tokenizer(args.checkpoint, args.tokenizer))
    device = resolve_device(args.device)
    model = load_model(args.checkpoint, device=device)
    if args.quantize:
        from bloomtrain.serve.quantize import quantize_model
        quantize_model(model, args.quantize)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise UserError("--prompt encodes to no tokens")
    if tokenizer.vocab_size > model.shape.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.shape.vocab_size}; pass the tokenizer the model was trained with")
    try:
        eos = tokenizer.eod_id
    except UserError:
        eos = None
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        if args.seed is not None:
            generator.manual_seed(args.seed)
        else:
            generator.seed()
    ids = generate(model, torch.tensor([prompt_ids], device=device), args.max_new_tokens,
                   do_sample=do_sample, temperature=temperature, top_k=args.top_k or 0,
                   top_p=top_p, eos_token_id=eos, generator=generator,
                   vocab_limit=tokenizer.vocab_size)[0].tolist()
    new = ids[len(prompt_ids):]
    if eos is not None and eos in new:
        new = new[:new.index(eos)]
    # Decoding the whole sequence, not prompt + decode(new), keeps a multi-byte character that
    # straddles the boundary intact.
    sys.stdout.write(tokenizer.decode(prompt_ids + new) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    here = threading.current_thread() is threading.main_thread()  # handlers: main thread only
    previous = take_signal() if here else None
    formatter = warnings.formatwarning
    warnings.formatwarning = functools.partial(_warning_line, args.command_prog, formatter)
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"{args.command_prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # On a line of its own: a progress bar may have the cursor.
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        said = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}.get(
            signum, f"terminated ({signal.Signals(signum).name})")
        print(f"\n{said}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # output piped into `head` and friends: not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as e:
        if e.filename is None or isinstance(e, ConnectionError):
            raise  # not about a path the user gave: a bug, with its traceback
        # A path the command could not read or write (a directory where a file goes, a file
        # where a directory goes, a read-only or missing place): one line, as a UserError.
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        print(f"{args.command_prog}: error: {e.strerror or e}: {where}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatter
        if here:
            signal.signal(signal.SIGTERM, previous)
    return int(rc or 0)


def _warning_line(prog: str, default, message, category, filename, lineno, line=None) -> str:
    """bloomtrain's own warnings (a layout with fewer micro-batches than stages, a kernel
    fallen back) as one line, like its errors; Python's form (a file path and the source line
    that warned) is kept for everyone else's."""
    if issubclass(category, UserWarning) and \
            os.path.dirname(os.path.abspath(filename)).startswith(PACKAGE_DIR):
        return f"{prog}: warning: {message}\n"
    return default(message, category, filename, lineno, line)


if __name__ == "__main__":
    sys.exit(main())
