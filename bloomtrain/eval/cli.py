"""`bloomtrain eval --checkpoint CKPT_OR_HF --tasks T1,T2 [--include-path DIR] [--num-fewshot K]
[--limit N] [--batch-size B] [--output results.json] [--nproc N parallel.tp=.. parallel.pp=..]`:
EleutherAI's lm-evaluation-harness on a bloomtrain checkpoint or an HF Bloom directory, in any
tensor x pipeline (x data) layout. With --nproc N the ranks are started by bloomtrain's local
launcher (torch's elastic launcher); under torchrun each process joins as one rank. Every rank
reads only its own shards; rank 0 runs the harness and prints its table."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from bloomtrain.devices import DTYPE_NAMES
from bloomtrain.errors import UserError
from bloomtrain.files import unwritable

_OVERRIDE = re.compile(r"parallel\.(tp|pp)=(\d+)")
# Exit code of rank 0 after a UserError it has printed (argparse's, and main()'s).
_USAGE_EXIT = 2


def _layout_from_overrides(overrides: list[str]) -> dict[str, int]:
    sizes = {"tp": 1, "pp": 1}
    for ov in overrides:
        m = _OVERRIDE.fullmatch(ov.strip())
        if not m:
            raise UserError(f"eval takes parallel.tp=N and parallel.pp=N as overrides, got "
                            f"{ov!r} (data parallelism is what the processes leave: "
                            f"--nproc / (tp * pp))")
        if int(m.group(2)) < 1:
            raise UserError(f"{ov}: the size must be >= 1")
        sizes[m.group(1)] = int(m.group(2))
    return sizes


def _limit(text: str | None) -> float | int | None:
    """The harness's --limit: a count of documents per task, or a fraction below 1."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--limit {text!r}: give a number of documents or a fraction") from None
    if not 0 < value < float("inf"):  # the harness's int(limit) fails on infinity
        raise UserError(f"--limit must be a positive finite number, got {text}")
    return int(value) if value >= 1 and value.is_integer() else value


