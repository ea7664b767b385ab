"""The records of a job (progress, events, data descriptions) as the gRPC messages that carry them, and back: the one
place where they meet protobuf, so that the node driver, the simulator and the control plane use plain records.

A MetricsReport (agent -> coordinator) and a NodeProgress (coordinator -> operator) carry the same fields as
Progress; NaN means "not measured yet". Light to import (no torch), as the command line needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.events import Event
from nodeagent.runtime.progress import EdgeCounters, MemberJudgement, Progress

if TYPE_CHECKING:  # the data layer loads torch, which the command line need not
    from nodeagent.training.data import DatasetInfo

# The most dimensions of a data description read from a message (nodeagent.runtime.readiness checks them).
MAX_INPUT_DIMS = 4


# -- progress -----------------------------------------------------------------------------------------------------


def to_report(progress: Progress) -> pb.MetricsReport:
    return pb.MetricsReport(
        job_id=progress.job, rank=progress.rank, node_id=progress.node, step=progress.step, loss=progress.loss,
        test_accuracy=progress.test_accuracy, test_loss=progress.test_loss, elapsed_s=progress.elapsed_s,
        finished=progress.finished, bytes_sent=progress.bytes_sent, bytes_received=progress.bytes_received,
        compute_s=progress.compute_s, wait_s=progress.wait_s, exchanges=progress.exchanges,
        exchange_failures=progress.exchange_failures, local_steps=progress.local_steps,
        edges=[_edge_to_pb(edge) for edge in progress.edges], waiting_for=progress.waiting_for,
        test_perplexity=progress.test_perplexity,
    )


def from_report(report: pb.MetricsReport, time: float) -> Progress:
    return Progress(
        job=report.job_id, rank=report.rank, node=report.node_id, step=report.step, loss=report.loss,
        test_accuracy=report.test_accuracy, test_loss=report.test_loss, elapsed_s=report.elapsed_s,
        finished=report.finished, bytes_sent=report.bytes_sent, bytes_received=report.bytes_received,
        compute_s=report.compute_s, wait_s=report.wait_s, exchanges=report.exchanges,
        exchange_failures=report.exchange_failures, time=time,
        edges=tuple(_edge_from_pb(edge) for edge in report.edges), local_steps=report.local_steps,
        waiting_for=report.waiting_for, test_perplexity=_perplexity(report),
    )


def _perplexity(message: pb.MetricsReport | pb.NodeProgress) -> float:
    """A message's perplexity; a message from before the field (issue 26) has none: not measured."""
    return message.test_perplexity if message.HasField("test_perplexity") else math.nan


def to_node_progress(progress: Progress, state: str = "", failure: str = "") -> pb.NodeProgress:
    """`state` and `failure` are the coordinator's view of the node (up, down, failed, finished)."""
    return pb.NodeProgress(
        state=state, failure=failure,
        rank=progress.rank, node_id=progress.node, step=progress.step, loss=progress.loss,
        test_accuracy=progress.test_accuracy, finished=progress.finished, updated_unix=progress.time,
        bytes_sent=progress.bytes_sent, bytes_received=progress.bytes_received, test_loss=progress.test_loss,
        elapsed_s=progress.elapsed_s, compute_s=progress.compute_s, wait_s=progress.wait_s,
        exchanges=progress.exchanges, exchange_failures=progress.exchange_failures, local_steps=progress.local_steps,
        edges=[_edge_to_pb(edge) for edge in progress.edges], waiting_for=progress.waiting_for,
        test_perplexity=progress.test_perplexity,
    )


def from_node_progress(job: str, node: pb.NodeProgress) -> Progress:
    return Progress(
        job=job, rank=node.rank, node=node.node_id, step=node.step, loss=node.loss, test_accuracy=node.test_accuracy,
        test_loss=node.test_loss, elapsed_s=node.elapsed_s, finished=node.finished, bytes_sent=node.bytes_sent,
        bytes_received=node.bytes_received, compute_s=node.compute_s, wait_s=node.wait_s, exchanges=node.exchanges,
        exchange_failures=node.exchange_failures, time=node.updated_unix, local_steps=node.local_steps,
        edges=tuple(_edge_from_pb(edge) for edge in node.edges), waiting_for=node.waiting_for,
        test_perplexity=_perplexity(node),
    )


def _edge_to_pb(edge: EdgeCounters) -> pb.EdgeTraffic:
    # EdgeTraffic has EdgeCounters' fields, by the same names; MemberJudgement's, too.
    return pb.EdgeTraffic(**{f.name: getattr(edge, f.name) for f in dataclasses.fields(EdgeCounters)}
                          | {"judged": [pb.MemberJudgement(**dataclasses.asdict(j)) for j in edge.judged]})


def _edge_from_pb(edge: pb.EdgeTraffic) -> EdgeCounters:
    return EdgeCounters(**{f.name: getattr(edge, f.name) for f in dataclasses.fields(EdgeCounters)}
                        | {"failure_reasons": dict(edge.failure_reasons),
                           "judged": tuple(MemberJudgement(j.rank, j.seen, j.clipped, j.outlying)
                                           for j in edge.judged)})


# -- events -------------------------------------------------------------------------------------------------------


def event_to_proto(event: Event) -> pb.JobEvent:
    return pb.JobEvent(time_unix=event.time, kind=event.kind, level=event.level, message=event.message,
                       rank=event.rank, node_id=event.node, step=event.step)


def event_from_proto(job: str, event: pb.JobEvent) -> Event:
    return Event(time=event.time_unix, job=job, kind=event.kind, message=event.message, level=event.level,
                 rank=event.rank, node=event.node_id, step=event.step)


# -- data descriptions --------------------------------------------------------------------------------------------


def data_to_proto(info: DatasetInfo) -> pb.DataDescription:
    return pb.DataDescription(input_shape=info.input_shape, num_classes=info.num_classes,
                              train_samples=info.train_samples, test_samples=info.test_samples)


def data_from_proto(message: pb.DataDescription) -> DatasetInfo:
    """The description a node sent; check it with `readiness.data_problem` before using it. Only the shape's first
    MAX_INPUT_DIMS + 1 sizes are read (enough to say that it has too many)."""
    from nodeagent.training.data import DatasetInfo

    return DatasetInfo(tuple(message.input_shape[:MAX_INPUT_DIMS + 1]), message.num_classes, message.train_samples,
                       message.test_samples)
