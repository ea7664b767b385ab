"""A local cluster: one coordinator and N node agents as separate processes on loopback.

This is what `coordinator demo` runs and what the integration tests start. Every process logs to
ROOT/logs/NAME.log; `stop()` ends every process it started (SIGTERM, then SIGKILL after a grace period).

With `tls` (the default) the cluster runs as a real one does: a CA in ROOT/coordinator/ca, each agent's
certificate issued into its state directory's tls/, and an operator certificate in ROOT/operator-tls for the calls
made from here. `insecure` agents run without (only beside an insecure coordinator).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from coordinator.zygote import ForkedProcess
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir, Transport

if TYPE_CHECKING:
    from coordinator.ca import ClusterCA

FINAL_STATES = (pb.JOB_FINISHED, pb.JOB_STOPPED, pb.JOB_FAILED)


class ClusterError(RuntimeError):
    pass


# How long the coordinator and the agents may take to come up (the first start waits for the fork server's imports):
# a bound for a busy machine (8 agents on 2 shared cores, each a fresh interpreter then, took more than 60 s), not a
# speed; a process that exits is noticed at once.
START_TIMEOUT_S = 300.0


def _unwind_on_sigterm() -> bool:
    """Make SIGTERM (what `timeout` and `kill` send) raise SystemExit in this process while a cluster's with-block
    runs, so that the block's stop() ends the processes it started: by default SIGTERM ends the interpreter at once
    and leaves them running (a benchmark killed so left its coordinator, agents and fork server behind). Only from
    the main thread, where Python runs handlers, and only over the default action; whether it was installed."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False

    def exit_unwinding(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_unwinding)
    return True


