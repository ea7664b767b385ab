"""Chaos on a local cluster: faults injected into running jobs on a schedule, bounded in time, and undone.

    python -m coordinator.chaos run PLAN.yaml --out RESULT.json

runs a `LocalCluster` in a private network (below), each of the plan's jobs on it in turn with its own schedule of
faults, and writes what happened (each job's final state and accuracy, and every fault with its time) as JSON:

    agents: 8
    data_dir: /usr/share/datasets/fashion-mnist
    runs:
      - job: {name: gossip-baseline, nodes: 8, ...}       # a job spec, as `coordinator submit` takes
      - job: {name: gossip-cut, nodes: 8, ...}
        faults: ["partition 0,1,2,3/4,5,6,7 at 10 for 20", "stop 2 at 40 for 5", "kill 5 at 50 for 10"]

A fault starts `at` seconds after its job's schedule started (once every rank has taken a step) and lasts `for`
seconds:
- `kill A`: SIGKILL to agent A, as a crash; restarted when its time is up (same state dir, so the same node id);
- `stop A`: SIGSTOP to agent A (a hung or swapped-out process: its sockets stay open, nothing answers); SIGCONT after;
- `partition G1/G2/...`: the groups of agents (comma-separated indices) cannot reach each other; each still reaches
  the coordinator and its own group; healed after.

`Chaos` runs such a schedule in a thread against a cluster (also from a test or a benchmark, in this process), and
records what it did and when (`Chaos.record`). It signals only the processes its cluster started, through their
process objects (never a bare pid, which may have been reused), and on exit (`stop()`, or leaving its `with`) it
undoes what is still in force, whatever ended it: SIGCONT to stopped agents, the partition healed. A kill whose
restart is still due is left as it is: the cluster's own `stop()` ends everything.

The private network. A partition must tell which agent opened a TCP connection, and on one loopback it cannot: an
agent listening on 127.0.0.x still connects from 127.0.0.1 (the source of every route to a local address), so a
filter on addresses sees the same source for every client, and a proxy in front of an agent sees the same. Hence
each agent runs in a network namespace of its own (unshare(2), in the forked agent before it runs) with one address
(10.77.0.10 + its index), linked by a veth pair to the cluster's namespace, which holds the coordinator (10.77.0.1)
and routes between the agents.
A partition is a set of policy routing rules in that router, `ip rule add from A to B blackhole` for every ordered
pair of agents in different groups: their packets are dropped silently there, so established TCP connections stall
(they retransmit, and calls time out) rather than fail at once, as on a cut link, and take up again when the heal
deletes the rules. Rules are by address, so an agent restarted during a partition is still cut off. (Dropping
packets with tc needs the gact action or the prio and netem qdiscs, which small kernels such as the development
machine's lack, and which a user namespace cannot load; policy routing is in every kernel.) All of it happens in a
network namespace owned by a user namespace made for the run (`unshare --user --map-root-user --net`): root there
can change nothing outside it, and it all goes when the run ends. `run` re-executes itself there; `PrivateNetwork`
refuses to work anywhere else.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

import yaml

from coordinator.cluster import ClusterError, LocalCluster
from coordinator.zygote import ForkedProcess
from nodeagent._proto import coordinator_pb2 as pb

SUBNET = "10.77.0"
ROUTER = f"{SUBNET}.1"  # the cluster namespace's address: the coordinator's, and the agents' gateway
FIRST_AGENT_HOST = 10  # agent i is SUBNET.(FIRST_AGENT_HOST + i)
MAX_AGENTS = 240
LINK_TIMEOUT_S = 30.0  # for an agent's namespace to appear, and for the agent to see its link
CLONE_NEWNET = 0x40000000  # unshare(2): a network namespace of its own
IP_TIMEOUT_S = 10.0  # one `ip` command


class Kind(StrEnum):
    KILL = "kill"
    STOP = "stop"
    PARTITION = "partition"


@dataclass(frozen=True)
class Fault:
    """One fault: `kind` from `at_s` for `for_s` seconds, on agent `agent` (kill, stop) or between `groups`
    (partition), agents by their index in the cluster."""

    kind: Kind
    at_s: float
    for_s: float
    agent: int = -1
    groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and math.isfinite(self.for_s) and self.at_s >= 0 and self.for_s > 0):
            raise ValueError(f"{self}: at must be >= 0 and for > 0")
        if self.kind == Kind.PARTITION:
            members = [agent for group in self.groups for agent in group]
            if len(self.groups) < 2 or not all(self.groups) or len(set(members)) != len(members):
                raise ValueError(f"{self}: a partition needs two or more disjoint, non-empty groups")
            if min(members) < 0:
                raise ValueError(f"{self}: agents are numbered from 0")
        elif self.agent < 0:
            raise ValueError(f"{self}: which agent?")

    @property
    def agents(self) -> set[int]:
        return {agent for group in self.groups for agent in group} if self.kind == Kind.PARTITION else {self.agent}

    @property
    def end_s(self) -> float:
        return self.at_s + self.for_s

    def __str__(self) -> str:
        what = "/".join(",".join(map(str, g)) for g in self.groups) if self.kind == Kind.PARTITION else self.agent
        return f"{self.kind} {what} at {self.at_s:g} for {self.for_s:g}"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`kill A at T for D`, `stop A at T for D`, `partition 0,1/2,3 at T for D` (seconds)."""
        words = text.split()
        if len(words) != 6 or words[2] != "at" or words[4] != "for" or words[0] not in set(Kind):
            raise ValueError(f"{text!r}: expected 'KIND WHAT at SECONDS for SECONDS' with KIND one of "
                             f"{', '.join(Kind)}")
        kind, at_s, for_s = Kind(words[0]), float(words[3]), float(words[5])
        try:
            if kind == Kind.PARTITION:
                groups = tuple(tuple(int(a) for a in group.split(",")) for group in words[1].split("/"))
                return cls(kind, at_s, for_s, groups=groups)
            return cls(kind, at_s, for_s, agent=int(words[1]))
        except ValueError as error:
            raise ValueError(f"{text!r}: {error}") from None


