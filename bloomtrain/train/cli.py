"""`bloomtrain train --config FILE [section.key=value ...] [--nproc N] [--nnodes N --node-rank R
--rdzv-endpoint HOST:PORT [--local-addr ADDR]] [--max-restarts N]`."""
from __future__ import annotations

import functools
import os
import signal
import sys

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.validate import validate
from bloomtrain.launch import (end_by_signal, env_from_slurm, LaunchSpec, node_address,
                               srun_task, STOP_FILE_ENV, world_size_from_env)

# The launcher's options and their defaults: given under torchrun, they would do nothing.
LAUNCH_DEFAULTS = {"nproc": None, "nnodes": 1, "node_rank": 0, "rdzv_endpoint": None,
                   "rdzv_timeout": None, "max_restarts": 0, "local_addr": None}


def _sigint_before_training(launcher: int, _signum, _frame) -> None:
    """A launched worker's SIGINT until the run's own handler is up (RunControl.active). A
    terminal's Ctrl-C reaches the workers too, and the launcher takes that one (it asks the
    workers to stop through the stop file: bloomtrain.launch.SigintStop), so it is ignored here.
    But SIGINT is also torch's death signal for a worker whose launcher died: then the start
    ends (nothing is trained yet), where it was ignored and the orphaned workers trained the
    whole run."""
    if os.getppid() != launcher:
        print("bloomtrain: the launcher is gone (killed); this worker stops before training",
              file=sys.stderr, flush=True)
        raise KeyboardInterrupt


def worker_entry(config_path, overrides, run):
    """A launched worker: `run` is what the launcher's `validate` returned for the job. Returns
    the run's summary (bloomtrain.train.control.summary) to the launcher."""
    launcher = os.getppid()
    if STOP_FILE_ENV in os.environ:
        signal.signal(signal.SIGINT, functools.partial(_sigint_before_training, launcher))
        # `scancel --signal=USR1` reaches the launcher too, which leaves it to the workers'
        # loop (its signal file): its default action here killed the worker mid-start.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    import torch.distributed as dist

    from bloomtrain.train import watchdog
    from bloomtrain.train.control import summary
    from bloomtrain.train.loop import train

    if world_size_from_env() != run.layout.world_size:
        # The launcher checked the layout at --nproc x --nnodes; a node started with another
        # --nproc makes another world, which the layout's rules never saw.
        raise UserError(f"the job has {world_size_from_env()} workers, but this node's launcher "
                        f"was started for {run.layout.world_size} (--nproc x --nnodes): give "
                        f"every node the same --nproc")
    cfg = Config.load(config_path, overrides)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    watchdog.forget_pointer(int(os.environ.get("RANK", "0")))
    if restart and os.environ.get("RANK") == "0":
        print(f"[launch] restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS')}: "
              f"every worker started again after one failed; resuming "
              f"(checkpoint.resume={cfg.checkpoint.resume})", file=sys.stderr, flush=True)
    # Not in a `finally`: after an error the process groups stay up until the process exits.
    # torch records a worker's error (the file the launcher reads for the job's first failure)
    # once this function has raised; destroying the groups before that closes the connections
    # the peers wait on, and a peer's "connection closed" could be recorded first and named as
    # the job's failure, with this rank's own error never shown (seen once in CI).
    result = train(cfg, run=run)
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.getppid() != launcher:
        # The launcher is gone (SIGKILLed: its death signal stopped this run, which has saved).
        # Returning would wait in torch's wrapper, forever, for it to collect the result, and
        # hold this process (and on a GPU its memory) as an orphan.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    agent_ends = "SIGTERM" in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    if result.stop_signal == signal.SIGTERM and agent_ends:
        # A torch whose agent takes SIGTERM itself (one without LaunchConfig.signals_to_handle)
        # is ending the job: it passed its SIGTERM on and waits for the workers to end,
        # reading nothing back. A worker that returned would wait in torch's wrapper for the
        # agent to collect it, and the agent for the worker, until its SIGKILL 30 s later. The
        # checkpoint is saved: end as the signal would have. Otherwise the launcher took the
        # SIGTERM and waits for the workers' return (bloomtrain.launch._SignalTaker).
        end_by_signal(signal.SIGTERM)
    return summary(result)


def launch_spec(args, cfg: Config) -> LaunchSpec | None:
    """The launch the command line asks for; None when this process is a worker itself (under
    torchrun or srun) or runs the job alone. The rendezvous timeout is the config's
    parallel.rdzv_timeout_minutes, which --rdzv-timeout sets in seconds (an override)."""
    rdzv = args.rdzv_timeout
    if rdzv is None:
        rdzv = cfg.parallel.rdzv_timeout_minutes * 60
    spec = LaunchSpec(nproc=1 if args.nproc is None else args.nproc, nnodes=args.nnodes,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                      rdzv_timeout=rdzv, max_restarts=args.max_restarts,
                      local_addr=args.local_addr)
    # A worker of torchrun (WORLD_SIZE), or a task of a plain srun of several (whose variables
    # env_from_slurm translates later): each task starting a launch of its own would make as
    # many independent jobs writing the same run directory. srun's tasks carry a step id; the
    # batch script itself, where bloomtrain's launcher may run, does not.
    srun = srun_task()
    if "WORLD_SIZE" in os.environ or srun:
        given = [f"--{k.replace('_', '-')}" for k, v in LAUNCH_DEFAULTS.items()
                 if getattr(args, k) != v]
        if given:
            under = "WORLD_SIZE is set" if "WORLD_SIZE" in os.environ else \
                f"srun started {os.environ['SLURM_NTASKS']} tasks"
            raise UserError(f"{' '.join(given)} are bloomtrain's launcher options, but this "
                            f"process already runs under a launcher ({under}); give them to "
                            f"torchrun (--nproc-per-node, --nnodes, --node-rank, "
                            f"--rdzv-endpoint, --max-restarts, --local-addr) or srun, or run "
                            f"`bloomtrain train` without either")
        return None
    spec.check()
    node_address(spec)  # a loopback advertisement refused now, before anything waits
    if spec.world_size == 1 and not spec.max_restarts:
        return None
    return spec


