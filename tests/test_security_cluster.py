"""Revocation across a real cluster under mutual TLS: once an operator revokes a node's certificate, the
coordinator refuses it at once and the other agents refuse it on their peer ports as soon as their assignment
carries the serial. The calling side uses gRPC and the generated proto modules only."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from hostile import channel_as

from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.cluster


def describe_as(address: str, credentials: Path, server_name: str) -> grpc.StatusCode:
    with channel_as(address, credentials, server_name) as channel:
        try:
            peer_pb2_grpc.PeerStub(channel).Describe(peer_pb2.DescribeRequest(), timeout=5)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_a_revoked_node_is_refused_by_the_coordinator_and_by_the_other_agents(tmp_path):
    with LocalCluster(root=tmp_path, agents=2, heartbeat_timeout_s=5.0) as cluster:
        nodes = {n.name: n for n in cluster.nodes()}
        stolen = cluster.state_dir(1) / "tls"
        # Before: agent-1's certificate is admitted on agent-0's port (which refuses it only because it runs no job).
        assert describe_as(nodes["agent-0"].peer_address, stolen, "agent-0") is grpc.StatusCode.PERMISSION_DENIED
        revoked = cluster.stub().RevokeCertificate(pb.RevokeCertificateRequest(name="agent-1"), timeout=10).serials
        assert len(revoked) == 1
        assert not {n.name: n for n in cluster.nodes()}["agent-1"].up  # down at once
        deadline = time.monotonic() + 15
        while describe_as(nodes["agent-0"].peer_address, stolen, "agent-0") is not grpc.StatusCode.UNAUTHENTICATED:
            assert time.monotonic() < deadline, "agent-0 still admits the revoked certificate"
            time.sleep(0.2)
        with channel_as(cluster.address, stolen, "coordinator") as heartbeat:
            try:
                coordinator_pb2_grpc.CoordinatorStub(heartbeat).Heartbeat(pb.HeartbeatRequest(), timeout=5)
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
        assert code is grpc.StatusCode.UNAUTHENTICATED