def check_schedule(faults: Sequence[Fault], agents: int) -> None:
    """Raises ValueError for a fault on an agent the cluster does not have, two faults on one agent at once, or two
    partitions at once (one set of cuts is in force at a time)."""
    for fault in faults:
        if max(fault.agents) >= agents:
            raise ValueError(f"{fault}: the cluster has agents 0 to {agents - 1}")
    for i, first in enumerate(faults):
        for second in faults[i + 1:]:
            overlap = first.at_s < second.end_s and second.at_s < first.end_s
            both_partitions = first.kind == second.kind == Kind.PARTITION
            same_agent = Kind.PARTITION not in (first.kind, second.kind) and first.agent == second.agent
            if overlap and (both_partitions or same_agent):
                raise ValueError(f"{first} and {second} overlap")


@dataclass(frozen=True)
class Action:
    """Something the schedule did: `action` (kill, restart, stop, cont, partition, heal, or skipped) for `fault`,
    `at_s` seconds after the schedule started (Unix time `unix`)."""

    at_s: float
    unix: float
    action: str
    fault: str
    detail: str = ""


class PrivateNetwork:
    """The cluster's network (see the module's docstring): this namespace routes between the agents' own."""

    def __init__(self) -> None:
        check_private()
        self._links = 0  # veth pairs made so far: each gets a new name, the old one may not be gone yet
        self._cut: list[tuple[str, str]] = []  # (from, to) pairs blackholed now

    @staticmethod
    def address(index: int) -> str:
        if not 0 <= index < MAX_AGENTS:
            raise ValueError(f"agent {index}: a private network holds agents 0 to {MAX_AGENTS - 1}")
        return f"{SUBNET}.{FIRST_AGENT_HOST + index}"

    def setup(self) -> None:
        """The router: loopback up with ROUTER on it, forwarding on."""
        _ip_batch(["link set lo up", f"addr replace {ROUTER}/32 dev lo"])
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")

    def attach(self, index: int, process: ForkedProcess | subprocess.Popen) -> None:
        """Link the namespace of `process` (which entered one of its own: `enter_own_network`) to the router, as
        agent `index`."""
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + LINK_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise ClusterError(f"agent {index} exited (code {process.returncode}) before it was linked")
            try:
                if os.readlink(f"/proc/{process.pid}/ns/net") != own:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"agent {index} has no network namespace of its own after {LINK_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        self._links += 1
        link, address = f"pt{index}l{self._links}", self.address(index)
        _ip_batch([f"link add {link} type veth peer name eth0 netns {process.pid}", f"link set {link} up",
                   f"route replace {address}/32 dev {link}"])
        _ip_batch(["link set lo up", f"addr add {address}/32 dev eth0", "link set eth0 up",
                   f"route add {ROUTER}/32 dev eth0", f"route add default via {ROUTER} dev eth0"],
                  namespace_of=process.pid)

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Cut the groups off from each other (both ways); heal() undoes it."""
        if self._cut:
            raise RuntimeError("a partition is in force already")
        cut = [(self.address(a), self.address(b)) for i, first in enumerate(groups)
               for j, second in enumerate(groups) if i != j for a in first for b in second]
        self._cut = cut  # before the rules: a failure half-way leaves the heal all of them to delete
        _ip_batch([f"rule add from {src} to {dst} blackhole" for src, dst in cut])

    def heal(self) -> None:
        cut, self._cut = self._cut, []
        # -force: a rule that was never added (a partition that failed half-way) does not stop the others' removal.
        _ip_batch([f"rule del from {src} to {dst} blackhole" for src, dst in cut], force=True)


def enter_own_network() -> None:
    """In an agent forked by `PrivateNetworkCluster`, before it runs: a network namespace of its own, then wait
    (LINK_TIMEOUT_S at most) until `PrivateNetwork.attach` has given it a default route."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    deadline = time.monotonic() + LINK_TIMEOUT_S
    while not _has_default_route():
        if time.monotonic() > deadline:
            raise SystemExit("no link to the router")
        time.sleep(0.02)


