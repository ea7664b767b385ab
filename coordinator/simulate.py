"""`coordinator simulate JOB.yaml`: run a job's nodes in one process on a virtual clock.

The job schema is the one real runs use, plus its `simulation:` section (speeds, network, faults). Nodes are
built from one `nodeagent.training.job.JobData` (the job's data, split and initial model, prepared once) with the
neighbours the coordinator would assign, so a simulated node is the same object an agent trains. The run
directory gets the same metrics log as a real run, with virtual time stamps.

`simulation.topology_changes` switches the job's topology while it runs, through the node driver's path of a
real change (`NodeDriver.change_topology`): every node learns of every change at the start, so none is late, and
switches just before the change's step. Each change is written to the run's events log, at the virtual time of
the first node's switch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.display import mean_accuracy, mean_measured
from coordinator.jobs import plan_node, validate_job, validate_topology_change, with_topology
from coordinator.progress_view import ProgressView
from nodeagent.jobspec import JobSpec
from nodeagent.metrics import Metrics
from nodeagent.runtime import events
from nodeagent.runtime.driver import Report, Switch, TopologyChange
from nodeagent.runtime.events import Event, EventLog
from nodeagent.runtime.progress import Progress, RunLog
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


@dataclass
class SimulationResult:
    mesh: VirtualMesh
    run_dir: Path | None
    wall_s: float

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
    `run_dir` when given."""
    torch.set_num_threads(1)  # one process steps every node in turn; extra threads only contend
    started = time.monotonic()
    spec = spec.sized()  # an elastic job: at its largest size (build_nodes)
    nodes = build_nodes(spec, data_dir, allow_imports, device)
    run_log = event_log = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "job.json").write_text(spec.model_dump_json(indent=2))
        run_log, event_log = RunLog(run_dir), EventLog(run_dir)
        event_log.append(Event(0.0, spec.name, events.STARTED, f"simulating {spec.algorithm.name} on {spec.nodes} "
                               f"nodes, {spec.steps} steps"))
    finished: set[int] = set()

    def observe(mesh: VirtualMesh, sim: SimNode, report: Report) -> None:
        progress = report.progress
        if run_log is not None:
            run_log.append(progress)
        if event_log is not None and progress.finished and progress.rank not in finished:
            finished.add(progress.rank)
            event_log.append(Event(mesh.now, spec.name, events.FINISHED, f"rank {progress.rank} finished at step "
                                   f"{progress.step}, test accuracy {progress.test_accuracy:.4f}", rank=progress.rank,
                                   node=progress.node, step=progress.step))

    mesh = VirtualMesh(nodes, spec.name, spec.simulation, metrics or Metrics(), observe,
                       on_switch=topology_events(event_log) if event_log is not None else None)
    schedule_topology_changes(mesh, spec)
    mesh.run(on_event=on_progress)
    if event_log is not None:
        event_log.append(Event(mesh.now, spec.name, events.FINISHED if mesh.finished else events.STOPPED,
                               "job finished" if mesh.finished else "the simulation ended before every node finished"))
    return SimulationResult(mesh, run_dir, time.monotonic() - started)


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

    def __init__(self, view: ProgressView, every_s: float = 0.5):
        self.view = view
        self.every_s = every_s
        self.last = -math.inf

    def __call__(self, mesh: VirtualMesh) -> None:
        if time.monotonic() - self.last < self.every_s:
            return
        # The nodes' steps and accuracies as they stand, not their full progress (every edge of every node): this
        # runs between two events, and work here that grows with the node count made a run quadratic in it.
        steps = [sim.node.algorithm.clock for sim in mesh.nodes]
        accuracy = mean_measured(sim.driver.accuracy for sim in mesh.nodes)
        self.view.update(steps, accuracy, note=f"virtual {mesh.now:.1f} s")
        self.last = time.monotonic()  # counted from the end of this update: a slow one cannot run back to back


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
