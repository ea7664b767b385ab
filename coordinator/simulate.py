"""`coordinator simulate JOB.yaml`: run a job's nodes in one process on a virtual clock.

The job schema is the one real runs use, plus its `simulation:` section (speeds, network, faults). Nodes are
built from one `nodeagent.training.job.JobData` (the job's data, split and initial model, prepared once) with the
neighbours the coordinator would assign, so a simulated node is the same object an agent trains. The run
directory gets the same metrics log as a real run, with virtual time stamps.

The job goes through the coordinator's own rules (coordinator.control.ControlPlane, on the in-memory state and the
virtual clock): it is scheduled on the simulated nodes, released at its start barrier once every rank is ready,
finished when every rank has, and the failure policy applies to nodes that are down (`simulation.faults`): one that
is silent for longer than the heartbeat timeout and the job's `failure.lost_grace_s` fails a synchronous job, as it
would on agents, and the run ends there. (An elastic job keeps its largest membership: its nodes do not leave or
join while it runs.)

`simulation.topology_changes` switches the job's topology while it runs, through the node driver's path of a
real change (`NodeDriver.change_topology`): every node learns of every change at the start, so none is late, and
switches just before the change's step. Each change is written to the run's events log, at the virtual time of
the first node's switch.

A job with `algorithm.robust` is judged as on agents: the nodes' reports (and the parameter server's counts, at each
monitor tick) feed the coordinator's suspicion, which flags a lying rank (`simulation.byzantine`) with a `suspected`
event; with `robust.quarantine` the coordinator's quarantine is carried out, a peer-to-peer member's edges dropped
by a live topology change that every node is told of at once, a parameter-server worker's pushes taken as zero.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.control.memory import MemoryState
from coordinator.control.plane import AssignmentsChanged, ControlPlane, Effect, JobEnded, JobEvent, Quarantined
from coordinator.control.records import Job
from coordinator.control.states import JobState
from coordinator.display import mean_accuracy, mean_measured
from coordinator.export import manifest_of
from coordinator.jobs import plan_node, validate_job, validate_topology_change, with_topology
from coordinator.progress_view import ProgressView
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.algorithms import Family, lookup
from nodeagent.defaults import HEARTBEAT_TIMEOUT_S
from nodeagent.jobspec import JobSpec
from nodeagent.metrics import Metrics
from nodeagent.runtime import events
from nodeagent.runtime.driver import Report, Switch, TopologyChange
from nodeagent.runtime.events import Event, EventLog
from nodeagent.runtime.messages import data_to_proto
from nodeagent.runtime.progress import Progress, RunLog, figures_text, task_metrics
from nodeagent.runtime.simulator import SimNode, VirtualMesh, rare_full_collections
from nodeagent.training.job import JobData, Node
from nodeagent.training.loop import CPU


def build_nodes(spec: JobSpec, data_dir: str | None = None, allow_imports: Collection[str] = (),
                device: torch.device = CPU) -> list[Node]:
    """Every node of the job, placed in the topology exactly as the coordinator assigns agents, all on `device`. A
    model is imported only from `allow_imports`, as on an agent (nodeagent.training.models). An elastic job is built
    at its largest size, every rank a member from the start."""
    topology = validate_job(spec)
    spec = spec.sized()
    data = JobData.prepare(spec, data_dir, allow_imports, device)
    nodes = []
    with rare_full_collections():
        for rank in range(spec.nodes):
            plan = plan_node(spec, topology, rank)
            nodes.append(data.node(rank, plan.neighbors, plan.self_weight, plan.peer_schedule))
    return nodes


# How often simulated nodes beat and the coordinator's monitor looks at them, in virtual seconds (as agents beat and
# the coordinator's monitor runs: `coordinator serve`).
MONITOR_EVERY_S = 1.0
# The coordinator's rules read times as unix times, where 0 means "not yet" (a job not released, a member not ready);
# the virtual clock starts at 0, so they read it from this offset. Without it a job released at virtual time 0 was
# never released to them: it failed its start barrier once it ran longer than `start.timeout_s`.
COORDINATOR_EPOCH_S = 1.0


class SimulatedCoordinator:
    """The coordinator of a simulated job: its rules (ControlPlane) on the in-memory state and the mesh's virtual
    clock. The simulated nodes register, the job is submitted and scheduled on them (rank r on the node of rank r),
    every rank reports ready at the start and its progress as it goes; nodes that are up beat every
    MONITOR_EVERY_S, when the monitor's tick applies the failure policy. A job that ends before every node has