def _options(args) -> dict:
    """Everything the ranks need, checked before any process starts."""
    import importlib.util

    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("bloomtrain eval needs EleutherAI's lm-evaluation-harness: "
                        "pip install 'bloomtrain[eval]'")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; give task names, comma-separated")
    if not Path(args.checkpoint).exists():
        raise UserError(f"--checkpoint {args.checkpoint} does not exist")
    for flag, value, low in (("--batch-size", args.batch_size, 1),
                             ("--max-length", args.max_length, 2),
                             ("--num-fewshot", args.num_fewshot, 0),
                             ("--bootstrap-iters", args.bootstrap_iters, 0)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if args.log_samples and not args.output:
        raise UserError("--log-samples writes beside the results file: give --output FILE")
    if args.output:  # found out after the whole evaluation, the results had nowhere to go
        out = Path(args.output)
        if out.is_dir() or str(args.output).endswith(os.sep):
            raise UserError(f"--output {args.output} is a directory; give the results file, "
                            f"e.g. {out / 'results.json'}")
        why = unwritable(out.parent)  # any part of the path: a file in it, read-only
        if why is None:
            try:  # made now, as the results' write would make it, so that it surely can be
                out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                why = f"{out.parent} cannot be created ({e.strerror or e})"
        if why:
            raise UserError(f"--output {args.output} cannot be written: {why}")
    sizes = _layout_from_overrides(args.overrides)
    nproc = args.nproc
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else (nproc or 1)
    if world % (sizes["tp"] * sizes["pp"]):
        raise UserError(f"{world} process(es) do not divide into parallel.tp={sizes['tp']} x "
                        f"parallel.pp={sizes['pp']} ranks; give --nproc as a multiple of "
                        f"{sizes['tp'] * sizes['pp']}")
    from bloomtrain.eval.run import check_task_data

    # Before any process starts or model loads: a wrong directory or a missing data file.
    check_task_data(tasks, args.include_path or [])
    opts = {k: v for k, v in vars(args).items() if k not in ("func", "overrides")}
    opts.update(sizes, tasks=tasks, limit=_limit(args.limit), world=world,
                include_path=list(args.include_path or []),
                tokenizer=str(checkpoint_tokenizer(args.checkpoint, args.tokenizer)))
    return opts


def _main(args) -> int:
    opts = _options(args)
    if opts["world"] > 1 and "WORLD_SIZE" not in os.environ:
        from bloomtrain.launch import failure_text, launch_local

        def explain(rank, failure) -> str:
            if failure.exitcode == _USAGE_EXIT:
                return f"rank {rank} stopped on the error it printed above"
            return failure_text(rank, failure)

        launch_local(opts["world"], eval_worker, opts, explain=explain)
        return 0
    eval_worker(opts)
    return 0


def eval_worker(opts: dict) -> None:
    """One process of the job: join it, run this rank (`run_rank`), leave it."""
    import torch.distributed as dist

    from bloomtrain.devices import process_group_backend, resolve_device

    device = resolve_device(opts["device"])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(process_group_backend("auto", device))
    try:
        run_rank(opts, device)
    except UserError as e:
        if not os.environ.get("TORCHELASTIC_RUN_ID"):
            raise  # one process, or torchrun: the command prints it
        print(f"bloomtrain eval: error: {e}", file=sys.stderr, flush=True)
        sys.exit(_USAGE_EXIT)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_rank(opts: dict, device) -> None:
    """This rank's part in a joined job (or alone): load its shards; rank 0 runs the harness,
    the others run its batches."""
    import torch.distributed as dist

    from bloomtrain.eval.model import load_eval_model
    from bloomtrain.eval.protocol import worker_loop
    from bloomtrain.layout import ParallelLayout
    from bloomtrain.topology import Topology

    world = dist.get_world_size() if dist.is_initialized() else 1
    topo = Topology.build(layout=ParallelLayout.for_world(world, opts["tp"], opts["pp"]))
    dtype = None if opts["dtype"] == "auto" else opts["dtype"]
    model = load_eval_model(opts["checkpoint"], topo, device, dtype)
    if topo.rank != 0:
        worker_loop(model)
        return
    _lead(opts, model)


def _lead(opts: dict, model) -> None:
    """Rank 0: the harness on the model, the results written and printed; the other ranks
    are told to stop whatever happens."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.lm import BloomtrainLM, default_max_length
    from bloomtrain.eval.protocol import Executor
    from bloomtrain.eval.run import (evaluate, one_line, results_table, task_manager,
                                     write_results)

    executor = Executor(model)
    try:
        tokenizer = load_tokenizer(opts["tokenizer"])
        if tokenizer.vocab_size > model.shape.vocab_size:
            raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                            f"{model.shape.vocab_size}; pass the tokenizer it was trained with")
        manager = task_manager(opts["tasks"], opts["include_path"])
        topo = model.topo
        info = {"model_num_parameters": model.shape.num_parameters(),
                "model_dtype": str(model.dtype), "checkpoint": str(opts["checkpoint"]),
                "layout": f"tp={topo.tp_size} pp={topo.pp_size} dp={topo.dp_size}"}
        lm = BloomtrainLM(executor, tokenizer, batch_size=opts["batch_size"] * topo.dp_size,
                          max_length=opts["max_length"] or default_max_length(tokenizer),
                          info=info)
        try:
            results = evaluate(lm, opts["tasks"], manager, num_fewshot=opts["num_fewshot"],
                               limit=opts["limit"], bootstrap_iters=opts["bootstrap_iters"],
                               log_samples=opts["log_samples"])
        except (FileNotFoundError, ConnectionError) as e:  # a dataset not found or fetched
            raise UserError(f"the harness could not load a task's data: {one_line(e)}") from None
    finally:
        executor.close()
    print(results_table(results), flush=True)
    if opts["output"]:
        for path in write_results(results, opts["output"]):
            print(f"[eval] wrote {path}", flush=True)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        description="Run lm-evaluation-harness tasks on a bloomtrain checkpoint or an HF Bloom "
        "directory: loglikelihood, rolling loglikelihood (perplexity) and generate_until "
        "requests, batched by length. --nproc N parallel.tp=T parallel.pp=P splits the model "
        "over T x P ranks (each reads only its shards; the rest of N is data parallelism). "
        "Needs the eval extra: pip install 'bloomtrain[eval]'. Local tasks: harness YAMLs "
        "with dataset_path: json and data_files, found through --include-path.")
    p.add_argument("--checkpoint", required=True, metavar="CKPT_OR_HF",
                   help="a bloomtrain checkpoint (step dir or root) or an HF Bloom directory")
    p.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="harness task, group or tag names (or task YAML paths), comma-separated")
    p.add_argument("--include-path", action="append", metavar="DIR",
                   help="a directory of task YAMLs, as the harness's own flag (repeatable)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", default=None, metavar="N",
                   help="documents per task: a count, or a fraction below 1 (for testing)")
    p.add_argument("--batch-size", type=int, default=16, metavar="B",
                   help="requests per forward on each data-parallel replica, longest first "
                   "(default: 16)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens of context; longer inputs lose tokens on the left and rolling "
                   "perplexity uses windows of N (default: the tokenizer's model_max_length, "
                   "else 2048, as the harness's HF backend)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the harness's results JSON here")
    p.add_argument("--log-samples", action="store_true",
                   help="with --output: every document's requests and responses, one "
                   "FILE-stem_samples_TASK.jsonl per task")
    p.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                   help="bootstrap resamples for the stderr of metrics without a closed form, "
                   "such as perplexity (0: no stderrs; default: 100000, the harness's)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a directory holding one (default: the checkpoint's)")
    p.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto",
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start N local ranks (not needed under torchrun)")
    p.add_argument("overrides", nargs="*", metavar="parallel.tp=N parallel.pp=N",
                   help="tensor- and pipeline-parallel sizes (default 1 each)")
    p.set_defaults(func=_main)