def cmd_train(args) -> int:
    from bloomtrain.report.closing import print_closing  # the run's last lines

    # Every check of the config before torch is imported (seconds of CPU) or a worker starts.
    if args.rdzv_timeout is not None:  # the config's key, as the workers and config.yaml see it
        args.overrides = [*args.overrides,
                          f"parallel.rdzv_timeout_minutes={args.rdzv_timeout / 60!r}"]
    cfg = Config.load(args.config, args.overrides)
    spec = launch_spec(args, cfg)
    if spec is None:
        env_from_slurm()  # a plain srun's tasks as torchrun's variables, as the Trainer does
    run = validate(cfg, spec.world_size if spec is not None else world_size_from_env(),
                   max_restarts=spec.max_restarts if spec is not None else 0,
                   nnodes=spec.nnodes if spec is not None else 1)
    # The datasets and the tokenizer too (numpy, no torch): a missing file or a token id past
    # the model's vocabulary is refused here, not in every worker after the launch.
    from bloomtrain.data.check import check_data
    _, checked = check_data(cfg, run)
    if spec is not None:
        # ZeRO-Offload's host memory on this node, before any worker starts (each checks again
        # with its own device and resident memory before it allocates).
        from bloomtrain.planner.host import check_host, launch_device_kind
        first = spec.node_rank * spec.nproc
        check_host(cfg, checked.shape, checked.layout, launch_device_kind(cfg.train.device),
                   range(first, first + spec.nproc))
        from bloomtrain.train.control import exit_after_sigint
        from bloomtrain.train.launch import launch_local
        stopped = launch_local(spec.nproc, worker_entry, args.config, args.overrides, run,
                               spec=spec, checkpoint_dir=cfg.checkpoint.dir)
        if spec.node_rank == 0:  # the launcher of rank 0's node: its console
            print_closing(cfg.run_dir, cfg.checkpoint.dir)
        return exit_after_sigint(stopped) if stopped else 0
    import torch.distributed as dist

    from bloomtrain.signals import take_signal
    from bloomtrain.train.control import exit_after_sigint, stopped_text, summary
    from bloomtrain.train.loop import train
    # SIGUSR1 (save and stop) before the training loop takes it, where its default action
    # killed the process with no word: the start ends as SIGTERM's does (nothing to save yet).
    previous = take_signal(signal.SIGUSR1)
    try:
        result = train(cfg, run=run)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":  # alone, or rank 0 under torchrun / srun
        print_closing(cfg.run_dir, cfg.checkpoint.dir)
    if result.exit_reason == "SIGINT":  # Ctrl-C: the step it stopped at, last, and exit 130
        return exit_after_sigint(stopped_text(summary(result), cfg.checkpoint.dir))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train",
                       description="Train a BLOOM model from a YAML config plus overrides. With "
                                   "--nproc (and --nnodes), bloomtrain starts the workers itself "
                                   "through torch's elastic launcher; under torchrun or srun "
                                   "each process joins the job from the environment.")
    p.add_argument("--config", help="YAML config file (sections model, parallel, data, optim, "
                                    "train, checkpoint, run_dir)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch N worker processes on this node (not needed under torchrun/srun)")
    node = p.add_argument_group("several nodes and restarts (as torchrun does them)")
    node.add_argument("--nnodes", type=int, default=LAUNCH_DEFAULTS["nnodes"],
                      help="number of nodes; run the same command on each (default 1)")
    node.add_argument("--node-rank", type=int, default=LAUNCH_DEFAULTS["node_rank"],
                      help="this node's number, 0 to nnodes-1; node 0 runs at --rdzv-endpoint "
                           "and hosts the rendezvous (default 0)")
    node.add_argument("--rdzv-endpoint", default=LAUNCH_DEFAULTS["rdzv_endpoint"],
                      metavar="HOST:PORT",
                      help="node 0's address and a free port there, the same on every node "
                           "(c10d rendezvous); needed with --nnodes > 1")
    node.add_argument("--local-addr", default=LAUNCH_DEFAULTS["local_addr"], metavar="ADDR",
                      help="this node's address, the one the other nodes reach it at (as "
                           "torchrun's); default: the source address of the route to "
                           "--rdzv-endpoint. A loopback address is refused")
    node.add_argument("--rdzv-timeout", type=int, default=LAUNCH_DEFAULTS["rdzv_timeout"],
                      metavar="SECONDS",
                      help="how long a node waits for the others to arrive, at the start and "
                           "after a restart: parallel.rdzv_timeout_minutes in seconds (default "
                           "600)")
    node.add_argument("--max-restarts", type=int, default=LAUNCH_DEFAULTS["max_restarts"],
                      metavar="N",
                      help="after a worker fails, restart every worker of the job up to N times; "
                           "they resume from the last checkpoint (needs checkpoint.dir and "
                           "checkpoint.resume=auto; default 0)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.train_iters=100 parallel.tp=2")
    p.set_defaults(func=cmd_train)