def _has_default_route() -> bool:
    """Whether this process's network namespace has a default route (/proc/net/route: destination 0)."""
    with open("/proc/net/route") as routes:
        return any(line.split()[1] == "00000000" for line in list(routes)[1:])


def check_private() -> None:
    """Raises RuntimeError unless this process is root of a user namespace of its own, where network changes reach
    only the namespaces made in it."""
    uid_map = Path("/proc/self/uid_map").read_text().split()
    if os.geteuid() != 0 or uid_map == ["0", "0", "4294967295"]:
        raise RuntimeError("the private network works only in a user and network namespace of its own: run under "
                           "`unshare --user --map-root-user --net` (as `python -m coordinator.chaos run` does)")


def _ip_batch(commands: Iterable[str], namespace_of: int | None = None, force: bool = False) -> None:
    lines = "\n".join(commands) + "\n"
    if lines.strip() == "":
        return
    enter = ["nsenter", f"--net=/proc/{namespace_of}/ns/net", "--"] if namespace_of is not None else []
    done = subprocess.run([*enter, "ip", *(["-force"] if force else []), "-batch", "-"], input=lines, text=True,
                          capture_output=True, timeout=IP_TIMEOUT_S, check=False)
    if done.returncode != 0 and not force:
        raise ClusterError(f"ip failed ({done.returncode}): {done.stderr.strip()}\n{lines}")


@dataclass
class PrivateNetworkCluster(LocalCluster):
    """A LocalCluster whose agents each run in a network namespace of their own, behind the router that this process's
    namespace is (`PrivateNetwork`): `partition()` and `heal()` cut groups of agents off from each other."""

    host: str = ROUTER
    network: PrivateNetwork = field(default_factory=PrivateNetwork)

    def _start(self, timeout_s: float) -> None:
        self.network.setup()
        super()._start(timeout_s)

    def agent_host(self, index: int) -> str:
        return self.network.address(index)

    def start_agent(self, index: int) -> None:
        process = self._spawn(f"agent-{index}", self.agent_args(index), enter_own_network)
        try:
            self.network.attach(index, process)
        except BaseException:
            process.kill()
            process.wait()
            raise

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        self.network.partition(groups)

    def heal(self) -> None:
        self.network.heal()