@dataclass
class LocalCluster:
    root: Path
    agents: int
    data_dir: str | None = None
    slowdown: dict[int, float] = field(default_factory=dict)
    heartbeat_timeout_s: float = 5.0
    log_level: str = "INFO"
    tls: bool = True
    host: str = "127.0.0.1"  # where the coordinator listens, and the agents unless `agent_host` says otherwise
    device: str = "cpu"  # every agent's --device (they share a GPU: one is enough)
    torch_threads: int = 1  # every agent's --torch-threads: agents share this machine's cores
    processes: dict[str, ForkedProcess] = field(default_factory=dict)
    address: str = ""
    metrics_address: str = ""
    enroll_address: str = ""
    _channel: grpc.Channel | None = None
    _unwinds_sigterm: bool = False

    def __enter__(self) -> LocalCluster:
        self._unwinds_sigterm = _unwind_on_sigterm()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._unwinds_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _spawn(self, name: str, args: list[str], prepare: Callable[[], None] | None = None) -> ForkedProcess:
        """Run `python -m ARGS` as process `name`, forked from the fork server that imported torch once
        (coordinator/zygote.py); `prepare` runs in it first."""
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        process = ForkedProcess(args[0], args[1:], logs / f"{name}.log", {**os.environ, "PYTHONUNBUFFERED": "1"},
                                prepare)
        self.processes[name] = process
        return process

    def log_of(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def operator_tls(self) -> Path:
        return self.root / "operator-tls"

    def state_dir(self, index: int) -> Path:
        return self.root / f"agent-{index}"

    def transport(self) -> Transport:
        """The operator's transport: how this process reaches the coordinator."""
        return Transport(TlsDir(self.operator_tls)) if self.tls else Transport.insecure()

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        if self._channel is None:
            self._channel = self.transport().channel(self.address)
        return coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def _make_pki(self) -> None:
        """The cluster CA, an operator certificate, and a node certificate per agent (kept across restarts)."""
        from coordinator.ca import ClusterCA

        state = self.root / "coordinator"
        ca = ClusterCA.load(state) if (ClusterCA.directory_of(state) / "ca.key").exists() else ClusterCA.init(state)
        if not TlsDir(self.operator_tls).complete():
            ca.issue_files(TlsDir(self.operator_tls), Role.OPERATOR, "operator")
        for index in range(self.agents):
            self._issue_node_certificate(ca, index)

    def _issue_node_certificate(self, ca: ClusterCA, index: int) -> None:
        tls_dir = TlsDir(self.state_dir(index) / "tls")
        if not tls_dir.complete():
            ca.issue_files(tls_dir, Role.NODE, f"agent-{index}")

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the coordinator and the agents, and wait until every agent registered; on any failure (or an
        interrupt) stop what was started before raising. A process that exits fails the start at once."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self._make_pki()
        deadline = time.monotonic() + timeout_s
        self._run_coordinator(f"{self.host}:0", deadline)
        for rank in range(self.agents):
            self.start_agent(rank)
        self.wait_for_nodes(self.agents, deadline)

    def _run_coordinator(self, listen: str, deadline: float) -> None:
        """Start the coordinator on `listen` and wait until it serves."""
        ready = self.root / "coordinator.ready.json"
        ready.unlink(missing_ok=True)
        self.start_coordinator(ready, listen)
        while not ready.exists():
            self._check_alive("coordinator")
            if time.monotonic() > deadline:
                raise ClusterError("the coordinator did not start in time:\n" + self.log_of("coordinator"))
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        self.address, self.metrics_address, self.enroll_address = info["listen"], info["metrics"], info["enroll"]

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        """Start the coordinator again (after `kill("coordinator")`) on its state directory and its address, where
        the agents look for it."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._run_coordinator(self.address, time.monotonic() + timeout_s)

    def stop_coordinator(self, grace_s: float = 30.0) -> None:
        """Stop the coordinator as an operator would (SIGTERM, as `systemctl restart` does to upgrade it);
        `restart_coordinator` starts it again."""
        _terminate(self.processes["coordinator"], grace_s)

    def start_coordinator(self, ready: Path, listen: str) -> None:
        self._spawn(
            "coordinator",
            [
                "coordinator.cli", "serve", "--listen", listen, "--metrics-listen", f"{self.host}:0",
                "--state-dir", str(self.root / "coordinator"), "--runs-dir", str(self.root / "runs"),
                "--heartbeat-timeout", str(self.heartbeat_timeout_s), "--ready-file", str(ready),
                "--log-level", self.log_level, "--enroll-listen", f"{self.host}:0",
                *([] if self.tls else ["--insecure"]),
            ],
        )

    def agent_host(self, index: int) -> str:
        """The address agent number `index` listens on (peers, lanes and metrics) and advertises."""
        del index
        return self.host

    def start_agent(self, index: int) -> None:
        """Start (or restart, keeping its state dir and so its node id) agent number `index`; one beyond the
        cluster's first `agents` gets its certificate now."""
        if self.tls and index >= self.agents:
            from coordinator.ca import ClusterCA

            self._issue_node_certificate(ClusterCA.load(self.root / "coordinator"), index)
        self._spawn(f"agent-{index}", self.agent_args(index))

    def agent_args(self, index: int) -> list[str]:
        """The command line of agent number `index`, after `python -m`."""
        host = self.agent_host(index)
        args = [
            "nodeagent.cli", "serve", "--coordinator", self.address, "--listen", f"{host}:0",
            "--metrics-listen", f"{host}:0", "--state-dir", str(self.state_dir(index)),
            "--name", f"agent-{index}", "--device", self.device, "--log-level", self.log_level,
            "--torch-threads", str(self.torch_threads),
            *([] if self.tls else ["--insecure"]),
        ]
        if self.data_dir:
            args += ["--data-dir", self.data_dir]
        if index in self.slowdown:
            args += ["--slowdown", str(self.slowdown[index])]
        return args

    def _check_alive(self, name: str) -> None:
        code = self.processes[name].poll()
        if code is not None:
            raise ClusterError(f"{name} exited with code {code}:\n{self.log_of(name)[-4000:]}")

    def wait_for_nodes(self, count: int, deadline: float) -> list[pb.NodeInfo]:
        stub = self.stub()
        while True:
            for name in self.processes:
                self._check_alive(name)
            try:
                nodes = [n for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes if n.up]
            except grpc.RpcError:
                nodes = []
            if len(nodes) >= count:
                return nodes
            if time.monotonic() > deadline:
                raise ClusterError(f"only {len(nodes)} of {count} agents registered in time")
            time.sleep(0.2)

    def nodes(self) -> list[pb.NodeInfo]:
        return list(self.stub().ListNodes(pb.ListNodesRequest(), timeout=5).nodes)

    def submit(self, spec_yaml: str) -> str:
        # A coordinator's first submission imports and builds the model's code (on the meta device) to check it: on a
        # machine loaded beyond its cores that took over 30 s.
        return self.stub().SubmitJob(pb.SubmitJobRequest(spec_yaml=spec_yaml), timeout=120).job_id

    def status(self, job_id: str) -> pb.JobStatusReply:
        return self.stub().JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=10)

    def wait(
        self, job_id: str, timeout_s: float, on_progress: Callable[[pb.JobStatusReply], None] | None = None
    ) -> pb.JobStatusReply:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive("coordinator")
            status = self.status(job_id)
            if on_progress:
                on_progress(status)
            if status.state in FINAL_STATES:
                return status
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} did not finish within {timeout_s:.0f} s")
            time.sleep(1.0)

    def kill(self, name: str) -> None:
        """Kill one process at once, as a crash would."""
        self.processes[name].kill()
        self.processes[name].wait()

    def stop_agent(self, index: int, grace_s: float = 30.0) -> None:
        """Stop agent number `index` as an operator would (SIGTERM: it deregisters) and leave it out of the cluster:
        an agent started beyond the first `agents` for a while."""
        _terminate(self.processes.pop(f"agent-{index}"), grace_s)

    def stop(self, grace_s: float = 10.0) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _terminate(process: ForkedProcess, grace_s: float) -> None:
    """SIGTERM, as an operator's stop; killed if it has not exited within `grace_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
