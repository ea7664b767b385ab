"""One job on one agent: the runner thread, the only thread that touches the node's algorithm.

It builds the node, resumes it from its checkpoint, and runs its NodeLoop around the node driver
(nodeagent.runtime.driver): whatever the network threads received, and the outcome of every call the dispatch
made, comes through one queue and goes to the driver; what the driver decides is performed here (a local step,
stretched by the slow-down), by the dispatch (sends) and by the agent (progress reports; a checkpoint after each
evaluation).

Slow devices: each local step is stretched by the product of the agent's `--slowdown` (the machine) and the job's
`slowdown` of this rank (the experiment): after the step the runner sleeps (factor - 1) times the step's compute
time, and the step counts as compute for that whole time (metrics, ESync step reports). A job's `min_step_s` sets a
pace instead: a step, stretched or not, lasts at least that long, whatever the host.

Topology changes: an assignment with a newer `topology_version` names the new neighbours and the step to switch
at. The runner adds the new neighbours' addresses and names to those it has (the old neighbours stay reachable and
admitted: their messages of the steps before the switch still count, and a push to them is retried until
delivered), and hands the change to the driver, which switches just before that step.
"""

from __future__ import annotations

import collections
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import torch

from nodeagent._proto import coordinator_pb2
from nodeagent.agent.agreement import MemberState
from nodeagent.agent.checkpoint import checkpoint_path, restore_checkpoint, save_checkpoint
from nodeagent.agent.collective import Collective, GroupMember, QuorumOptions
from nodeagent.agent.dispatch import Dispatch
from nodeagent.agent.forward import FORWARDED
from nodeagent.agent.rendezvous import CoordinatorStore
from nodeagent.algorithms import Family, Neighbor
from nodeagent.defaults import REPORT_INTERVAL_S
from nodeagent.jobspec import JobSpec
from nodeagent.ps.link import ServerExpectation
from nodeagent.rpc import Backoff, failure_reason, split_address
from nodeagent.runtime import events
from nodeagent.runtime.driver import Action, Arrival, NodeDriver, Report, TopologyChange
from nodeagent.runtime.messages import data_to_proto, to_report
from nodeagent.runtime.peer_service import GrpcPeers, ServingState
from nodeagent.runtime.progress import figures_text
from nodeagent.runtime.server_link import GrpcServerLink
from nodeagent.training.data import DataError, DatasetInfo
from nodeagent.training.datadirs import DataDirs
from nodeagent.training.job import Node, build_node
from nodeagent.training.model_memory import MIB
from nodeagent.wire.encoder import encode
from nodeagent.wire.message import Encoding, Kind, Message

if TYPE_CHECKING:
    from nodeagent.agent.daemon import Agent

log = logging.getLogger("nodeagent")

NEIGHBOUR_WAIT_S = 60.0
READY_WAIT_S = 5.0  # how long the coordinator may hold a ready report's answer (a long poll for the release)
READY_CALL_SLACK_S = 5.0  # beyond it, for the call's own deadline
WAIT_POLL_S = 0.05  # how often a waiting runner looks at the time (retries, stop)
SERVE_POLL_S = 0.2  # the same once the node is done and only serves
MODEL_SEND_ATTEMPTS = 3
MODEL_SEND_TIMEOUT_S = 120.0  # one attempt to send the final model (a few hundred MB on a slow link)