class Chaos:
    """Runs `faults` against `cluster` in a thread from `start()`; `stop()` (or the end of `with`) ends it and undoes
    what is in force. Partitions need a PrivateNetworkCluster."""

    def __init__(self, cluster: LocalCluster, faults: Sequence[Fault]):
        check_schedule(faults, cluster.agents)
        if any(f.kind == Kind.PARTITION for f in faults) and not isinstance(cluster, PrivateNetworkCluster):
            raise ValueError("partitions need a PrivateNetworkCluster (`python -m coordinator.chaos run` makes one)")
        self.cluster = cluster
        self.faults = tuple(faults)
        self.record: list[Action] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._in_force: set[Fault] = set()
        self._lock = threading.Lock()  # the record and what is in force: the thread writes, stop() reads and undoes
        self._started = 0.0
        self._started_unix = 0.0

    def __enter__(self) -> Chaos:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def started_unix(self) -> float:
        return self._started_unix

    def start(self) -> None:
        self._started, self._started_unix = time.monotonic(), time.time()
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait until the whole schedule has run; False if it has not after `timeout_s`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            for fault in sorted(self._in_force, key=lambda f: f.at_s):
                if fault.kind != Kind.KILL:
                    self._end(fault, "on exit")

    def _run(self) -> None:
        # Ends before starts at one time: a fault may follow another on the same agent without a gap.
        timeline = sorted([(f.at_s, 1, f) for f in self.faults] + [(f.end_s, 0, f) for f in self.faults],
                          key=lambda item: (item[0], item[1]))
        for at_s, begins, fault in timeline:
            if self._stop.wait(max(0.0, self._started + at_s - time.monotonic())):
                return
            with self._lock:
                try:
                    if begins:
                        self._begin(fault)
                    elif fault in self._in_force:
                        self._end(fault)
                except Exception as error:  # recorded, and the schedule goes on: stop() still undoes the rest
                    self.errors.append(f"{fault}: {error}")
                    self._note("error", fault, str(error))

    def _note(self, action: str, fault: Fault, detail: str = "") -> None:
        self.record.append(Action(time.monotonic() - self._started, time.time(), action, str(fault), detail))

    def _process(self, agent: int) -> ForkedProcess | None:
        """The running process of agent `agent` that the cluster started, or None."""
        process = self.cluster.processes.get(f"agent-{agent}")
        return process if process is not None and process.poll() is None else None

    def _begin(self, fault: Fault) -> None:
        if fault.kind == Kind.PARTITION:
            assert isinstance(self.cluster, PrivateNetworkCluster)
            self._in_force.add(fault)
            self.cluster.partition(fault.groups)
            self._note("partition", fault)
            return
        process = self._process(fault.agent)
        if process is None:
            self._note("skipped", fault, f"agent {fault.agent} is not running")
            return
        if fault.kind == Kind.KILL:
            self.cluster.kill(f"agent-{fault.agent}")
            self._note("kill", fault, f"pid {process.pid}")
        else:
            process.send_signal(signal.SIGSTOP)
            self._note("stop", fault, f"pid {process.pid}")
        self._in_force.add(fault)

    def _end(self, fault: Fault, detail: str = "") -> None:
        self._in_force.discard(fault)
        if fault.kind == Kind.PARTITION:
            assert isinstance(self.cluster, PrivateNetworkCluster)
            self.cluster.heal()
            self._note("heal", fault, detail)
        elif fault.kind == Kind.KILL:
            self.cluster.start_agent(fault.agent)
            self._note("restart", fault, f"pid {self.cluster.processes[f'agent-{fault.agent}'].pid}")
        else:
            process = self._process(fault.agent)
            if process is not None:
                process.send_signal(signal.SIGCONT)
                self._note("cont", fault, " ".join(filter(None, [f"pid {process.pid}", detail])))


# --------------------------------------------------------------------------------------------- the runner


@dataclass
class Run:
    job: dict
    faults: list[Fault]
    timeout_s: float = 600.0