finished (failed, or finished without the lost) halts the mesh: its nodes are free, as agents are."""

    def __init__(self, mesh: VirtualMesh, spec: JobSpec, device: torch.device, event_log: EventLog | None):
        self.mesh = mesh
        self.event_log = event_log
        self.state = MemoryState(self.clock)
        self.plane = ControlPlane(self.state, self.clock, HEARTBEAT_TIMEOUT_S)
        self.job_id = spec.name
        self._finished: set[int] = set()
        self._topology_version = 1  # the last version of the job's topology its nodes were told
        self._leading_step = -1  # the highest step the coordinator's rules were told of at a tick
        for sim in mesh.nodes:
            self.state.register_node(sim.name, sim.name, sim.name, "", device.type, "", "", 0)
        self.state.add_job(self.job_id, spec, "", "")
        self._apply(self.plane.submitted())
        job = self.job
        if job.state != JobState.RUNNING:
            raise RuntimeError(f"the simulated job cannot start: it {job.reason}")
        placed = [m.node_id for m in self.state.members(self.job_id)]
        assert placed == [sim.name for sim in mesh.nodes], "ranks placed other than on their simulated nodes"
        data = mesh.nodes[0].node.batches.dataset.info
        for sim in mesh.nodes:
            self._apply(self.plane.ready(job, sim.rank, sim.name, data)[1])
        mesh.in_background(MONITOR_EVERY_S, self._tick)

    def clock(self) -> float:
        return COORDINATOR_EPOCH_S + self.mesh.now

    @property
    def job(self) -> Job:
        job = self.state.job(self.job_id)
        assert job is not None
        return job

    def report(self, progress: Progress) -> Progress:
        """A node's progress report; once every rank has finished, the job is. Returns it as the coordinator
        records it (its traffic added up over the rank's part in the job)."""
        recorded = self.state.record_progress(progress) or progress
        self._apply(self.plane.progress_reported(self.job, progress))
        if progress.finished and progress.rank not in self._finished:
            self._finished.add(progress.rank)
            if len(self._finished) == len(self.mesh.nodes):  # asked once, not on each report (O(nodes) each)
                self._apply(self.plane.reported(self.job))
        return recorded

    def _tick(self) -> None:
        now = self.mesh.now
        leading = self.mesh.nodes[0]
        for sim in self.mesh.nodes:
            if self.mesh.down_until(sim.rank, now) is None:
                self.state.touch_node(sim.name)
            if sim.node.algorithm.clock > leading.node.algorithm.clock:
                leading = sim
        # Agents report every REPORT_INTERVAL_S; simulated nodes, but a robust job's, only at their evaluations (the
        # reports' cost at scale). The rules judge whether a synchronous job still steps from the highest step
        # reported, so the leading node's progress reaches them at each tick, as an agent's report would.
        if leading.node.algorithm.clock > self._leading_step:
            self._leading_step = leading.node.algorithm.clock
            self._apply(self.plane.progress_reported(self.job, leading.driver.progress()))
        server = self.mesh.server
        if server is not None and self.job.spec.algorithm.robust is not None:
            self._apply(self.plane.server_reported(self.job, server.half.robust_counts()))
        self._apply(self.plane.tick())
        if self.job.state == JobState.RUNNING:
            self.mesh.in_background(now + MONITOR_EVERY_S, self._tick)

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, JobEvent) and self.event_log is not None:
                self.event_log.append(Event(self.mesh.now, effect.job.job_id, effect.kind,
                                            events.bounded(effect.message), effect.level))
            elif isinstance(effect, JobEnded) and len(self._finished) < len(self.mesh.nodes):
                self.mesh.halt()  # ended before every node finished (failed, or finished without the lost)
            elif isinstance(effect, Quarantined):
                assert self.mesh.server is not None, "pushes quarantined, but the job has no parameter server"
                quarantined = self.mesh.server.half.quarantined
                (quarantined.discard if effect.released else quarantined.add)(effect.rank)
            elif isinstance(effect, AssignmentsChanged) and self.job.topology_version > self._topology_version:
                self._switch_topology()

    def _switch_topology(self) -> None:
        """The job's topology changed (a quarantine's dropped edges): every member is told its place in the new
        graph at once, as the servicer tells the agents, and switches before the job's switch step."""
        job = self.job
        self._topology_version = job.topology_version
        members = self.state.members(self.job_id)
        description = f"{job.running_spec.topology.kind} (version {job.topology_version})"
        for member in members:
            plan = self.plane.plan(job, members, member.rank)
            self.mesh.nodes[member.rank].driver.change_topology(
                TopologyChange(job.switch_step, plan.neighbors, plan.self_weight, plan.peer_schedule, description))


