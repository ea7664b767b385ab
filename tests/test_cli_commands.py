"""What the operator's commands print: one name for a job's state in every `--json`, a join token's hint that keeps
the token off command lines, each sub-command's own `--help`, and the recent rates `status` shows."""

from __future__ import annotations

import json
import time

import pytest
import yaml

import coordinator.cli as cli
from coordinator.cli import main as coordinator_main
from coordinator.control.states import JobState
from coordinator.display import status_text
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.messages import to_report
from nodeagent.runtime.progress import Progress

pytestmark = pytest.mark.integration


def json_states(capsys: pytest.CaptureFixture[str], job_id: str) -> set[str]:
    """The job's state as `status --json`, `jobs --json` and `edges --json` name it."""
    states = set()
    for command in (["status", job_id, "--json"], ["jobs", "--json"], ["edges", job_id, "--json"]):
        assert coordinator_main(command) == 0
        [line] = capsys.readouterr().out.splitlines()
        states.add(json.loads(line)["state"])
    return states


def test_every_json_names_a_jobs_state_as_the_coordinator_does(coordinator_stub, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_stub", lambda args: coordinator_stub)
    spec = yaml.safe_dump({"name": "j", "nodes": 2, "steps": 5})
    job_id = coordinator_stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id
    assert json_states(capsys, job_id) == {JobState.PENDING.value}
    coordinator_stub.StopJob(pb.StopJobRequest(job_id=job_id), timeout=5)
    assert json_states(capsys, job_id) == {JobState.STOPPED.value}


class TokenStub:
    def CreateJoinToken(self, request, timeout):
        return pb.CreateJoinTokenReply(token="tok-123", expires_unix=2e9, ca_fingerprint="ab" * 32)


def test_token_create_suggests_the_environment_not_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_stub", lambda args: TokenStub())
    assert coordinator_main(["token", "create", "--coordinator", "coord.example:7070", "--insecure"]) == 0
    out, err = capsys.readouterr()
    assert out == "tok-123\n"  # the token alone on stdout, for a script
    assert "--join-token" not in err and "--ca-fingerprint" not in err
    assert "  PEERTRAIN_JOIN_TOKEN=TOKEN\n" in err and f"  PEERTRAIN_CA_FINGERPRINT={'ab' * 32}\n" in err
    assert err.rstrip().endswith("nodeagent serve --coordinator coord.example:7070 --name NAME")


@pytest.mark.parametrize(("command", "own_option"), [
    (["ca", "init"], "--if-missing"), (["ca", "show"], "--state-dir"), (["cert", "issue"], "--operator NAME"),
    (["cert", "list"], "--json"), (["cert", "revoke"], "--serial SERIAL"),
])
def test_each_ca_and_cert_action_prints_its_own_help(command, own_option, capsys):
    with pytest.raises(SystemExit) as done:
        coordinator_main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: coordinator {' '.join(command)} ") and own_option in out
    assert "{init,show}" not in out and "{issue,list,revoke}" not in out and "ACTION" not in out


def test_status_carries_each_running_nodes_recent_rate(coordinator_stub):
    stub = coordinator_stub
    for i in range(2):
        stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{2100 + i}", name=f"a{i}"), timeout=5)
    spec = yaml.safe_dump({"name": "paced", "nodes": 2, "steps": 100, "topology": {"kind": "ring"}})
    job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), timeout=5).job_id
    members = {n.rank: n.node_id for n in stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5).nodes}
    stub.ReportMetrics(to_report(Progress(job=job_id, rank=0, node=members[0], step=2, elapsed_s=1.0)), timeout=5)
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert not any(node.HasField("recent_steps_per_s") for node in status.nodes)  # one report: no rate yet
    time.sleep(0.05)
    stub.ReportMetrics(to_report(Progress(job=job_id, rank=0, node=members[0], step=6, elapsed_s=2.0)), timeout=5)
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    rates = {node.rank: node.recent_steps_per_s for node in status.nodes if node.HasField("recent_steps_per_s")}
    assert list(rates) == [0] and rates[0] > 0
    assert not status.HasField("server_version")  # a peer-to-peer job has no server
    assert "progress: step 0 of 100; ETA once every running node reported twice" in status_text(status).splitlines()
