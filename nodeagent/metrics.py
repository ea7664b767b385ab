"""Every Prometheus metric of peertrain, defined in one place (agents and the coordinator alike).

Names carry the `peertrain_` prefix and Prometheus units. Series of a job carry `job_id` (not "job": Prometheus
owns that label); edges are labelled `src` and `dst` (node ids), nodes `node`. When a job ends here its series are
removed (`forget_job`). Each process owns one `Metrics` object with its own registry, so tests can run several in
one interpreter. No `_created` series: they double every counter's series and no query uses them.

Per-edge debugging: the edge gauges (last message, in flight since, message interval, neighbour staleness,
consensus distance) come from the node driver's per-edge accounting, set at each progress report
(`observe_edges`). The driver counts time on its own clock (monotonic on agents, virtual in the simulator) and
reports ages; the agent turns them into Unix timestamps here, so that `time() - gauge` is an age in PromQL.

Device gauges: an agent on a CUDA device exports its memory as torch's caching allocator counts it and, where NVML is
present (the `gpu` extra, nvidia-ml-py), its utilisation, read at each scrape (`DeviceCollector`); a CPU agent
exports none.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent.listen import ListenError
from nodeagent.runtime.progress import EdgeCounters

disable_created_metrics()

log = logging.getLogger("nodeagent")

EXCHANGE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

# The gauges of an agent's CUDA device (DeviceCollector), their help, and their labels.
DEVICE_MEMORY_ALLOCATED = "peertrain_device_memory_allocated_bytes"
DEVICE_MEMORY_RESERVED = "peertrain_device_memory_reserved_bytes"
DEVICE_MEMORY_PEAK = "peertrain_device_memory_peak_bytes"
DEVICE_UTILIZATION = "peertrain_device_utilization_ratio"
DEVICE_GAUGES = {
    DEVICE_MEMORY_ALLOCATED: "Device memory held by this agent's tensors (torch.cuda.memory_allocated)",
    DEVICE_MEMORY_RESERVED: "Device memory held by this agent's caching allocator, its tensors' and its cache "
    "(torch.cuda.memory_reserved); what other processes on the device cannot have",
    DEVICE_MEMORY_PEAK: "Most device memory this agent's tensors held at once since it started "
    "(torch.cuda.max_memory_allocated)",
    DEVICE_UTILIZATION: "Share of the last sample period (1/6 s to 1 s) in which a kernel ran on the device, any "
    "process's (NVML, 0..1); only where nvidia-ml-py is installed and NVML starts",
}
DEVICE_LABELS = ("node", "device")


@dataclass
class Metrics:
    """The metrics of one process. `registry` is what its /metrics endpoint serves."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        edge = ["job_id", "src", "dst"]
        node = ["job_id", "node"]
        self.edge_bytes_sent = Counter(
            "peertrain_edge_bytes_sent", "Bytes of tensor frames sent on an edge", edge, registry=r
        )
        self.edge_bytes_received = Counter(
            "peertrain_edge_bytes_received", "Bytes of tensor frames received on an edge", edge, registry=r
        )
        self.edge_messages_sent = Counter(
            "peertrain_edge_messages_sent", "Messages (tensor streams) sent on an edge", edge, registry=r
        )
        self.edge_messages_received = Counter(
            "peertrain_edge_messages_received", "Messages (tensor streams) received on an edge", edge, registry=r
        )
        self.exchange_seconds = Histogram(
            "peertrain_exchange_seconds",
            "Wall time of one exchange started by src with dst, request and reply",
            edge,
            buckets=EXCHANGE_SECONDS_BUCKETS,
            registry=r,
        )
        self.exchange_failures = Counter(
            "peertrain_exchange_failures",
            "Exchanges that failed, by reason (unavailable, timeout, rejected, ...)",
            [*edge, "reason"],
            registry=r,
        )
        self.edge_last_message = Gauge(
            "peertrain_edge_last_message_timestamp_seconds",
            "Unix time of the last message on an edge: one received from dst, or a call to it that completed",
            edge, registry=r,
        )
        self.edge_message_interval = Gauge(
            "peertrain_edge_message_interval_seconds",
            "Mean time between two messages on an edge so far (the edge's exchange interval)", edge, registry=r,
        )
        self.edge_in_flight_since = Gauge(
            "peertrain_edge_in_flight_since_timestamp_seconds",
            "Unix time since which src's exchange or pull to dst is in flight; 0 when none is", edge, registry=r,
        )
        self.neighbor_staleness = Gauge(
            "peertrain_neighbor_staleness_steps",
            "Steps src is ahead of the clock of the last message it received from dst (negative: behind)",
            edge, registry=r,
        )
        self.consensus_distance = Gauge(
            "peertrain_edge_consensus_distance",
            "Norm of src's parameters minus its copy of dst's (algorithms that keep copies of neighbours only)",
            edge, registry=r,
        )
        self.stream_rejections = Counter(
            "peertrain_stream_rejections",
            "Peer streams and requests refused or ended before touching state (bad manifest, truncated, not_neighbor, "
            "too_many_streams, idle_timeout, ...), by reason; src is the caller's certificate name, or unknown",
            ["src", "dst", "reason"],
            registry=r,
        )
        self.local_steps = Counter("peertrain_local_steps", "Local training steps taken", node, registry=r)
        self.training_loss = Gauge("peertrain_training_loss", "Loss of the last local minibatch", node, registry=r)
        self.test_accuracy = Gauge(
            "peertrain_test_accuracy", "Accuracy on the test set at the last evaluation (0..1)", node, registry=r
        )
        self.test_loss = Gauge("peertrain_test_loss", "Loss on the test set at the last evaluation (a language "
                               "model's: the validation loss per token)", node, registry=r)
        self.test_perplexity = Gauge(
            "peertrain_test_perplexity", "A language model's validation perplexity at the last evaluation",
            node, registry=r)
        self.step_seconds = Histogram(
            "peertrain_step_seconds",
            "Compute time of one local step (forward, backward, update)",
            node,
            buckets=STEP_SECONDS_BUCKETS,
            registry=r,
        )
        self.wait_seconds = Counter(
            "peertrain_wait_seconds", "Time spent waiting for messages before a step", node, registry=r
        )
        self.quorum_size = Gauge(
            "peertrain_quorum_size", "Members of the all-reduce quorum this node is in (all-reduce jobs)", node,
            registry=r,
        )
        self.aborted_steps = Counter(
            "peertrain_aborted_steps", "All-reduce steps aborted because a member of the quorum was lost (the step "
            "is taken again by the next quorum)", node, registry=r,
        )
        self.agent_info = Gauge(
            "peertrain_agent_info",
            "Constant 1, labelled with the agent's identity: node id, name, package version, peer address, device",
            ["node", "name", "version", "address", "device"], registry=r,
        )
        self.coordinator_nodes = Gauge(
            "peertrain_coordinator_nodes", "Registered node agents by liveness", ["state"], registry=r
        )
        self.insecure_mode = Gauge(
            "peertrain_insecure_mode",
            "1 when this process runs without TLS and identities (--insecure): anyone who reaches it controls it",
            registry=r,
        )
        self.coordinator_jobs = Gauge("peertrain_coordinator_jobs", "Jobs by state", ["state"], registry=r)
        # One series per running job (gone once it ends), so that an alert can ask about each job by itself.
        self.coordinator_job_running = Gauge("peertrain_coordinator_job_running", "1 for each running job",
                                             ["job_id"], registry=r)
        # Issue 28: each member's suspicion (coordinator.control.suspicion; unset until measured) and whether it is
        # flagged (its job's robust.suspect_fraction reached) or quarantined.
        self.coordinator_member_suspicion = Gauge(
            "peertrain_coordinator_member_suspicion", "Share of a member's recent contributions that its neighbours "
            "(or the parameter server) found outlying", ["job_id", "member"], registry=r)
        self.coordinator_member_suspected = Gauge(
            "peertrain_coordinator_member_suspected", "1 while a member is flagged by its job's robust rule",
            ["job_id", "member"], registry=r)
        self.coordinator_member_quarantined = Gauge(
            "peertrain_coordinator_member_quarantined", "1 once a member is quarantined (its contributions dropped)",
            ["job_id", "member"], registry=r)
        self.coordinator_heartbeats = Counter(
            "peertrain_coordinator_heartbeats", "Heartbeats received from node agents", registry=r
        )
        self.coordinator_refused_reports = Counter(
            "peertrain_coordinator_refused_reports",
            "Progress reports refused for a figure no run can have (a step past the job's end, a time in the future, "
            "an accuracy outside 0..1), by node and by the field named", ["node", "field"], registry=r,
        )
        # The parameter server hosted by the coordinator (centralised algorithms); `node` is the worker.
        self.ps_bytes_upstream = Counter(
            "peertrain_ps_upstream_bytes", "Payload bytes of pushes and step reports, worker to server", node,
            registry=r,
        )
        self.ps_bytes_downstream = Counter(
            "peertrain_ps_downstream_bytes", "Payload bytes of model pulls, server to worker", node, registry=r
        )
        self.ps_pushes = Counter(
            "peertrain_ps_pushes", "Pushes received by the parameter server, by outcome (applied, pending, "
            "rejected, duplicate, repeated: a step the worker had pushed)", ["job_id", "outcome"], registry=r,
        )
        self.ps_updates_clipped = Counter(
            "peertrain_ps_updates_clipped", "Pushed updates longer than the job's max_update_norm, scaled down to it",
            ["job_id"], registry=r,
        )
        self.robust_clipped = Counter(
            "peertrain_robust_clipped", "Contributions of a member (src) that a robust rule clipped, trimmed or "
            "refused at dst (a node, or the parameter server)", ["job_id", "src", "dst"], registry=r,
        )
        self.ps_version = Gauge("peertrain_ps_version", "Model version of the parameter server", ["job_id"], registry=r)
        self.ps_staleness = Histogram(
            "peertrain_ps_staleness_updates", "Delay of an applied push: updates between the worker's version and it",
            ["job_id"], buckets=STALENESS_BUCKETS, registry=r,
        )

        self._robust_reported: dict[tuple[str, str, str], int] = {}  # (job, node, peer) -> robust_clipped counted
        # Every metric with series of a job, and its label names (for forget_job).
        self._of_a_job = [
            *((m, edge) for m in (self.edge_bytes_sent, self.edge_bytes_received, self.edge_messages_sent,
                                  self.edge_messages_received, self.exchange_seconds, self.edge_last_message,
                                  self.edge_message_interval, self.edge_in_flight_since, self.neighbor_staleness,
                                  self.consensus_distance)),
            (self.exchange_failures, [*edge, "reason"]),
            *((m, node) for m in (self.local_steps, self.training_loss, self.test_accuracy, self.test_loss,
                                  self.test_perplexity,
                                  self.step_seconds, self.wait_seconds, self.quorum_size, self.aborted_steps,
                                  self.ps_bytes_upstream,
                                  self.ps_bytes_downstream)),
            (self.ps_pushes, ["job_id", "outcome"]),
            (self.ps_updates_clipped, ["job_id"]),
            (self.robust_clipped, ["job_id", "src", "dst"]),
            (self.ps_version, ["job_id"]),
            (self.ps_staleness, ["job_id"]),
            (self.coordinator_job_running, ["job_id"]),
            *((m, ["job_id", "member"]) for m in (self.coordinator_member_suspicion, self.coordinator_member_suspected,
                                                  self.coordinator_member_quarantined)),
        ]

    def observe_edges(self, job_id: str, node: str, edges: Iterable[EdgeCounters], now_unix: float) -> None:
        """Set the edge gauges of `node` from its progress record, whose ages count back from `now_unix`. What is
        not known yet (no message on an edge, no copy of the neighbour) is left unset."""
        for edge in edges:
            labels = (job_id, node, edge.peer)
            if math.isfinite(edge.last_message_age_s):
                self.edge_last_message.labels(*labels).set(now_unix - edge.last_message_age_s)
            if math.isfinite(edge.message_interval_s):
                self.edge_message_interval.labels(*labels).set(edge.message_interval_s)
            self.edge_in_flight_since.labels(*labels).set(now_unix - edge.in_flight_s if edge.in_flight_s > 0 else 0)
            if math.isfinite(edge.staleness_steps):
                self.neighbor_staleness.labels(*labels).set(edge.staleness_steps)
            if math.isfinite(edge.consensus_distance):
                self.consensus_distance.labels(*labels).set(edge.consensus_distance)
            # The record holds the node's total; the counter takes what it added since the last record. src is the
            # member whose contribution was clipped, dst the node that clipped it.
            added = edge.robust_clipped - self._robust_reported.get(labels, 0)
            if added > 0:
                self.robust_clipped.labels(job_id, edge.peer, node).inc(added)
                self._robust_reported[labels] = edge.robust_clipped

    def forget_edge(self, job_id: str, node: str, peer: str) -> None:
        """Remove the gauges of an edge `node` no longer reports (a topology change dropped it): left set, its last
        message would only grow older, and the edge would look stalled. Its counters stay until the job ends."""
        for gauge in (self.edge_last_message, self.edge_message_interval, self.edge_in_flight_since,
                      self.neighbor_staleness, self.consensus_distance):
            with contextlib.suppress(KeyError):  # a gauge that was never set for the edge
                gauge.remove(job_id, node, peer)

    def node(self, job_id: str, node: str) -> NodeSeries:
        """The series of one node in one job, through which its driver reports (runtime.driver.NodeMetrics)."""
        return NodeSeries(self, job_id, node)

    def forget_job(self, job_id: str) -> None:
        """Remove every series of the job `job_id`: a finished job's figures stay in its run's log, not here."""
        for metric, names in self._of_a_job:
            found = {
                tuple(sample.labels[name] for name in names)
                for family in metric.collect() for sample in family.samples
                if sample.labels.get("job_id") == job_id
            }
            for values in found:
                metric.remove(*values)
        self._robust_reported = {labels: n for labels, n in self._robust_reported.items() if labels[0] != job_id}

    def watch_device(self, node: str, device: str) -> None:
        """Export the gauges of `node`'s device, read at each scrape, when it is a CUDA device (`cuda:N`, as
        resolved); a CPU has none."""
        if device.startswith("cuda"):
            self.registry.register(DeviceCollector(node, device))

    def serve_http(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP in a daemon thread; returns the bound port (useful with port 0). Raises ListenError
        naming the address when it cannot be had (the server sets SO_REUSEADDR only, so a used port is refused)."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            raise ListenError.from_os_error(host, port, error) from None
        return int(server.server_port)


class NodeSeries:
    """What a node driver reports (runtime.driver.NodeMetrics), as this process's Prometheus series; its own series
    looked up once (a label lookup per step costs the simulator a few percent)."""

    def __init__(self, metrics: Metrics, job_id: str, node: str) -> None:
        self.metrics = metrics
        self._job, self._node = job_id, node
        self._step_seconds = metrics.step_seconds.labels(job_id, node)
        self._local_steps = metrics.local_steps.labels(job_id, node)
        self._training_loss = metrics.training_loss.labels(job_id, node)
        self._wait_seconds = metrics.wait_seconds.labels(job_id, node)

    def stepped(self, seconds: float) -> None:
        self._step_seconds.observe(seconds)
        self._local_steps.inc()

    def waited(self, seconds: float) -> None:
        self._wait_seconds.inc(seconds)

    def trained(self, loss: float) -> None:
        self._training_loss.set(loss)

    def evaluated(self, accuracy: float, loss: float, perplexity: float) -> None:
        # Only the figures of the job's task have series (a language model has no accuracy).
        for gauge, value in ((self.metrics.test_accuracy, accuracy), (self.metrics.test_loss, loss),
                             (self.metrics.test_perplexity, perplexity)):
            if not math.isnan(value):
                gauge.labels(self._job, self._node).set(value)

    def exchange_failed(self, peer: str, reason: str) -> None:
        self.metrics.exchange_failures.labels(self._job, self._node, peer, reason).inc()

    def stream_rejected(self, sender: str, reason: str) -> None:
        self.metrics.stream_rejections.labels(sender, self._node, reason).inc()


class DeviceCollector(Collector):
    """The DEVICE_GAUGES of one CUDA device, read when the registry is collected (a scrape). The memory figures are
    torch's own counters (no call into the device, nothing before the first job touched it: zeros); utilisation
    comes from NVML, looked up once by the device's UUID, and is left out where NVML is missing or fails."""

    def __init__(self, node: str, device: str) -> None:
        # torch is imported where it is used: the agent has it loaded; the coordinator's CLI, which imports this
        # module, starts faster without it.
        import torch

        self._device = torch.device(device)
        self._labels = [node, str(self._device)]
        self._nvml = nvml_device(self._device)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation in DEVICE_GAUGES.items():
            yield GaugeMetricFamily(name, documentation, labels=DEVICE_LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import torch

        values = {
            DEVICE_MEMORY_ALLOCATED: torch.cuda.memory_allocated(self._device),
            DEVICE_MEMORY_RESERVED: torch.cuda.memory_reserved(self._device),
            DEVICE_MEMORY_PEAK: torch.cuda.max_memory_allocated(self._device),
        }
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.errors):  # the device went away or cannot tell now: no sample
                values[DEVICE_UTILIZATION] = self._nvml.utilization()
        for name, value in values.items():
            family = GaugeMetricFamily(name, DEVICE_GAUGES[name], labels=DEVICE_LABELS)
            family.add_metric(self._labels, value)
            yield family


@dataclass(frozen=True)
class NvmlDevice:
    """A device as NVML knows it: its handle, and the error type of the pynvml module that gave it."""

    pynvml: Any
    handle: Any

    @property
    def errors(self) -> type[Exception]:
        return self.pynvml.NVMLError

    def utilization(self) -> float:
        return self.pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100


def nvml_device(device: Any) -> NvmlDevice | None:
    """NVML's handle of a CUDA device, found by its UUID (CUDA's and NVML's device numbers differ in order, and
    CUDA_VISIBLE_DEVICES renumbers CUDA's); None, said once in the log, where pynvml is missing or NVML fails."""
    try:
        import pynvml
    except ImportError:
        log.info("no utilisation of %s: pynvml is not installed (pip install 'peertrain[gpu]')", device)
        return None
    import torch

    try:
        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(device).uuid
        return NvmlDevice(pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
    except pynvml.NVMLError as error:
        log.info("no utilisation of %s: NVML: %s", device, error)
        return None