@dataclass
class SimulationResult:
    mesh: VirtualMesh
    run_dir: Path | None
    wall_s: float
    job: Job  # as the coordinator's rules left it: finished, failed (and why), or still running

    @property
    def progress(self) -> list[Progress]:
        return [sim.driver.progress() for sim in self.mesh.nodes]

    @property
    def mean_accuracy(self) -> float:
        return mean_accuracy(self.progress)


def simulate(
    spec: JobSpec,
    run_dir: Path | None = None,
    data_dir: str | None = None,
    metrics: Metrics | None = None,
    on_progress: Callable[[VirtualMesh], None] | None = None,
    allow_imports: Collection[str] = (),
    device: torch.device = CPU,
) -> SimulationResult:
    """Run `spec` to completion, every node on `device`; writes the metrics log and the events (virtual times) to
    `run_dir` when given. The nodes' Prometheus series go to `metrics` where the caller reads them; without it none
    are kept (the command serves none)."""
    torch.set_num_threads(1)  # one process steps every node in turn; extra threads only contend
    started = time.monotonic()
    spec = spec.sized()  # an elastic job: at its largest size (build_nodes)
    nodes = build_nodes(spec, data_dir, allow_imports, device)
    with ExitStack() as logs_open:
        run_log = event_log = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "job.json").write_text(spec.model_dump_json(indent=2))
            run_log, event_log = RunLog(run_dir), EventLog(run_dir)
            logs_open.enter_context(run_log.held_open())  # not opened again for each of the nodes' records
            logs_open.enter_context(event_log.held_open())
            event_log.append(Event(0.0, spec.name, events.STARTED,
                                   f"simulating {spec.algorithm.name} on {spec.nodes} nodes, {spec.steps} steps"))
        finished: set[int] = set()
        coordinator: SimulatedCoordinator | None = None

        def observe(mesh: VirtualMesh, sim: SimNode, report: Report) -> None:
            assert coordinator is not None
            progress = coordinator.report(report.progress)
            if run_log is not None:
                run_log.append(progress)
            if event_log is not None and progress.finished and progress.rank not in finished:
                finished.add(progress.rank)
                event_log.append(Event(mesh.now, spec.name, events.FINISHED, f"rank {progress.rank} finished at step "
                                       f"{progress.step}, {figures_text(spec.task, progress)}", rank=progress.rank,
                                       node=progress.node, step=progress.step))

        mesh = VirtualMesh(nodes, spec.name, spec.simulation, metrics, observe,
                           on_switch=topology_events(event_log) if event_log is not None else None)
        # Its records of every node: a full collection took 1 s of 5,000 nodes' registering.
        with rare_full_collections():
            coordinator = SimulatedCoordinator(mesh, spec, device, event_log)
        schedule_topology_changes(mesh, spec)
        mesh.run(on_event=on_progress)
        job = coordinator.job
        if event_log is not None and job.state == JobState.RUNNING:
            event_log.append(Event(mesh.now, spec.name, events.STOPPED,
                                   "the simulation ended before every node finished"))
        return SimulationResult(mesh, run_dir, time.monotonic() - started, job)