def load_plan(path: Path) -> tuple[int, str | None, list[Run]]:
    plan = yaml.safe_load(path.read_text())
    runs = [Run(run["job"], [Fault.parse(text) for text in run.get("faults", [])], float(run.get("timeout_s", 600)))
            for run in plan["runs"]]
    for run in runs:
        check_schedule(run.faults, int(plan["agents"]))
    return int(plan["agents"]), plan.get("data_dir"), runs


def wait_until_stepping(cluster: LocalCluster, job_id: str, timeout_s: float) -> None:
    """Until every rank of the job has taken a step."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status(job_id)
        if status.state != pb.JOB_PENDING and status.state != pb.JOB_RUNNING:
            return
        if status.world_size and len(status.nodes) == status.world_size and min(n.step for n in status.nodes) >= 1:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"job {job_id} did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_job(cluster: LocalCluster, run: Run) -> dict:
    """Submit `run`'s job, run its faults once it steps, wait for its end; what happened, as JSON-able values."""
    started = time.monotonic()
    job_id = cluster.submit(yaml.safe_dump(run.job))
    wait_until_stepping(cluster, job_id, run.timeout_s)
    chaos = Chaos(cluster, run.faults)
    with chaos:
        status = cluster.wait(job_id, timeout_s=max(1.0, run.timeout_s - (time.monotonic() - started)))
        chaos.wait(0.0)
    agent_of = {n.node_id: int(n.name.split("-")[1]) for n in cluster.nodes() if n.name.startswith("agent-")}
    accuracies = [n.test_accuracy for n in status.nodes]
    return {
        "job_id": job_id, "state": pb.JobState.Name(status.state), "run_dir": status.run_dir,
        "wall_s": time.monotonic() - started, "schedule_started_unix": chaos.started_unix,
        "mean_accuracy": sum(accuracies) / len(accuracies) if accuracies else math.nan,
        "nodes": [{"rank": n.rank, "node_id": n.node_id, "agent": agent_of.get(n.node_id, -1), "step": n.step,
                   "test_accuracy": n.test_accuracy} for n in status.nodes],
        "faults": [str(f) for f in run.faults], "actions": [asdict(a) for a in chaos.record], "errors": chaos.errors,
    }


def run_plan(plan: Path, out: Path, root: Path | None, log_level: str) -> int:
    """In the private namespaces: the cluster, then the plan's runs in turn; writes the result to `out`."""
    agents, data_dir, runs = load_plan(plan)

    def on_term(*_: object) -> None:
        raise SystemExit(143)  # so that the cluster is stopped on the way out

    signal.signal(signal.SIGTERM, on_term)
    with tempfile.TemporaryDirectory(prefix="chaos-") as scratch:
        cluster = PrivateNetworkCluster(root=root or Path(scratch), agents=agents, data_dir=data_dir,
                                        log_level=log_level)
        with cluster:
            results = []
            for run in runs:
                results.append(run_job(cluster, run))
                print(f"{run.job.get('name', 'job')}: {results[-1]['state']}, mean accuracy "
                      f"{100 * results[-1]['mean_accuracy']:.2f} in {results[-1]['wall_s']:.0f} s", flush=True)
                out.write_text(json.dumps({"runs": results}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.chaos",
                                     description="Run jobs on a local cluster with faults injected on a schedule.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a plan's jobs, each with its faults, in a private network")
    run.add_argument("plan", type=Path, help="YAML: agents, data_dir, runs: [{job, faults, timeout_s}]")
    run.add_argument("--out", type=Path, required=True, help="where to write the result (JSON)")
    run.add_argument("--root", type=Path, help="the cluster's directory, kept (default: a temporary one)")
    run.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="the agents' and the coordinator's (default %(default)s)")
    run.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        load_plan(args.plan)  # a bad plan is refused before anything starts
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as error:
        parser.error(f"{args.plan}: {error}")
    if args.in_namespace:
        return run_plan(args.plan, args.out.resolve(), args.root and args.root.resolve(), args.log_level)
    inner = [sys.executable, "-m", "coordinator.chaos", *(argv if argv is not None else sys.argv[1:]),
             "--in-namespace"]
    # exec: a signal to this process reaches the runner, which stops its cluster.
    os.execvp("unshare", ["unshare", "--user", "--map-root-user", "--net", *inner])


if __name__ == "__main__":
    sys.exit(main())
