"""The processes training and serving run in: the torchrun/SLURM environment, the address a node
advertises, and the local launcher (torch's elastic launcher, the machinery behind torchrun:
--nproc, restarts, multi-node). The device and dtype names are bloomtrain.devices'.

Importing this module loads no torch.

The launcher knows nothing of training. `bloomtrain.train.launch` wraps it with the hang
watchdog's reports and its Ctrl-C stop (SigintStop); `bloomtrain serve --nproc N` uses it as it
is.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from bloomtrain.errors import UserError


def srun_task(env=os.environ) -> bool:
    """Whether this process is one of several tasks of an srun step. srun's tasks carry a step
    id; the batch script itself, which sbatch gives SLURM_PROCID and SLURM_NTASKS too, does
    not: a plain `bloomtrain train` there runs alone (or launches with --nproc), not as rank 0
    of SLURM_NTASKS ranks that never start."""
    return ("SLURM_STEP_ID" in env and "SLURM_PROCID" in env
            and int(env.get("SLURM_NTASKS", "1")) > 1)


def env_from_slurm(env=os.environ) -> None:
    """Under a plain `srun` (one task per GPU, no torchrun), translate SLURM's task variables into
    torchrun's. MASTER_ADDR/MASTER_PORT must come from the job script (see the README)."""
    if "RANK" in env or not srun_task(env):
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UserError(f"running under srun with {env['SLURM_NTASKS']} tasks but {missing} "
                        f"unset: export MASTER_ADDR (the first node's hostname) and MASTER_PORT "
                        f"in the job script, or launch through torchrun")
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    # This node's tasks, which torchrun gives as LOCAL_WORLD_SIZE: the node-local groups
    # (ZeRO's hpZ) and each node's host memory use it.
    per_node = slurm_tasks_on_node(env)
    if per_node is not None and "LOCAL_WORLD_SIZE" not in env:
        env["LOCAL_WORLD_SIZE"] = str(per_node)


def slurm_tasks_on_node(env=os.environ) -> int | None:
    """The tasks SLURM runs on this node (SLURM_NODEID): this node's entry of the step's (else
    the job's) SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("8", "8(x2)" for two nodes of
    8, "2,3" or "4(x2),1" when the nodes differ), else SLURM_NTASKS_PER_NODE, which with
    --ntasks is only a maximum (sbatch(1)); None when none says."""
    spread = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    if not spread:
        fixed = env.get("SLURM_NTASKS_PER_NODE", "")
        return int(fixed) if fixed.isdigit() else None
    counts = []
    for item in spread.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = env.get("SLURM_NODEID", "0")
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class LaunchSpec:
    """What a command hands the launcher: torchrun's node options, the same names."""
    nproc: int = 1  # workers on this node
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0; a free local port when one node
    rdzv_timeout: float = 600  # seconds; torch's own default join timeout
    max_restarts: int = 0
    # The address the other nodes reach this node at (torchrun's --local-addr); None: the
    # source address of this node's route to the rendezvous endpoint (node_address).
    local_addr: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def check(self) -> None:
        """Bad values as UserErrors that say what to change, before anything starts."""
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc}: give the number of workers on this node "
                            f"(1 or more)")
        if self.nnodes < 1:
            raise UserError(f"--nnodes {self.nnodes}: give the number of nodes (1 or more)")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} "
                            f"(--nnodes {self.nnodes}); number the nodes 0 to "
                            f"{self.nnodes - 1}, 0 on the host of --rdzv-endpoint")
        if self.rdzv_timeout < 1:
            raise UserError(f"--rdzv-timeout {self.rdzv_timeout:g}: give the seconds a node "
                            f"waits for the others (1 or more)")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts}: give 0 (no restarts) or more")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UserError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the "
                            f"address of node 0 (--node-rank 0) and a free port there, the same "
                            f"on every node")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: give HOST:PORT, e.g. "
                                f"node0.cluster:29500")
        if self.local_addr is not None and self.nnodes == 1:
            raise UserError(f"--local-addr {self.local_addr} is the address the other nodes "
                            f"reach this one at; it needs --nnodes > 1")


