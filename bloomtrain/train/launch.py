"""Starting a training job: the device, the process group and the local launcher, from
bloomtrain.launch (shared with serve), plus what only training adds: the hang
watchdog's reports. When a job launched here fails it prints what the watchdog of each rank
reported (bloomtrain.train.watchdog), if any did: who waited in what, on whom; and its last line
names the rank that failed first and how: the signal that killed it, the watchdog's exit code,
or its error. A rendezvous that times out says which nodes never arrived.
"""
from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from bloomtrain import devices
from bloomtrain import launch as launcher
from bloomtrain.parallel import comm
from bloomtrain.config import Config
from bloomtrain.devices import process_group_backend
from bloomtrain.errors import UserError
from bloomtrain.launch import env_from_slurm, LaunchSpec, world_size_from_env
from bloomtrain.train import watchdog
from bloomtrain.train.control import stopped_text

__all__ = ["LaunchSpec", "env_from_slurm", "failure_text", "init_distributed", "launch_local",
           "process_group_backend", "resolve_device", "world_size_from_env"]


def resolve_device(cfg: Config) -> torch.device:
    return devices.resolve_device(cfg.train.device)


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the job. resolve_device has already called torch.cuda.set_device, so every NCCL
    communicator is created on this rank's own GPU; `device_id` binds the group to it (eager
    NCCL init, and barriers and object collectives know the device instead of guessing it from
    the rank)."""
    # The backend against the device first: one process builds no group, and would otherwise
    # run under a parallel.backend its layout can never use (nccl on a CPU).
    backend = process_group_backend(cfg.parallel.backend, device)
    if world_size_from_env() == 1 or dist.is_initialized():
        return
    kw = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(backend, timeout=timedelta(minutes=cfg.parallel.timeout_minutes),
                                **kw)
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        # A rank that never came (not started, crashed, another WORLD_SIZE or address): torch's
        # traceback after the whole timeout said it in its last line only.
        env = os.environ
        raise UserError(
            f"rank {env.get('RANK')} of {env.get('WORLD_SIZE')} could not join the job at "
            f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} within "
            f"parallel.timeout_minutes ({cfg.parallel.timeout_minutes:g}): "
            f"{str(e).strip().splitlines()[0]}; every rank must start, with the same "
            f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT") from None
    same_config_everywhere(cfg)


def same_config_everywhere(cfg: Config) -> None:
    """Refuse a job whose ranks were given different configs (a per-rank override, an edited
    file between node starts): they would issue different collectives and wait on each other
    until the timeout, then fail with torch's tracebacks. One gather of every rank's config."""
    mine = cfg.to_dict()
    every = comm.all_gather_object(mine, comm.world_group(), "config")
    differ = [r for r, theirs in enumerate(every) if theirs != every[0]]
    if differ:
        keys = sorted(f"{section}.{k}" for section, values in mine.items()
                      if isinstance(values, dict)
                      for k in values if values[k] != (every[0].get(section) or {}).get(k))
        keys += [k for k, v in mine.items() if not isinstance(v, dict) and v != every[0].get(k)]
        raise UserError(f"the job's ranks were given different configs: rank(s) {differ} "
                        f"differ from rank 0" + (f" (this rank in {', '.join(keys)})" if keys
                                                 else "") +
                        "; start every rank with the same config and overrides")


def launch_local(nproc: int, entry, *args, spec: LaunchSpec | None = None,
                 checkpoint_dir: str | None = None) -> str | None:
    """bloomtrain.launch.launch_local, with each worker's hang watchdog leaving its report's path in a
    folder read back when the job fails; the workers resume from the last checkpoint after a
    restart when checkpoint.resume=auto. Ctrl-C makes the workers finish their step and save
    (a second quits at once, naming what is in `checkpoint_dir`): then the step and checkpoint
    they stopped at are returned, for control.exit_after_sigint (`entry` returns
    control.summary of its run)."""
    spec = spec or LaunchSpec(nproc=nproc)
    sigint = launcher.SigintStop(
        hint="the workers stop at the end of this step and save a checkpoint",
        outcome=lambda results: stopped_text(_run_summary(results), checkpoint_dir))
    with tempfile.TemporaryDirectory(prefix="bloomtrain-hang-") as reports:
        def explain(rank, failure) -> str:
            lost = failure.exitcode < 0  # killed by a signal: not a hang, a rank gone
            found = watchdog.read_pointers(reports)
            lines = watchdog.summarize(found, spec.world_size, spec.nnodes)
            # A rank that raised, whose peers' ops then failed (a closed connection), not
            # timed out: its error is the story, not a hang.
            raised = failure.exitcode != watchdog.HANG_EXIT_CODE and all(
                r.get("state") == "failed" for r in found.values())
            if lines and (lost or raised):  # what the others were doing when the rank went
                lines[0] = (f"bloomtrain: rank {rank} {'was lost' if lost else 'failed'}; "
                            f"{len(found)} rank(s) of this node reported the op they were in:")
            if lines:
                print("\n".join(lines), file=sys.stderr, flush=True)
            restarts = f" (after {spec.max_restarts} restart(s))" if spec.max_restarts else ""
            hung = ("; the job hung (see the reports above)" if lines and not (lost or raised)
                    else "")
            return f"{failure_text(rank, failure)}{restarts}{hung}"

        return launcher.launch_local(nproc, entry, *args, spec=spec,
                                    worker_env={watchdog.REPORTS_ENV: reports},
                                    explain=explain, sigint=sigint)


def _run_summary(results: dict | None) -> dict | None:
    """A worker's summary of the run from the launcher's results (every rank's is the same);
    None without one."""
    return next((r for r in (results or {}).values() if isinstance(r, dict)), None)


def failure_text(rank: int, failure) -> str:
    """bloomtrain.launch.failure_text, and a rank ended by its hang watchdog named as such."""
    if failure.exitcode == watchdog.HANG_EXIT_CODE:
        return (f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) was ended by "
                f"its hang watchdog (exit code {failure.exitcode})")
    return launcher.failure_text(rank, failure)
