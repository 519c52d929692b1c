"""`bloomtrain serve --checkpoint DIR_OR_HF [--port 8000] [--nproc N parallel.tp=N]
[--quantize int8] [--served-model-name NAME] [--chat-template FILE] [--strict-fields]
[--api-key KEY]`: build the model, the KV cache, the engine and the HTTP server, and run them
until SIGTERM. With --nproc N the N tensor-parallel ranks are started by bloomtrain's local
launcher (torch's elastic launcher); under torchrun each process joins as one rank."""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

from bloomtrain.devices import DTYPE_NAMES
from bloomtrain.errors import UserError


def _tp_from_overrides(overrides: list[str]) -> int | None:
    tp = None
    for ov in overrides:
        m = re.fullmatch(r"parallel\.tp=(\d+)", ov.strip())
        if not m:
            raise UserError(f"serve takes only parallel.tp=N as an override, got {ov!r} (a "
                            f"served model has no pipeline or data parallelism)")
        tp = int(m.group(1))
        if tp < 1:
            raise UserError(f"parallel.tp must be >= 1, got {tp}")
    return tp


API_KEY_ENV = "BLOOMTRAIN_API_KEY"


def _api_key(args) -> str | None:
    """--api-key, else BLOOMTRAIN_API_KEY (which keeps the key out of `ps`), else None."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise UserError(f"the API key ({'--api-key' if args.api_key is not None else API_KEY_ENV})"
                        f" is empty; give the key clients must send, or leave it unset")
    return key.strip() if key is not None else None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: what it resolves to may be reachable from elsewhere
        return False


def _engine_config(opts: dict):
    from bloomtrain.serve.config import EngineConfig
    return EngineConfig(max_model_len=opts["max_model_len"], block_size=opts["block_size"],
                        kv_cache_tokens=opts["kv_cache_tokens"],
                        max_num_seqs=opts["max_num_seqs"],
                        max_batched_tokens=opts["max_batched_tokens"],
                        prefill_chunk=opts["prefill_chunk"], max_queue=opts["max_queue"],
                        enforce_eager=opts["enforce_eager"])


def _main(args) -> int:
    import importlib.util

    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer

    if importlib.util.find_spec("aiohttp") is None:
        raise UserError("bloomtrain serve needs aiohttp: pip install 'bloomtrain[serve]'")
    tp = _tp_from_overrides(args.overrides)
    nproc = args.nproc
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    under_launcher = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else (nproc or 1)
    tp = tp or world
    if tp != world:
        raise UserError(f"parallel.tp={tp} needs {tp} processes, one per rank (serving has no "
                        f"pipeline or data parallelism); "
                        + (f"the job has {world}" if under_launcher else f"add --nproc {tp}"))
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if not 0 <= args.drain_timeout < float("inf"):  # NaN too; inf broke the drain's join
        raise UserError(f"--drain-timeout must be a finite number of seconds >= 0, got "
                        f"{args.drain_timeout}")
    if not Path(args.checkpoint).exists():
        raise UserError(f"--checkpoint {args.checkpoint} does not exist")
    opts = {k: v for k, v in vars(args).items() if k not in ("func", "overrides")}
    opts["api_key"] = _api_key(args)
    if opts["api_key"] is None and not _loopback(args.host):
        print(f"[serve] warning: --host {args.host} answers anyone who can reach port "
              f"{args.port} and no API key is set: give --api-key KEY or {API_KEY_ENV} to ask "
              f"clients for one", file=sys.stderr, flush=True)
    opts["tp"] = tp
    opts["tokenizer"] = str(checkpoint_tokenizer(args.checkpoint, args.tokenizer))
    opts["chat_template_source"] = _chat_template(opts["tokenizer"], args.chat_template)
    _engine_config(opts).check()  # before any process starts
    if tp > 1 and not under_launcher:
        from bloomtrain.launch import launch_local

        # SIGTERM/SIGINT reaching the launcher is passed on to the ranks, and it waits for
        # them: rank 0 drains and stops the others, a normal end (exit 0).
        # --threads for every rank from its start (the launcher's default share otherwise).
        threads = {"OMP_NUM_THREADS": str(opts["threads"])} if opts["threads"] else None
        launch_local(tp, serve_worker, opts, worker_env=threads, signalled=lambda name: print(
            f"[serve] stopped by {name}", file=sys.stderr))
        return 0
    serve_worker(opts)
    return 0


def _chat_template(tokenizer_path: str, path: str | None) -> str | None:
    """The chat template's source (--chat-template FILE, else the tokenizer's, else None),
    compiled once here so that a bad one stops the server before anything starts."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.serve.chat import ChatTemplate, template_source

    tokenizer = load_tokenizer(tokenizer_path)
    source = template_source(tokenizer, path)
    if source is not None:
        ChatTemplate(source, tokenizer)
    return source