@dataclass(frozen=True)
class NodeAddress:
    """What a node of a multi-node job tells the others: `addr` (torch's agent hands rank 0's
    node's to every worker as MASTER_ADDR), and `interface`, the one holding it (None: not
    found), which the workers' gloo binds to (GLOO_SOCKET_IFNAME)."""
    addr: str
    interface: str | None


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _resolve(host: str, what: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"{what}: cannot resolve {host!r} on this node ({e.strerror}); give an "
                        f"address, or a name this node's resolver knows") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def _route_source(addr: str, port: int) -> str | None:
    """The source address of this node's route to `addr` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """Every address of this host's interfaces -> the interface's name (Linux: IPv4 from the
    SIOCGIFCONF ioctl, IPv6 from /proc/net/if_inet6; elsewhere empty)."""
    out: dict[str, str] = {}
    try:
        import array
        import fcntl
        import struct

        ifreq = 40 if struct.calcsize("P") == 8 else 32  # char[16] + the union, padded
        buf = array.array("B", bytes(256 * ifreq))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8912,  # SIOCGIFCONF
                                 struct.pack("iP", len(buf), buf.buffer_info()[0]))
        used = struct.unpack("iP", packed)[0]
        raw = buf.tobytes()
        for at in range(0, used, ifreq):
            name = raw[at:at + 16].split(b"\0", 1)[0].decode(errors="replace").split(":")[0]
            out[socket.inet_ntoa(raw[at + 20:at + 24])] = name  # sockaddr_in's sin_addr
    except (ImportError, OSError):
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, *_, name = line.split()
                out[socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexaddr))] = name
    except OSError:
        pass
    return out


def node_address(spec: LaunchSpec) -> NodeAddress | None:
    """The address this node advertises in a multi-node job (None for one node): --local-addr,
    else the source address of its route to the rendezvous endpoint, which is the interface
    the other nodes reach it through on a multi-homed host. torch's agent would advertise the
    hostname's address instead, which is loopback on many hosts (Ubuntu's hosts file maps the
    hostname to 127.0.1.1): node 0 handed that to every worker as MASTER_ADDR, and the job
    never formed. A loopback address is refused here, at once, unless the endpoint itself is
    a loopback address (every node on this one machine)."""
    if spec.nnodes == 1 or spec.rdzv_endpoint is None:
        return None
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    host = _strip_brackets(host)
    one_machine = host == "localhost" or _is_loopback(host)
    if spec.local_addr is not None:
        addrs = _resolve(_strip_brackets(spec.local_addr), f"--local-addr {spec.local_addr}")
        addr = addrs[0]
        if _is_loopback(addr) and not one_machine:
            raise UserError(f"--local-addr {spec.local_addr} is a loopback address, which the "
                            f"other nodes cannot reach; give this node's address on the "
                            f"network they share")
        interfaces = interface_addresses()
        if interfaces and addr not in interfaces:
            raise UserError(f"--local-addr {spec.local_addr} is not an address of this node "
                            f"(its interfaces hold {', '.join(sorted(interfaces))}); give one "
                            f"of these, the one the other nodes reach")
        return NodeAddress(addr, interfaces.get(addr))
    targets = _resolve(host, f"--rdzv-endpoint {spec.rdzv_endpoint}")
    addr = next((a for a in map(lambda t: _route_source(t, int(port)), targets) if a), None)
    if addr is None:
        raise UserError(f"this node has no route to the rendezvous endpoint "
                        f"{spec.rdzv_endpoint} ({host} is {', '.join(targets)}); check its "
                        f"network, or give --local-addr ADDR, this node's address the others "
                        f"reach")
    if _is_loopback(addr) and not one_machine:
        raise UserError(f"this node would advertise {addr}, a loopback address the other nodes "
                        f"cannot reach: --rdzv-endpoint's host {host} resolves to "
                        f"{', '.join(targets)} here; give --local-addr ADDR, this node's "
                        f"address on the network the nodes share")
    return NodeAddress(addr, interface_addresses().get(addr))


# The rendezvous is torch's c10d one (what `torchrun --rdzv-backend c10d` uses), registered
# under a name of our own only so that the launcher can see its store: each node leaves a key
# there on arrival, and a rendezvous that times out can say which nodes never came.
_RDZV_BACKEND = "bloomtrain-c10d"
# Module state (allow-listed in tests/structure.py): torch's registry calls our handler factory
# with its own arguments only, so the store it creates is kept here for the launcher.
_ARRIVALS: dict = {}


def _arrival_key(run_id: str, node_rank: int) -> str:
    return f"bloomtrain/{run_id}/arrived/{node_rank}"


def _c10d_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (RendezvousBackend,
                                                                         create_handler)

    class Named(RendezvousBackend):
        """The c10d backend under our name (the registry checks a handler's name)."""
        name = _RDZV_BACKEND

        def get_state(self):
            return backend.get_state()

        def set_state(self, state, token=None):
            return backend.set_state(state, token)

    backend, store = create_backend(params)
    node_rank = params.get_as_int("node_rank")
    store.set(_arrival_key(params.run_id, node_rank), socket.gethostname())
    _ARRIVALS.update(store=store, run_id=params.run_id)
    handler = create_handler(store, Named(), params)
    # While the workers run, torch's agent asks the store every monitor interval whether a
    # node waits to join; with the link to node 0 cut, that call (and the shutdown's) blocks
    # for the store's whole timeout, the rendezvous timeout: the agent would leave workers
    # that its watchdog ended unseen until the link came back. Asked in a thread instead, the
    # agent keeps watching its workers; what needs the store (a restart's rendezvous) still
    # waits for it, up to the rendezvous timeout.
    handler.num_nodes_waiting = _Unblocked(handler.num_nodes_waiting)
    handler.shutdown = functools.partial(_bounded, handler.shutdown, False, SHUTDOWN_WAIT_S)
    return handler


# How long a failed node's launcher tries to close the rendezvous in node 0's store before it
# leaves without (the store unreachable: it exits all the same).
SHUTDOWN_WAIT_S = 5.0


def _bounded(fn, default, seconds: float):
    """fn() in a daemon thread, waited on `seconds` at most (then `default`); its error
    re-raised."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
    thread = threading.Thread(target=call, name="bloomtrain-rdzv", daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in box:
        raise box["error"]
    return box.get("value", default)


class _Unblocked:
    """The handler's num_nodes_waiting, asked in a daemon thread and waited on for a moment:
    while the store does not answer, the last answer stands (0 before any), and the next call
    waits on the same question. Its error is raised as the call's."""

    WAIT_S = 1.0

    def __init__(self, fn):
        self.fn, self.last = fn, 0
        self.thread: threading.Thread | None = None
        self.box: dict = {}

    def _ask(self) -> None:
        self.box = box = {}

        def call():
            try:
                box["value"] = self.fn()
            except BaseException as e:  # noqa: BLE001 - raised by __call__
                box["error"] = e
        self.thread = threading.Thread(target=call, name="bloomtrain-rdzv-probe", daemon=True)
        self.thread.start()

    def __call__(self) -> int:
        if self.thread is None:
            self._ask()
        self.thread.join(self.WAIT_S)
        if self.thread.is_alive():  # no answer yet: the store is out of reach
            return self.last
        box, self.thread = self.box, None
        if "error" in box:
            raise box["error"]
        self.last = box["value"]
        return self.last


def _arrived(nnodes: int) -> list[int] | None:
    """The node ranks that reached the rendezvous store (None: the store cannot say)."""
    store = _ARRIVALS.get("store")
    if store is None:
        return None
    try:
        return [r for r in range(nnodes)
                if store.check([_arrival_key(_ARRIVALS["run_id"], r)])]
    except Exception:  # noqa: BLE001 - the host went away: the count is only for the message
        return None


# A worker that ends itself this way has said why: the hang watchdog's exit
# (bloomtrain.train.watchdog), with its report; as timeout(1), for running past its limit.
HANG_EXIT_CODE = 124


class _AgentNoise(logging.Filter):
    """torch's elastic agent and its process starter log a warning per worker they signal
    ("W... Closing process 4242 via signal SIGTERM"), after a worker failed or when the
    launcher itself got a signal: lines that read like a second problem. They are left out and
    counted; the launcher's last line says what happened."""

    MESSAGES = ("Received %s death signal, shutting down workers",
                "Closing process %s via signal %s", "Sending process %s closing signal %s",
                "Terminating process %s via signal SIGTERM")
    # After a signal to the launcher torch waits 30 s for the workers, then kills them: a
    # worker that has finished its last step and saved waits for the agent there.
    FORCED = ("Unable to shutdown process %s via %s, forcefully exiting via %s",
              "Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL")
    LOGGERS = ("torch.distributed.elastic.agent.server.api",
               "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    # A worker that raised: torch logs its whole traceback (about 30 lines) before the
    # launcher's own last line. For a UserError (a config the worker refused, a run lock held
    # by another run) that line says it all, as it does without a launcher.
    WORKER_FAILED = ("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s "
                     "(start_method: %s)")

    def __init__(self):
        super().__init__()
        self.forced = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.forced += record.msg in self.FORCED
        if record.msg == self.WORKER_FAILED and record.exc_info and \
                f"{UserError.__module__}.{UserError.__name__}:" in str(record.exc_info[1]):
            return False
        # Nor for a worker its hang watchdog ended: the reports and the launcher's summary
        # follow (torch logged "process 0 terminated with exit code 124" once per rank).
        if record.msg == self.WORKER_FAILED and record.args and \
                record.args[0] == HANG_EXIT_CODE:
            return False
        return record.msg not in self.MESSAGES + self.FORCED

    @contextlib.contextmanager
    def installed(self):
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addFilter(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeFilter(self)


# Set in the environment of workers whose launcher takes Ctrl-C itself (SigintStop): a file
# that the launcher creates at the first SIGINT and the workers look for at their next safe point.
STOP_FILE_ENV = "BLOOMTRAIN_STOP_FILE"
# Alike for the scheduler's stop signals (SIGTERM, SIGUSR1) sent to the launcher: a file holding
# the signal's number, which the workers take as if the signal had reached them.
SIGNAL_FILE_ENV = "BLOOMTRAIN_SIGNAL_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# When the job started (time.time()), set by the launcher for its workers: a restarted worker's
# train.exit_duration_minutes still counts from the job's start, as the scheduler's limit does.
JOB_START_ENV = "BLOOMTRAIN_JOB_START"


@dataclass
class SigintStop:
    """Ctrl-C for workers that stop cleanly at a point of their own (training: the end of its
    step, after a save). torch's agent would pass SIGINT on and SIGKILL the workers 30 s later,
    whatever they were doing; instead the launcher takes SIGINT itself. The first creates the
    file STOP_FILE_ENV names in the workers' environment, and the launcher waits for the workers
    to end as they do, then returns `outcome` of their return values for the caller's last line
    (exit code 130 is the caller's to give); a second SIGKILLs them at once, says so with
    `outcome(None)` and exits 130. Ctrl-C in a terminal reaches the whole foreground process
    group, `kill -INT` the launcher alone: the workers leave SIGINT to the launcher, whose count
    is the one that counts either way."""

    hint: str  # what the first SIGINT starts, in words
    # What the stop left, for the last line: from the workers' return values, or None when they
    # did not end on their own (SIGKILLed, or failed).
    outcome: Callable[[dict | None], str]


class _QuitNow(BaseException):
    """A second SIGINT, raised out of torch's agent wherever it is (a BaseException: the agent
    catches Exception in places)."""


class _SignalTaker:
    """The launcher's handling of SIGINT, SIGTERM and SIGUSR1 while the workers run
    (SigintStop); with `stop` None, none: they are torch's agent's (SIGUSR1's default action
    ends the launcher). torch's agent, left SIGTERM, would pass it on and SIGKILL the workers
    30 s later, mid-save for a large model; SIGUSR1 (`scancel --signal=USR1`) killed the
    launcher and left its workers orphaned. Taken here, both ask the workers to finish their
    step, save and exit 0, through a file, and the launcher waits for them; a second SIGTERM
    ends them at once, as a second Ctrl-C does."""

    def __init__(self, stop: SigintStop | None, stack: contextlib.ExitStack):
        self.stop, self.count, self.stop_file, self.signal_file = stop, 0, None, None
        self.terms = 0
        self.signals: tuple[int, ...] = ()
        self.unstarted: int | None = None  # the signal that came while no worker ran
        if stop is not None:
            import tempfile
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bloomtrain-stop-"))
            self.stop_file = os.path.join(folder, "SIGINT")
            self.signal_file = os.path.join(folder, "SIGNAL")

    def worker_env(self, lc) -> dict[str, str]:
        """The stop files' variables; and torch's agent, configured by `lc`, told to leave
        SIGINT and SIGTERM alone (LaunchConfig.signals_to_handle; a torch older than that
        field takes them as it always did: launch_local's SignalException path)."""
        if self.stop is None:
            return {}
        handled = getattr(lc, "signals_to_handle", None)
        self.signals = (signal.SIGUSR1,)
        if handled is not None:
            self.signals = (signal.SIGINT, *STOP_SIGNALS)
            lc.signals_to_handle = ",".join(
                s for s in handled.split(",") if s.strip() not in ("SIGINT", "SIGTERM")) \
                or "SIGHUP"
        return {STOP_FILE_ENV: self.stop_file, SIGNAL_FILE_ENV: self.signal_file}

    def __call__(self, signum, _frame) -> None:
        if not _workers_running():
            # No worker runs (the rendezvous waits for other nodes, or a restart's does): there
            # is no step to finish and nothing to save, and the stop file would be read by no
            # one until the rendezvous timed out, or by workers that then trained a step.
            self.unstarted = signum
            self._quit()
        if signum != signal.SIGINT:
            return self._stop_signal(signum)
        self.count += 1
        if self.count == 1:
            with open(self.stop_file, "w"):
                pass
            say_in_handler(f"bloomtrain: SIGINT: {self.stop.hint}; Ctrl-C again quits at "
                           f"once without saving")
            return
        self._quit()

    def _stop_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        first = not os.path.exists(self.signal_file)
        if first:
            with open(self.signal_file + ".tmp", "w") as f:  # renamed: never read half-written
                f.write(str(int(signum)))
            os.replace(self.signal_file + ".tmp", self.signal_file)
            say_in_handler(f"bloomtrain: {name}: the workers finish their step, save a "
                           f"checkpoint and exit; SIGTERM again ends them at once without "
                           f"saving")
        if signum == signal.SIGTERM:
            self.terms += 1
            if self.terms > 1:
                self._quit()

    def _quit(self) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)  # the exit is under way
        _kill_children()
        raise _QuitNow

    @contextlib.contextmanager
    def installed(self):
        previous = {}
        for sig in self.signals:
            with contextlib.suppress(ValueError):  # off the main thread torch's agent cannot
                previous[sig] = signal.signal(sig, self)  # take them either
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, signal.SIG_DFL if old is None else old)

    def outcome(self, results: dict | None) -> str | None:
        return self.stop.outcome(results) if self.stop is not None else None

    def quit_now(self, nproc: int) -> None:
        """After the second SIGINT or SIGTERM, or a stop signal while no worker ran."""
        _kill_children()  # any the agent started after the handler's SIGKILL
        if self.unstarted is not None:
            name, code = signal.Signals(self.unstarted).name, 128 + self.unstarted
            print(f"bloomtrain: {name} while no worker of this node ran (waiting for the other "
                  f"nodes to join): nothing trained, nothing to save; exit code {code}",
                  file=sys.stderr, flush=True)
            raise SystemExit(code) from None
        again = "SIGTERM" if self.terms > 1 else "SIGINT"
        text = (f"{again} again: this node's {nproc} worker(s) ended at once (SIGKILL), "
                f"without saving; {self.outcome(None)}")
        if again == "SIGINT":
            _sigint_exit(text)
        print(f"bloomtrain: {text}; exit code {128 + signal.SIGTERM}", file=sys.stderr,
              flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None

    def after(self, results: dict | None, failure: str | None = None) -> str | None:
        """After the agent returned the workers' `results`: what the SIGINT, if there was one,
        left. After a worker's `failure`: the SIGINT's exit, if there was one."""
        if self.count and failure:
            _sigint_exit(f"SIGINT: then {failure}; {self.outcome(None)}")
        return self.outcome(results) if self.count else None


def _workers_running() -> bool:
    """Whether this process has workers (torch's agent starts them as multiprocessing
    children)."""
    import multiprocessing

    return bool(multiprocessing.active_children())


def _kill_children() -> None:
    """SIGKILL this process's workers (torch's agent starts them as multiprocessing children)
    and reap them."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
    for child in children:
        child.join()


def end_by_signal(sig: int) -> None:
    """End this process as `sig` would have, had nothing caught it: stdio flushed, the default
    action restored, the signal raised (its exit status is then the signal's, as the process
    that sent it expects)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action does not end the process


def say_in_handler(line: str) -> None:
    """A line on stderr from a signal handler: os.write, since the interrupted code may be
    inside a write to the same stream (a buffered stream refuses a reentrant call); on a
    terminal, on a line of its own (^C or a progress line may be on the current one)."""
    start = "\n" if sys.stderr is not None and sys.stderr.isatty() else ""
    with contextlib.suppress(OSError):
        os.write(2, f"{start}{line}\n".encode())


def _sigint_exit(text: str) -> None:
    print(f"bloomtrain: {text}; exit code {128 + signal.SIGINT}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.SIGINT) from None


def launch_local(nproc: int, entry, *args, spec: LaunchSpec | None = None,
                 worker_env: dict[str, str] | None = None,
                 explain: Callable[[int, object], str] | None = None,
                 signalled: Callable[[str], None] | None = None,
                 sigint: SigintStop | None = None) -> str | None:
    """Start this node's workers running `entry(*args)` (a module-level function) with torch's
    elastic launcher (what torchrun uses). One node: `nproc` workers on a free localhost port.
    Several nodes (`spec`): every node runs this with the same --nnodes and --rdzv-endpoint and
    its own --node-rank; node 0 hosts the c10d rendezvous store at the endpoint. With
    `max_restarts`, the launcher restarts every worker of the job after one fails (each node
    its own), up to that many times. `worker_env`: variables the workers inherit, for this
    launch only. A failed job raises UserError with `explain(rank, failure)` of the worker
    that failed first (default: `failure_text`). A SIGTERM/SIGINT to the launcher, passed on
    to the workers, ends it with exit code 128+signal; with `signalled` (for a program whose
    normal end is a signal, such as a server that drains) `signalled(name)` is called and
    launch_local returns. With `sigint`, Ctrl-C is the launcher's own (SigintStop)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import (RendezvousConnectionError,
                                                      RendezvousTimeoutError)
    from torch.distributed.launcher.api import elastic_launch

    spec = spec or LaunchSpec(nproc=nproc)
    spec.check()
    lc, endpoint, node_env = _launch_config(spec, worker_env or {})
    # By default the workers' store is one the agent keeps across restarts, and a restarted
    # group reads the previous attempt's addresses from it (gloo: "connectFullMesh failed ...
    # Connection refused"; pytorch/pytorch#135712). Unshared, rank 0 serves a fresh store each
    # attempt; without restarts the shared one stays, as it outlives an early-exiting rank 0.
    unshare = "1" if spec.max_restarts else os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    env = {**(worker_env or {}), **node_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": unshare}
    with contextlib.ExitStack() as stack:
        taker = _SignalTaker(sigint, stack)
        env.update(taker.worker_env(lc))
        for key, value in env.items():
            stack.enter_context(environ(key, value))
        noise = stack.enter_context(_AgentNoise().installed())
        try:
            with taker.installed():
                results = elastic_launch(lc, entry)(*args)
        except _QuitNow:
            taker.quit_now(spec.nproc)
        except SignalException as e:
            # torch's agent passed it on and ended the workers: one line, not a traceback.
            if signalled is not None:
                signalled(signal.Signals(e.sigval).name)
                return
            _signalled_exit(e.sigval, spec.nproc, noise.forced, taker.outcome(None))
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            text = (explain or failure_text)(rank, failure)
            taker.after(None, failure=text)
            raise UserError(text) from None
        except RendezvousTimeoutError:
            raise UserError(_timeout_text(spec, endpoint)) from None
        except RendezvousConnectionError as e:
            raise UserError(_connection_text(spec, endpoint, e)) from None
        finally:
            _ARRIVALS.clear()  # node 0's store server goes with its last reference
    return taker.after(results)


def thread_env(nproc: int, env=os.environ) -> dict[str, str]:
    """Each worker's share of this node's CPU cores as OMP_NUM_THREADS, which torch reads for its
    intra-op threads, unless the user set it. Otherwise every worker would take all the cores
    (torch's default), and N workers on C cores run N*C spinning threads: the oversubscription
    torchrun avoids by giving each of several workers one thread. A share, not one, because
    the CPU does real work here (ZeRO-Offload's optimizer step, CPU training). Said in one
    line when it is set."""
    if nproc < 2 or env.get("OMP_NUM_THREADS"):
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // nproc)
    print(f"bloomtrain: {nproc} workers on {cores} CPU core(s): OMP_NUM_THREADS={threads} each "
          f"(set OMP_NUM_THREADS to choose)", file=sys.stderr, flush=True)
    return {"OMP_NUM_THREADS": str(threads)}


def _address_env(spec: LaunchSpec, address: NodeAddress | None, endpoint: str) -> dict:
    """The workers' gloo interface for a node of several, said in one line. gloo binds to the
    address the hostname resolves to, loopback on many hosts (node_address): the workers' gloo
    goes through the interface this node advertises, unless the user chose one."""
    if address is None:
        return {}
    env = {}
    if address.interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = address.interface
    how = "--local-addr" if spec.local_addr else f"the route to {endpoint}"
    gloo = os.environ.get("GLOO_SOCKET_IFNAME") or address.interface or "its default"
    print(f"[launch] node {spec.node_rank} of {spec.nnodes} advertises {address.addr} ({how}; "
          f"gloo on {gloo})", file=sys.stderr, flush=True)
    return env


def _launch_config(spec: LaunchSpec, worker_env: dict[str, str]):
    """torch's LaunchConfig for `spec`, the rendezvous endpoint (a free localhost port for one
    node) and the workers' variables: the address this node advertises (node_address) and their
    threads (thread_env; none where the caller's `worker_env` sets them), and when the job
    started (JOB_START_ENV: train.exit_duration_minutes counts from it across restarts)."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig

    address = node_address(spec)

    if spec.rdzv_endpoint is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        run_id = f"bloomtrain-{os.getpid()}"
    else:
        # The same on every node; the store lives and dies with node 0's launcher, so a fixed
        # id cannot meet a previous job's state.
        endpoint, run_id = spec.rdzv_endpoint, "bloomtrain"
    rendezvous_handler_registry.register(_RDZV_BACKEND, _c10d_handler)
    _ARRIVALS.clear()
    lc = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc, run_id=run_id,
        rdzv_backend=_RDZV_BACKEND, rdzv_endpoint=endpoint,
        # Node 0 hosts the store, whatever its name resolves to (torch would guess from the
        # hostname); the others wait up to the timeout for it to come up, as for the others
        # to join.
        rdzv_configs={"join_timeout": spec.rdzv_timeout, "read_timeout": spec.rdzv_timeout,
                      "is_host": spec.node_rank == 0, "node_rank": spec.node_rank},
        max_restarts=spec.max_restarts, monitor_interval=0.2, start_method="spawn",
        local_addr=address.addr if address is not None else None)
    return lc, endpoint, {**_address_env(spec, address, endpoint),
                          **thread_env(spec.nproc, {**os.environ, **worker_env}),
                          JOB_START_ENV: os.environ.get(JOB_START_ENV) or repr(time.time())}


def _signalled_exit(sigval: int, nproc: int, forced: int, after: str | None) -> None:
    """A launcher ended by a signal: one line saying what torch's agent did and, with `after`,
    what the workers left (the caller looks: a worker may or may not have finished what it did
    on the signal before the agent ended it), then exit code 128+signal."""
    forced_text = f" ({forced} still running 30 s later, with SIGKILL)" if forced else ""
    after_text = f"; {after}" if after else ""
    print(f"bloomtrain: {signal.Signals(sigval).name}: torch's elastic agent passed it to this "
          f"node's {nproc} worker(s) and ended them{forced_text}{after_text}; exit code "
          f"{128 + sigval}", file=sys.stderr, flush=True)
    raise SystemExit(128 + sigval) from None


def _connection_text(spec: LaunchSpec, endpoint: str, e: BaseException) -> str:
    cause = error_text(e.__cause__ if e.__cause__ is not None else e).rstrip(".")
    where = ("host the rendezvous store (node 0 does) at" if spec.node_rank == 0 else
             "reach the rendezvous store of node 0 at")
    return (f"node {spec.node_rank} could not {where} {endpoint} within "
            f"{spec.rdzv_timeout:g} s ({cause}). Check that node 0 runs `bloomtrain train` "
            f"with --node-rank 0 on the host {endpoint.rpartition(':')[0]}, that the port is "
            f"free there and reachable from this node (firewall), and that every node "
            f"gives the same --rdzv-endpoint; raise --rdzv-timeout if nodes start far "
            f"apart")


def error_text(error: BaseException) -> str:
    """The first line of a backend error, without gloo's "[source.cc:78] " prefix."""
    import re

    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return (text or type(error).__name__)[:300]


def failure_text(rank: int, failure) -> str:
    """The launcher's last line about the worker that failed first: a lost rank by its exit
    signal, an error by its message."""
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    code = failure.exitcode
    if code < 0:
        return f"{who} was killed by {failure.signal_name()} (signal {-code})"
    # Without an error file torch's message is only a pointer to its docs.
    message = failure.message if os.path.isfile(failure.error_file) else ""
    if isinstance(message, dict):  # the error file's record: {"message": ..., "extraInfo"}
        message = message.get("message", "")
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    return f"{who} exited with code {code}" + (f": {lines[0]}" if lines else "")


def _timeout_text(spec: LaunchSpec, endpoint: str) -> str:
    arrived = _arrived(spec.nnodes)
    if arrived is None:
        count, missing = f"only this node (node {spec.node_rank}) is known to have arrived", ""
    else:
        absent = [r for r in range(spec.nnodes) if r not in arrived]
        count = f"{len(arrived)} of {spec.nnodes} nodes arrived"
        missing = f"; node(s) {absent} never did" if absent else ""
    return (f"the rendezvous at {endpoint} timed out after {spec.rdzv_timeout:g} s: {count}"
            f"{missing}. Start `bloomtrain train` on every node with --nnodes {spec.nnodes}, "
            f"--rdzv-endpoint {endpoint} and its own --node-rank (0 to {spec.nnodes - 1}); check "
            f"that each node can reach {endpoint} (hostname, firewall) and runs the same "
            f"--nproc, and raise --rdzv-timeout if nodes start far apart")


@contextlib.contextmanager
def environ(key: str, value: str | None):
    """`key=value` in the environment the workers inherit, for the block only (None: as is)."""
    saved = os.environ.get(key)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
