"""Nodes in network namespaces, for the multi-node and partition tests: each "node" is a network
namespace with its own address on a veth pair to a bridge, its own hostname (a UTS namespace) and
its own hosts file (`ip netns exec` binds /etc/netns/NS/hosts over /etc/hosts). Like a fresh
Ubuntu host, each node's hosts file maps its own hostname to 127.0.1.1, and with no DNS the other
nodes' names resolve nowhere: a node is reached by its address. The bridge lives in a namespace
of its own (the "switch"), so nothing of the machine's own network changes.

A cut is the node's switch port set down (`ip link set DEV down`), as a pulled cable or a
rebooting switch: the processes stay alive, their TCP connections stay open, and packets are
dropped until `heal` sets it up again. `flap` does that several times. `Cut` starts a cut in a
thread when a job's output reaches a line (the Nth training step, a save under way).

Everything is named after this process's pid (`bt<pid>x<k>...`), so tests running at the same
time do not meet, and a run killed before its cleanup is swept by the next one (its pid gone).
`Network.close` (also from atexit) kills what runs in the namespaces and deletes them.

Needs root and iproute2 (`ip netns`, veth, bridge); `unavailable()` says why not, for a skip,
which CI refuses (tests/conftest.py: it is not on CI_ALLOWED_SKIPS).
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.chaos import Job

SUBNET = "10.213.0"  # inside the namespaces only: no route of the machine's own changes
ETC_NETNS = Path("/etc/netns")
_COUNTER = itertools.count()
_NAME = re.compile(r"^bt(\d+)x\d+")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (package {package})"
    probe = f"bt{os.getpid()}x{next(_COUNTER)}probe"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add fails here: {made.stderr.strip()}"
        veth = ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb",
                  check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "name", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges cannot be made here: {bridge.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (a job's own session is killed first by its
    Job; this is whatever is left)."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _delete(ns: str) -> None:
    _kill_inside(ns)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def sweep_stale() -> None:
    """Delete the namespaces of test runs that ended without their cleanup (killed)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _delete(name)


class Node:
    def __init__(self, net: "Network", index: int):
        self.net, self.index = net, index
        self.ns = f"{net.tag}n{index}"
        self.port = f"p{index}"  # its port on the switch (in the switch's namespace)
        self.addr = f"{SUBNET}.{10 + index}"
        self.hostname = f"node{index}"

    def run(self, args: list[str], env: dict | None = None) -> Job:
        """`bloomtrain ARGS` on this node: in its namespace, under its hostname."""
        prefix = ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                  'hostname "$0" && exec "$@"', self.hostname]
        return Job(args, env=env, prefix=prefix)

    def cut(self) -> None:
        ip("-n", self.net.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        ip("-n", self.net.switch, "link", "set", self.port, "up")

    def flap(self, times: int, down_s: float, up_s: float) -> None:
        """Down and up `times` times; up at the end."""
        for _ in range(times):
            self.cut()
            time.sleep(down_s)
            self.heal()
            time.sleep(up_s)


class Network:
    """`n` nodes on one switch. A context manager: the namespaces go at its end, whatever
    happened (and at exit, should the process end first)."""

    def __init__(self, n: int):
        sweep_stale()
        self.tag = f"bt{os.getpid()}x{next(_COUNTER)}"
        assert len(self.tag) + 2 <= 15, self.tag  # an interface-name-sized namespace name
        self.switch = f"{self.tag}s"
        self.nodes = [Node(self, i) for i in range(n)]
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            ip("netns", "add", node.ns)
            ip("link", "add", "name", "eth0", "netns", node.ns, "type", "veth", "peer", "name",
               node.port, "netns", self.switch)
            ip("-n", self.switch, "link", "set", node.port, "master", "br0")
            ip("-n", self.switch, "link", "set", node.port, "up")
            ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            ip("-n", node.ns, "link", "set", "eth0", "up")
            ip("-n", node.ns, "link", "set", "lo", "up")
            folder = ETC_NETNS / node.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {node.hostname}\n")

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            _delete(node.ns)
        _delete(self.switch)
        atexit.unregister(self.close)


# ---- what a test does to a running job ----------------------------------------------------------

STEP_LINE = re.compile(r"^step\s+(\d+)\s")


def steps_seen(job: Job) -> int:
    """The last training step the job has logged."""
    last = 0
    for _, line in list(job.lines):
        if m := STEP_LINE.match(line):
            last = int(m.group(1))
    return last


def wait_for(cond, jobs: list[Job], timeout: float, what: str) -> float:
    """Poll `cond()` until true; the time it became true. Fails when a job ended first or
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if any(job.proc.poll() is not None for job in jobs):
            raise AssertionError(f"a job ended before {what}:\n" +
                                 "\n\n".join(job.output()[-3000:] for job in jobs))
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n" +
                                 "\n\n".join(job.output()[-3000:] for job in jobs))
        time.sleep(0.01)
    return time.monotonic()


class Cut:
    """In a thread: when `start()` is true (polled), cut `node`'s link; heal it `seconds`
    later (None: leave it cut until `heal()`), or flap it (`flaps` times down `down_s`, up
    `up_s`) instead. `at` and `healed_at` are the monotonic times of the cut and the heal."""

    def __init__(self, node: Node, start, seconds: float | None = None, flaps: int = 0,
                 down_s: float = 0.0, up_s: float = 0.0, timeout: float = 600):
        self.node, self.start, self.seconds = node, start, seconds
        self.flaps, self.down_s, self.up_s, self.timeout = flaps, down_s, up_s, timeout
        self.at: float | None = None
        self.healed_at: float | None = None
        self.error: BaseException | None = None
        self._heal_now = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"cut-{node.ns}")
        self._thread.start()

    def _run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout
            while not self.start():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
            self.at = time.monotonic()
            if self.flaps:
                self.node.flap(self.flaps, self.down_s, self.up_s)
            else:
                self.node.cut()
                self._heal_now.wait(self.seconds)
                self.node.heal()
            self.healed_at = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - handed to the test by join()
            self.error = e

    def heal(self) -> None:
        self._heal_now.set()

    def join(self) -> "Cut":
        self._heal_now.set()
        self._thread.join(timeout=60)
        if self.error is not None:
            raise self.error
        return self


def after_step(jobs: list[Job], step: int):
    """A Cut's start: once training step `step` is logged (by whichever node holds the
    logging rank: the rendezvous numbers the nodes)."""
    return lambda: max(steps_seen(job) for job in jobs) >= step


def on_line(jobs: list[Job], text: str):
    """A Cut's start: once a job has printed a line holding `text` (tests/faults.py's save
    sleep announces the save it holds open; its step sleep, the step it holds)."""
    return lambda: any(job.first(text) is not None for job in jobs)


def kill_all(jobs: list[Job]) -> None:
    for job in jobs:
        job.kill()