def serve_worker(opts: dict) -> None:
    """One rank: rank 0 serves HTTP and schedules, the others run the batches it sends."""
    _serve_rank(opts)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # Under torch's elastic agent (--nproc, torchrun) a rank that returns waits for the
        # agent to collect its return value. An agent stopping on SIGTERM never does: it waits
        # for the ranks to exit and kills them after 30 s. The drain is done, so exit now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _serve_rank(opts: dict) -> None:
    import torch
    import torch.distributed as dist

    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.serve.tp import (TensorParallelExecutor, build_runner, serving_layout,
                                     worker_loop)
    from bloomtrain.devices import process_group_backend, resolve_device
    from bloomtrain.topology import Topology

    device = resolve_device(opts["device"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    topo = Topology.single()
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group(process_group_backend("auto", device))
        topo = Topology.build(layout=serving_layout(world))
    try:
        if topo.rank != 0:
            # The launcher passes SIGTERM to every rank; only rank 0 decides when to stop
            # (after draining), and tells the others.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if opts["threads"]:
            torch.set_num_threads(opts["threads"])
        dtype = None if opts["dtype"] == "auto" else opts["dtype"]
        runner = build_runner(opts["checkpoint"], _engine_config(opts), topo, device, dtype,
                              opts["quantize"])
        if topo.rank != 0:
            worker_loop(runner)
            return
        executor = TensorParallelExecutor(runner) if topo.tp_size > 1 else runner.forward
        try:
            _serve(opts, executor, runner, load_tokenizer(opts["tokenizer"]))
        finally:
            if topo.tp_size > 1:
                executor.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(opts: dict, executor, runner, tokenizer) -> None:
    """The engine on this process's main thread, the HTTP front end in a child process
    (bloomtrain.serve.remote says why)."""
    from bloomtrain.serve.engine import Engine
    from bloomtrain.serve.metrics import ServeMetrics
    from bloomtrain.serve.quantize import model_bytes
    from bloomtrain.serve.remote import frontend_failure, serve_engine, start_frontend

    model, cache = runner.model, runner.cache
    if tokenizer.vocab_size > model.shape.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.shape.vocab_size}; pass the tokenizer it was trained with")
    try:
        eos = tokenizer.eod_id
    except UserError:
        eos = None
    config = _engine_config(opts)
    engine = Engine(executor, config, vocab_size=model.shape.vocab_size,
                    vocab_limit=tokenizer.vocab_size, eos_token_id=eos, tokenizer=tokenizer,
                    metrics=ServeMetrics(), device=runner.device)
    names = tuple(opts["served_model_name"] or [Path(opts["checkpoint"]).resolve().name])
    packed = (f" (packed for them: +{runner.packed_bytes / 2**20:.1f} MiB)"
              if runner.packed_bytes else "")
    print(f"[serve] model {names[0]}: {model_bytes(model) / 2**20:.1f} MiB of weights"
          f"{' (int8)' if opts['quantize'] else ''} per rank, tp={opts['tp']}; KV cache "
          f"{cache.bytes / 2**20:.1f} MiB ({cache.num_blocks} blocks of {cache.block_size}); "
          f"matmuls padded to {runner.min_rows} rows{packed}; decode "
          f"{'eager' if runner.graphs is None else 'from CUDA graphs'}", flush=True)
    frontend, conn = start_frontend(opts, {"config": config, "vocab_limit": tokenizer.vocab_size,
                                           "served_names": names,
                                           "chat_template": opts["chat_template_source"],
                                           "strict_fields": opts["strict_fields"]})
    signals: list[int] = []
    try:
        signals = serve_engine(engine, conn, frontend)
    finally:
        engine.close()
        conn.close()
        frontend.join(timeout=opts["drain_timeout"] + 10)
        if frontend.is_alive():
            frontend.kill()
            frontend.join()
    # Stopped by a signal: the front end's end was asked for (one still starting up dies of it).
    failure = None if signals else frontend_failure(frontend.exitcode)
    if failure is not None:
        raise UserError(failure)
    print("[serve] stopped", flush=True)


def register(subparsers) -> None:
    from bloomtrain.serve.config import EngineConfig

    d = EngineConfig()
    p = subparsers.add_parser(
        "serve",
        description="Serve a bloomtrain checkpoint or an HF Bloom directory: POST "
        "/v1/completions and /v1/chat/completions (OpenAI's APIs with vLLM's extra sampling "
        "parameters, streaming by server-sent events), POST /tokenize and /detokenize, GET "
        "/tokenizer_info, /v1/models, /health, /metrics (Prometheus). Continuous batching "
        "over a paged KV cache; "
        "--nproc N parallel.tp=N splits the model over N tensor-parallel ranks; --quantize "
        "int8 stores int8 weights. SIGTERM drains the requests in flight, then exits.")
    p.add_argument("--checkpoint", required=True, metavar="DIR_OR_HF",
                   help="a bloomtrain checkpoint (step dir or root) or an HF Bloom directory")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a directory holding one (default: the checkpoint's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"ask clients for 'Authorization: Bearer KEY' on /v1/* and the "
                   f"tokenizer routes (401 otherwise; /health and /metrics stay open); default: "
                   f"${API_KEY_ENV}, which keeps the key off the command line")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port (default: 8000; 0 picks a free one and prints it)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start N local tensor-parallel ranks (not needed under torchrun)")
    p.add_argument("overrides", nargs="*", metavar="parallel.tp=N",
                   help="tensor-parallel size (default: the number of processes)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: per-output-channel int8 weights, dequantized in the matmul")
    p.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto",
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads per rank (default: torch's)")
    p.add_argument("--served-model-name", "--model-name", nargs="+", default=None,
                   metavar="NAME", help="the `model` names requests may give, the first one "
                   "reported (default: the checkpoint dir's name); any other is a 404")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the "
                   "tokenizer's, tokenizer_config.json's chat_template)")
    p.add_argument("--strict-fields", action="store_true",
                   help="answer 400 to a request field this server does not know (default: "
                   "ignore it, naming it in the X-Ignored-Fields header and the log)")
    _engine_options(p, d)
    p.add_argument("--drain-timeout", type=float, default=25.0, metavar="S",
                   help="on SIGTERM, seconds to let requests in flight finish (default: 25; "
                   "under --nproc the launcher kills the ranks 30 s after SIGTERM)")
    p.set_defaults(func=_main)


def _engine_options(p, d) -> None:
    """The engine's sizes, defaults from EngineConfig `d`."""
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help=f"prompt + generated tokens per sequence (default: {d.max_model_len})")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"sequences in the running batch (default: {d.max_num_seqs})")
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens,
                   help=f"tokens per step (default: {d.max_batched_tokens})")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"prompt tokens per chunk (default: {d.prefill_chunk})")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV-cache block (default: {d.block_size})")
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens,
                   help=f"KV-cache pool size in tokens (default: {d.kv_cache_tokens})")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"waiting sequences before requests get 503 (default: {d.max_queue})")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every decode step eagerly: no CUDA graphs (by default, on CUDA at "
                        "tp=1, decode steps replay graphs captured at padded batch sizes)")