class JobRunner(threading.Thread):
    def __init__(self, agent: Agent, assignment: coordinator_pb2.Assignment):
        super().__init__(name=f"train-{assignment.job_id}", daemon=True)
        self.agent = agent
        self.job_id = assignment.job_id
        self.rank = assignment.rank
        self.spec = JobSpec.from_json(assignment.job_spec_json)
        self.stop_event = threading.Event()
        self.inbox: queue.Queue[Arrival] = queue.Queue()
        self.neighbors = tuple(
            Neighbor(rank=n.rank, sign=n.sign, phase=n.phase, weight=n.weight, peer_phase=n.peer_phase)
            for n in assignment.neighbors
        )
        self.self_weight = assignment.self_weight
        self.peer_schedule = tuple(tuple(peers.ranks) for peers in assignment.peer_schedule)
        self.rejoin = assignment.rejoin  # this rank ran before: a restart
        self.joined_at = assignment.joined_at_step  # this rank joined the running job (elastic): its switch step
        # A runner that starts after a change starts in its version (its neighbours above).
        self.topology_version = assignment.topology_version
        self.topology_kind = assignment.topology_kind or self.spec.topology.kind
        self.topology_changes: queue.Queue[TopologyChange] = queue.Queue()  # for the runner thread's driver
        self.peers: GrpcPeers | None = None
        self.serving: ServingState | None = None
        self.collective: Collective | None = None
        self.driver: NodeDriver | None = None
        self.addresses: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()  # between the watch thread's updates and the runner's serving state
        self.update(assignment)
        self.pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"exchange-{self.job_id}")
        # One collective at a time, in order; its thread computes as the runner's does (NodeLoop.run).
        self.collective_pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"allreduce-{self.job_id}",
                                                          initializer=same_threads, initargs=(torch.get_num_threads(),))
        self.slowdown = agent.config.slowdown * self.spec.slowdown.get(self.rank, 1.0)
        self.device = torch.device(agent.config.device)

    def update(self, assignment: coordinator_pb2.Assignment) -> None:
        """New addresses or liveness of neighbours, or a new topology; applied between calls (dicts are replaced
        whole). After a topology change the former neighbours keep their entries (see the module's docstring)."""
        with self._lock:
            # Within one topology the neighbours' ranks stay; across a change the former ones are kept.
            self.addresses = self.addresses | {n.rank: n.address for n in assignment.neighbors}
            self.names = self.names | {n.rank: n.node_id for n in assignment.neighbors} | \
                {self.rank: self.agent.node_id}
            if assignment.topology_version > self.topology_version:
                self._change_topology(assignment)
            if self.serving is not None:
                self.serving = replace(self.serving, names=self.names)
                self.agent.set_serving(self.serving)
            if self.peers is not None and self.serving is not None:
                self.peers.update(self.addresses, self.serving)

    def _change_topology(self, assignment: coordinator_pb2.Assignment) -> None:
        description = f"{self.topology_kind} -> {assignment.topology_kind} (version {assignment.topology_version})"
        log.info("job %s: topology %s from step %d", self.job_id, description, assignment.switch_step)
        self.topology_changes.put(TopologyChange(
            at_step=assignment.switch_step,
            neighbors=tuple(Neighbor(rank=n.rank, sign=n.sign, phase=n.phase, weight=n.weight, peer_phase=n.peer_phase)
                            for n in assignment.neighbors),
            self_weight=assignment.self_weight,
            peer_schedule=tuple(tuple(peers.ranks) for peers in assignment.peer_schedule),
            description=description,
        ))
        self.topology_version = assignment.topology_version
        self.topology_kind = assignment.topology_kind

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank{rank}")

    def step(self) -> int:
        """The node's step now (-1 before it is built); read from other threads, for the events they log."""
        driver = self.driver
        return driver.algorithm.clock if driver is not None else -1

    def run(self) -> None:
        try:
            self._train()
        except Exception as error:
            log.exception("job %s failed on this node", self.job_id, extra={FORWARDED: True})
            if not self.stop_event.is_set():  # a job that ended meanwhile has no failure to report
                reason = failure_of(error, self.spec, self.device)
                self.agent.event(self.job_id, events.FAILED, f"failed: {reason}", "ERROR", self.step())
                self.agent.report_failure(self.job_id, self.rank, reason)
        finally:
            with self._lock:  # an assignment that comes now must not serve the job again
                self.serving = None
                self.agent.set_serving(None)
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.collective_pool.shutdown(wait=False, cancel_futures=True)
            if self.collective is not None:
                self.collective.close()
            if self.peers is not None:
                self.peers.close()
            self.agent.metrics.forget_job(self.job_id)
            release_device_memory(self.device)  # the next job on this GPU starts with all of it
            # A neighbour's call that was in flight when the job ended here still counts its bytes until its
            # deadline, which brings its series back: a second sweep after that removes them for good.
            sweep = threading.Timer(self.spec.wire.exchange_timeout_s + 1.0, self.agent.metrics.forget_job,
                                    (self.job_id,))
            sweep.daemon = True
            sweep.start()

    def _train(self) -> None:
        spec, agent = self.spec, self.agent
        building = time.perf_counter()
        data_dir = agent.config.data_dirs.directory_for(spec.data)
        try:
            node = build_node(spec, self.rank, self.neighbors, self.self_weight, data_dir, self.peer_schedule,
                              allow_imports=agent.config.allow_imports, device=self.device,
                              max_model_bytes=agent.config.max_model_memory_mib * MIB)
        except DataError as error:  # this machine lacks the job's data: the job fails at its start barrier
            self._report_missing_data(missing_data_text(spec, agent.config.data_dirs, error))
            return
        algorithm = node.algorithm
        checkpoint = checkpoint_path(agent.config.state_dir, self.job_id, self.rank, spec.checkpoint.keep)
        # A node that joins takes the model from its neighbours; a checkpoint of this rank from an earlier stay in
        # the job is stale (unless this rank ran here already: a restart).
        resumed = (not self.joined_at or self.rejoin) and restore_checkpoint(checkpoint, algorithm)
        driver = self.driver = NodeDriver(node, job=self.job_id, name=agent.node_id, clock=time.perf_counter,
                                          metrics=agent.metrics.node(self.job_id, agent.node_id),
                                          name_of=self.name_of, report_every_s=REPORT_INTERVAL_S)
        if resumed:
            agent.event(self.job_id, events.RESUMED, f"rank {self.rank} resumed at step {algorithm.clock} from its "
                        f"checkpoint {checkpoint}", step=algorithm.clock)
        else:
            agent.event(self.job_id, events.STARTED, f"rank {self.rank} of {spec.nodes} started: "
                        f"{spec.algorithm.name} on {node.shard_size} samples, neighbours {sorted(self.addresses)}, "
                        f"built in {time.perf_counter() - building:.2f} s", step=algorithm.clock)
        if self.joined_at and not resumed:
            driver.join(self.joined_at)
            start = (f"the model of its neighbours {sorted(n.rank for n in self.neighbors)}"
                     if algorithm.join_kind() is not None else "the job's initial model")
            agent.event(self.job_id, events.JOINED, f"rank {self.rank} joined the running job: it starts from "
                        f"{start}, in the topology its nodes switch to at step {self.joined_at}")
        elif self.rejoin:
            driver.rejoin()
            agent.event(self.job_id, events.REJOINED, f"rank {self.rank} restarted in the running job: it takes the "
                        "job up where its neighbours are", step=algorithm.clock)
        encoding = Encoding.from_name(spec.wire.encoding)
        with self._lock:
            self.serving = ServingState(
                job_id=self.job_id, node_id=agent.node_id, rank=self.rank, algorithm_name=spec.algorithm.name,
                names=self.names, expected=algorithm.expected, snapshot=algorithm.snapshot, inbox=self.inbox,
                encoding=encoding, chunk_bytes=spec.wire.chunk_bytes, max_message_bytes=spec.wire.max_message_bytes,
                traffic=driver.traffic, device=str(self.device),
            )
            agent.set_serving(self.serving)
            self.peers = GrpcPeers(self.serving, self.addresses, agent.metrics, spec.wire.exchange_timeout_s,
                                   transport=agent.transport)
        settled: collections.deque[Arrival] = collections.deque()
        collective = self._collective(node, driver)
        dispatch = Dispatch(self.inbox.put, self.pool, self.peers, self._server_link(node, driver), collective,
                            settle=settled.append)
        if collective is not None:  # the collectives on a thread of their own: the node goes on meanwhile
            member = cast(GroupMember, node.algorithm)
            dispatch.collectives = self.collective_pool
            dispatch.state_of = lambda: MemberState(member.group_state(), member.round_applied())
        if not self._wait_for_release(describe_data(node)):
            return
        if not spec.start.barrier:  # with the barrier every neighbour serves the job already
            self._wait_for_neighbours()
        finished = False

        gauged: set[str] = set()  # the edges whose gauges are set

        def publish(report: Report) -> None:
            nonlocal finished
            if report.evaluated:
                save_checkpoint(checkpoint, algorithm)
            if report.progress.finished and not finished:  # told before the report that may end the job
                finished = True
                self._send_model(node)
                if self.collective is not None:  # a member that comes back late takes the final state from here
                    self.collective.hand_over()
                agent.event(self.job_id, events.FINISHED, f"rank {self.rank} finished at step "
                            f"{report.progress.step}, {figures_text(self.spec.task, report.progress)}",
                            step=report.progress.step)
            # The driver's ages count back from the report, made just now: Unix time for the edge gauges.
            agent.metrics.observe_edges(self.job_id, agent.node_id, report.progress.edges, time.time())
            reported = {edge.peer for edge in report.progress.edges}
            for peer in gauged - reported:  # dropped by a topology change
                agent.metrics.forget_edge(self.job_id, agent.node_id, peer)
            gauged.clear()
            gauged.update(reported)
            agent.report(to_report(report.progress))

        NodeLoop(driver, dispatch, self.inbox, publish, self.stop_event, self.slowdown, self.spec.min_step_s,
                 self.topology_changes, settled).run()

    def _send_model(self, node: Node) -> None:
        """Send the coordinator this rank's model as it finished (what its final evaluation used), for `coordinator
        export`, before the final report that may end the job; retried a few times, then left (the export of this
        rank, and of a mean over the ranks, says it has none)."""
        assert self.agent.stub is not None
        algorithm = node.algorithm
        message = Message(kind=Kind.PARAMS, sender=self.rank, receiver=self.spec.max_nodes,
                          tensors=algorithm.params.views(algorithm.w), clock=algorithm.clock)
        backoff = Backoff(f"model of job {self.job_id} to the coordinator", log)
        for _attempt in range(MODEL_SEND_ATTEMPTS):
            frames = encode(message, job_id=self.job_id, sender_id=self.agent.node_id,
                            chunk_bytes=self.spec.wire.chunk_bytes)
            try:
                self.agent.stub.UploadModel(frames, timeout=MODEL_SEND_TIMEOUT_S)
                return
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                                    grpc.StatusCode.FAILED_PRECONDITION):
                    reason = f"{error.code().name}: {error.details()}"
                    break
                reason = failure_reason(error)
                if self.stop_event.wait(backoff.failed(reason)):
                    break
        self.agent.event(self.job_id, events.LOG, f"rank {self.rank}'s final model did not reach the "
                         f"coordinator ({reason}); `coordinator export` cannot have it", "WARNING", algorithm.clock)

    def _server_link(self, node: Node, driver: NodeDriver) -> GrpcServerLink | None:
        if type(node.algorithm).family is not Family.SERVER:
            return None
        assert self.agent.stub is not None
        spec = self.spec
        # The server family's workers say what they accept from the server (nodeagent.ps.worker.PSWorker).
        worker = cast(ServerExpectation, node.algorithm)
        return GrpcServerLink(
            lambda: self.agent.stub, job_id=self.job_id, node_id=self.agent.node_id, rank=self.rank,
            world_size=spec.nodes,
            worker=worker, metrics=self.agent.metrics, traffic=driver.traffic, pool=self.pool,
            timeout_s=spec.wire.exchange_timeout_s, encoding=Encoding.from_name(spec.wire.encoding),
            chunk_bytes=spec.wire.chunk_bytes, max_message_bytes=spec.wire.max_message_bytes,
        )

    def _collective(self, node: Node, driver: NodeDriver) -> Collective | None:
        if type(node.algorithm).family is not Family.COLLECTIVE:
            return None
        failure = self.spec.failure
        # A rank waits for a quorum as long as the coordinator lets a lost node come back, and a step's timeout more.
        options = QuorumOptions(step_timeout_s=failure.step_timeout_s, join_s=failure.join_s,
                                min_members=self.spec.quorum_minimum,
                                wait_s=failure.lost_grace_s + failure.step_timeout_s)

        def announce(message: str, level: str, step: int) -> None:
            self.agent.event(self.job_id, events.QUORUM, message, level, step)

        store = CoordinatorStore(lambda: self.agent.stub, self.job_id, self.agent.node_id,
                                 timedelta(seconds=failure.step_timeout_s))
        self.collective = Collective(store, self.rank, self.spec.nodes, self.agent.metrics,
                                     self.job_id, self.agent.node_id, driver.traffic,
                                     member=cast(GroupMember, node.algorithm), stop=self.stop_event, options=options,
                                     announce=announce, gloo_host=split_address(self.agent.peer_address)[0])
        return self.collective

    def _wait_for_release(self, data: DatasetInfo) -> bool:
        """Report this rank ready to the coordinator, with its data, and wait for the release: with the job's start
        barrier, until every rank is ready (the coordinator fails the job after its `start.timeout_s`). False if the
        job ended first or this runner stops."""
        assert self.agent.stub is not None
        # The first report is answered at once, saying what this rank waits for; the next are held for the release.
        request = coordinator_pb2.JobReadyRequest(node_id=self.agent.node_id, job_id=self.job_id, rank=self.rank,
                                                  data=data_to_proto(data), wait_s=0.0)
        backoff = Backoff(f"ready report of job {self.job_id} to the coordinator", log)
        ready = time.monotonic()
        waiting_for = ""
        while (reply := self._ready_call(request, backoff)) is not None:
            if reply.job_state != coordinator_pb2.JOB_RUNNING:
                log.info("job %s ended before it started here: %s", self.job_id, reply.reason or "stopped")
                return False
            if reply.released:
                if waiting_for:
                    log.info("job %s: released at the start barrier after %.2f s", self.job_id,
                             time.monotonic() - ready)
                return True
            if not waiting_for:
                self.agent.event(self.job_id, events.READY, f"rank {self.rank} ready ({data}); waits at the start "
                                 f"barrier for {reply.waiting_for}")
            elif reply.waiting_for != waiting_for:
                log.info("job %s: waits at the start barrier for %s", self.job_id, reply.waiting_for)
            waiting_for = reply.waiting_for
            request.wait_s = READY_WAIT_S
        return False

    def _report_missing_data(self, missing: str) -> None:
        """Tell the coordinator at the start barrier that this node does not have the job's data (`missing` says
        which and where it looked): the job fails there, naming this node and the dataset."""
        assert self.agent.stub is not None
        log.error("job %s: %s", self.job_id, missing)
        request = coordinator_pb2.JobReadyRequest(node_id=self.agent.node_id, job_id=self.job_id, rank=self.rank,
                                                  missing_data=missing)
        backoff = Backoff(f"missing-data report of job {self.job_id} to the coordinator", log)
        reply = self._ready_call(request, backoff)
        if reply is not None:
            log.info("job %s ended at its start barrier: %s", self.job_id, reply.reason or "stopped")

    def _ready_call(self, request: coordinator_pb2.JobReadyRequest,
                    backoff: Backoff) -> coordinator_pb2.JobReadyReply | None:
        """One answered JobReady call, retried (with `backoff`) while the coordinator cannot be reached; None when this
        runner stops first. A refusal is raised."""
        assert self.agent.stub is not None
        while not self.stop_event.is_set():
            try:
                reply = self.agent.stub.JobReady(request, timeout=READY_WAIT_S + READY_CALL_SLACK_S)
            except grpc.RpcError as error:
                if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                    raise RuntimeError(f"the coordinator refused this rank's ready report: {error.details()}") from None
                self.stop_event.wait(backoff.failed(failure_reason(error)))
                continue
            backoff.succeeded()
            return reply
        return None

    def _wait_for_neighbours(self) -> None:
        """Start together: wait until every neighbour serves this job (bounded), so that no node runs ahead
        mixing with neighbours that have not started. A neighbour that does not come keeps its copy stale."""
        assert self.peers is not None
        deadline = time.monotonic() + NEIGHBOUR_WAIT_S
        waiting = set(self.addresses)
        while waiting and not self.stop_event.is_set() and time.monotonic() < deadline:
            waiting = {rank for rank in waiting if self.peers.serving_job(rank) != self.job_id}
            if waiting:
                self.stop_event.wait(0.1)
        if waiting:
            log.warning("job %s: starting without neighbours %s, which do not serve it yet", self.job_id,
                        sorted(waiting))