def simulated_model(result: SimulationResult) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The simulated job's model and its manifest, as `coordinator export` takes a job's by default: the mean of
    the finished ranks' models for the peer-to-peer family, the parameter server's model for the server family, the
    first finished rank's for the all-reduce family (whose ranks hold the same model). ValueError if no rank
    finished."""
    spec = result.job.spec
    nodes = [sim.node for sim in result.mesh.nodes if sim.done]
    if not nodes:
        raise ValueError(f"job {spec.name}: no rank finished, so it has no trained model")
    info = nodes[0].batches.dataset.info
    metric = task_metrics(spec.task)[0]
    model = copy.deepcopy(nodes[0].algorithm.model).cpu()
    family = lookup(spec.algorithm.name).family
    if family is Family.SERVER:
        assert result.mesh.server is not None
        chosen: list[Node] = []
        parameters = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.vector_to_parameters(result.mesh.server.half.w.cpu(), parameters)
        source = "the parameter server"
    else:
        chosen = nodes if family is Family.PEER else nodes[:1]
        held = [dict(n.algorithm.model.named_parameters()) for n in chosen]
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(torch.stack([h[name].detach().cpu() for h in held]).mean(dim=0))
        source = f"rank {chosen[0].rank}" if len(chosen) == 1 else (
            f"the mean of the models of ranks {chosen[0].rank}..{chosen[-1].rank}")
    ranks = {n.rank for n in chosen}
    finals = [sim.driver.progress() for sim in result.mesh.nodes if sim.done and
              (family is Family.SERVER or sim.rank in ranks)]
    described = pb.ExportedModel(
        job_id=spec.name, spec_json=spec.to_json(), metric_name=metric.field, data=data_to_proto(info),
        ranks=[n.rank for n in chosen], step=min(p.step for p in finals), source=source,
        metric_value=sum(metric.of(p) for p in finals) / len(finals),
        metric_of=f"rank {chosen[0].rank}'s final evaluation" if len(chosen) == 1 else
        "the mean of the workers' final evaluations, each of the model the server last sent it" if not chosen else
        "the mean of the ranks' final evaluations (the mean model itself was not evaluated: `coordinator report "
        "--model` evaluates it)")
    return model.state_dict(), manifest_of(described, spec, info)


def schedule_topology_changes(mesh: VirtualMesh, spec: JobSpec) -> None:
    """Tell every node of `mesh` of the job's `simulation.topology_changes`, planned as the coordinator plans a
    change (`coordinator topology`)."""
    previous = spec.topology
    for version, change in enumerate(spec.simulation.topology_changes, start=2):
        topology_spec = change.topology()
        topology = validate_topology_change(spec, topology_spec)
        changed = with_topology(spec, topology_spec)
        description = f"{previous.kind} -> {topology_spec.kind} (version {version})"
        for sim in mesh.nodes:
            plan = plan_node(changed, topology, sim.rank)
            sim.driver.change_topology(
                TopologyChange(change.at_step, plan.neighbors, plan.self_weight, plan.peer_schedule, description)
            )
        previous = topology_spec


def topology_events(event_log: EventLog) -> Callable[[VirtualMesh, SimNode, Switch], None]:
    """A mesh's `on_switch`: writes each topology change once, at the virtual time its first node switches."""
    logged: set[str] = set()

    def on_switch(mesh: VirtualMesh, sim: SimNode, switch: Switch) -> None:
        description = switch.change.description
        if description not in logged:
            logged.add(description)
            event_log.append(Event(mesh.now, mesh.job, events.TOPOLOGY, f"topology {description} at step "
                                   f"{switch.step}", step=switch.step))

    return on_switch


class SimulationProgress:
    """Shows a simulation on a live progress view, every `every_s` wall seconds at most: the nodes' steps, their
    mean accuracy and the virtual time."""

    def __init__(self, view: ProgressView, task: str = "classification", every_s: float = 0.5):
        self.view = view
        self.headline = task_metrics(task)[0]
        self.every_s = every_s
        self.last = -math.inf

    def __call__(self, mesh: VirtualMesh) -> None:
        if time.monotonic() - self.last < self.every_s:
            return
        # The nodes' steps and accuracies as they stand, not their full progress (every edge of every node): this
        # runs between two events, and work here that grows with the node count made a run quadratic in it.
        began = time.monotonic()
        steps = [sim.node.algorithm.clock for sim in mesh.nodes]
        figure = mean_measured(sim.driver.figures[self.headline.field] for sim in mesh.nodes)
        self.view.update(steps, figure, note=f"virtual {mesh.now:.1f} s", metric=self.headline)
        self.last = time.monotonic()  # counted from the end of this update: a slow one cannot run back to back
        # An update walks every node (40 ms at 10,000): at most a fiftieth of the run goes to showing it.
        self.every_s = max(self.every_s, 50 * (self.last - began))


def reference_spec(spec: JobSpec) -> JobSpec:
    """The single-node reference of a job: one node on all the training data (iid split of one), plain SGD with
    the job's step size, L2, momentum, batch size and number of steps."""
    algorithm = spec.algorithm.model_copy(update={"name": "dsgd", "mode": "async", "options": {}})
    data = spec.data.model_copy(update={"split": "iid", "split_options": {}})
    topology = spec.topology.model_copy(update={"kind": "ring", "options": {}})
    return spec.model_copy(
        update={"name": f"{spec.name}-reference", "nodes": 1, "algorithm": algorithm, "data": data,
                "topology": topology, "slowdown": {}, "simulation": spec.simulation.model_copy(update={"speeds": []})}
    )