def failure_of(error: Exception, spec: JobSpec, device: torch.device) -> str:
    """The reason a job failed on this node, as the coordinator records it: out of device memory says what asked for
    it, so that the operator can size the job (the coordinator prefixes the rank and node)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return (f"CUDA out of memory: {first} (model {spec.model.name}, batch {spec.data.batch_size}, device "
                f"{device})")
    return f"{type(error).__name__}: {error}"


def missing_data_text(spec: JobSpec, data_dirs: DataDirs, error: DataError) -> str:
    """What a node says when it does not have a job's data: the dataset (its kind, and its name where that differs),
    where this node looked, and what the loader found."""
    name = Path(spec.data.data_dir).name
    dataset = spec.data.dataset if name in ("", spec.data.dataset) else f"{spec.data.dataset} ({name})"
    looked = ", ".join(data_dirs.candidates(spec.data))
    return f"no data for dataset {dataset} (looked in {looked}): {error}"


def release_device_memory(device: torch.device) -> None:
    """Give the memory a finished or failed job held on a GPU back to the device (torch's caching allocator keeps
    freed blocks otherwise), so that this agent's next job, or another process, can have it."""
    if device.type != "cuda":
        return
    gc.collect()  # a failed step's traceback may hold the last references to its tensors
    torch.cuda.empty_cache()


def describe_data(node: Node) -> DatasetInfo:
    """The data `node` was built on (its files' description, counting the samples the job's limits keep), as its
    ready report describes it."""
    train = node.batches.dataset
    return replace(train.info, train_samples=len(train),
                   test_samples=len(node.test_set) if node.test_set is not None else 0)


@dataclass
class NodeLoop:
    """The work of one node on an agent: what the driver decides, performed in this thread (local steps, stretched
    by `slowdown`), by `dispatch` (sends) and by `publish` (progress reports); everything that arrives comes
    through `inbox` and goes to the driver. Runs until the node is done, then serves (and retries) until `stop`."""

    driver: NodeDriver
    dispatch: Dispatch
    inbox: queue.Queue[Arrival]
    publish: Callable[[Report], None]
    stop: threading.Event
    slowdown: float = 1.0
    min_step_s: float = 0.0  # the job's pace: a step lasts at least this long
    topology_changes: queue.Queue[TopologyChange] = field(default_factory=queue.Queue)  # from the watch thread
    settled: collections.deque[Arrival] = field(default_factory=collections.deque)  # arrivals that woke no one

    def run(self) -> None:
        # OpenMP's thread count is per thread: a thread that has not been told computes with the library's default
        # (every core) until some operation happens to apply the process's setting (`--torch-threads`), and sums
        # split over other thread counts differ in their last bits. Applied here, every step of the node computes
        # alike, however the thread started and whatever ran in it first.
        same_threads(torch.get_num_threads())
        driver, dispatch = self.driver, self.dispatch
        steps = driver.node.spec.steps
        while not self.stop.is_set():
            dispatch.check()
            if driver.algorithm.clock >= steps:
                # Its last step taken (a last sync under way): the answers that came to its pushes written ahead are
                # taken up now, so that the report that finishes the node, which may end the job, counts them.
                dispatch.poll()
            self._collect()
            while not self.topology_changes.empty():
                driver.change_topology(self.topology_changes.get_nowait())
            for transmission in driver.due_retries():
                dispatch.perform(transmission)
            decision = driver.next()
            for transmission in decision.sends:
                dispatch.perform(transmission)
            for report in decision.reports:
                self.publish(report)
            if decision.action is Action.DONE:
                break
            if decision.action is Action.WAIT:
                self._collect(block=True)
                continue
            duration = driver.step()
            stretched = max(duration * self.slowdown, self.min_step_s)
            if stretched > duration:
                slept = time.perf_counter()
                time.sleep(stretched - duration)
                duration += time.perf_counter() - slept
            self._collect()  # replies that came during the step free their edges for its sends
            for transmission in driver.stepped(duration):
                dispatch.perform(transmission)
        # Keep serving until the job ends: slower neighbours may still exchange with this node (the driver reports
        # the traffic that adds), and its pushes that failed are retried until they are delivered.
        while not self.stop.wait(SERVE_POLL_S):
            self.dispatch.poll()
            self._collect()
            for transmission in driver.due_retries():
                dispatch.perform(transmission)
            for report in driver.next().reports:
                self.publish(report)

    def _collect(self, block: bool = False) -> None:
        """Hand the driver everything that arrived; with `block`, wait a little for the first item, and when none
        came, take up the answers to pushes written ahead (`Dispatch.poll`: a busy runner leaves them to pile up a
        little, as each system call it makes lets another thread take the GIL)."""
        while self.settled:
            self.driver.arrived(self.settled.popleft())
        try:
            item = self.inbox.get(timeout=WAIT_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self.dispatch.poll()
            return
        while True:
            self.driver.arrived(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return


def same_threads(count: int) -> None:
    """Tell this thread the process's OpenMP thread count (see NodeLoop.run)."""
    torch.set_num_threads(count)
