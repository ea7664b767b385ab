"""Every expected error of the command lines is one line on stderr naming the file or address, and a non-zero exit:
job files that cannot be jobs, directories that cannot be written, a coordinator that is not there, a reader of
stdout that went away. Never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.cli import main as coordinator_main
from nodeagent.cli import main as nodeagent_main

pytestmark = pytest.mark.system

TIMEOUT_S = 60.0
# A directory nobody may create files in, root included (sysfs).
UNWRITABLE = Path("/sys")


def nowhere() -> str:
    """An address on loopback where nothing listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL, check=False)


def assert_one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [expected], result.stderr


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


# -- job files -----------------------------------------------------------------------------------------------------

BAD_JOB_FILES = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a text file (byte 0 is not UTF-8)"),
    "empty": (b"", "the job file is empty"),
    "only comments": (b"# a job, one day\n\n", "the job file is empty"),
    "NUL in the text": (b"name: a\x00b\n", "not valid YAML: unacceptable character #x0000"),
    "unbalanced YAML": (b"name: [x\n", "not valid YAML: did not find expected ',' or ']' (line 2, column 1)"),
}


@pytest.mark.parametrize("command", ["submit", "inspect", "simulate"])
@pytest.mark.parametrize("case", list(BAD_JOB_FILES))
def test_a_job_file_that_is_no_job_is_refused_in_one_line_naming_it(tmp_path, command, case):
    content, message = BAD_JOB_FILES[case]
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    extra = {"submit": ["--coordinator", nowhere()], "simulate": ["--runs", str(tmp_path / "runs")], "inspect": []}
    with pytest.raises(SystemExit) as refusal:
        coordinator_main([command, str(path), *extra[command]])
    text = refusal.value.code
    assert isinstance(text, str) and "\n" not in text
    assert text.startswith(f"coordinator: {path}: {message}"), text
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["missing", "a directory"])
def test_a_job_file_that_cannot_be_read_is_refused_in_one_line_naming_it(tmp_path, case):
    path = tmp_path / "missing.yaml" if case == "missing" else tmp_path
    reason = "No such file or directory" if case == "missing" else "Is a directory"
    with pytest.raises(SystemExit) as refusal:
        coordinator_main(["submit", str(path), "--coordinator", nowhere()])
    assert refusal.value.code == f"coordinator: cannot read {path}: {reason}"


def test_a_binary_job_file_ends_the_process_with_one_line_and_no_traceback(tmp_path):
    """The refusals above, end to end: what a user sees from the installed command."""
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01 model weights")
    result = run("coordinator.cli", "submit", str(path), "--coordinator", nowhere())
    assert_one_line_error(result, f"coordinator: {path}: not a text file (byte 0 is not UTF-8)")


# -- the coordinator is not there ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["nodes"], ["status"], ["status", "job-1"], ["stop", "job-1"]])
def test_a_coordinator_that_is_not_there_is_one_line_with_its_address_and_the_cause(command):
    address = nowhere()
    result = run("coordinator.cli", *command, "--coordinator", address, "--insecure")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"coordinator: {address}: nothing listens there (connection refused)"), line


def test_submit_to_a_coordinator_that_is_not_there_is_one_line_with_its_address(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "edges", "nodes": 2, "steps": 5}))
    address = nowhere()
    result = run("coordinator.cli", "submit", str(path), "--coordinator", address, "--insecure")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"coordinator: {address}: nothing listens there (connection refused)"), line


# -- stdout closed -------------------------------------------------------------------------------------------------

def test_inspect_into_a_closed_pipe_exits_quietly_as_sigpipe_would(tmp_path, fashion_mnist_dir):
    """`coordinator inspect JOB.yaml | head -1`: the reader is gone before the table is written."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "edges", "nodes": 4, "data": {"data_dir": str(fashion_mnist_dir),
                                                                          "train_limit": 2000}}))
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE, as after `head` exited
    try:
        result = subprocess.run([sys.executable, "-m", "coordinator.cli", "inspect", str(path)], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                                check=False)
    finally:
        os.close(write_end)
    assert result.returncode == 128 + 13, result.stderr  # 141: what a shell reports for a process killed by SIGPIPE
    assert result.stderr == ""


# -- directories the daemons cannot use ----------------------------------------------------------------------------

def test_the_coordinator_refuses_a_state_dir_it_cannot_create(tmp_path):
    state = a_file(tmp_path) / "state"
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(state))
    assert_one_line_error(result, f"coordinator: cannot create state directory {state}: Not a directory")


def test_the_coordinator_refuses_a_state_dir_it_cannot_write_in(tmp_path):
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(UNWRITABLE))
    assert_one_line_error(result, f"coordinator: cannot write in state directory {UNWRITABLE}: Permission denied")


def test_the_coordinator_refuses_a_runs_dir_it_cannot_create(tmp_path):
    runs = a_file(tmp_path) / "runs"
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(tmp_path / "state"), "--runs-dir", str(runs))
    assert_one_line_error(result, f"coordinator: cannot create runs directory {runs}: Not a directory")


@pytest.mark.parametrize("case", ["cannot create", "cannot write in"])
def test_the_agent_refuses_a_state_dir_it_cannot_use(tmp_path, case):
    state = a_file(tmp_path) / "state" if case == "cannot create" else UNWRITABLE
    reason = "Not a directory" if case == "cannot create" else "Permission denied"
    result = run("nodeagent.cli", "serve", "--coordinator", nowhere(), "--listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state), "--device", "cpu")
    assert_one_line_error(result, f"nodeagent: {case} state directory {state}: {reason}")


# -- the agent's name ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tab\there", "line\nbreak", "n" * 65])
def test_the_agent_refuses_a_name_the_coordinator_would_refuse(tmp_path, name):
    with pytest.raises(SystemExit) as refusal:
        nodeagent_main(["serve", "--name", name, "--coordinator", nowhere(), "--state-dir", str(tmp_path / "state"),
                        "--device", "cpu"])
    assert refusal.value.code == "nodeagent: --name must be at most 64 printable characters"
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_the_agents_help_and_a_flags_mistake_answer_without_importing_torch():
    """Importing torch takes seconds: `nodeagent --help` and a wrong flag do not wait for it."""
    probe = ("import sys\nfrom nodeagent.cli import main\n"
             "for argv in (['--help'], ['serve', '--slowdown', '0']):\n"
             "    try:\n        main(argv)\n    except SystemExit as stop:\n        print('exit:', stop.code)\n"
             "print('torch imported:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == "torch imported: False", result.stdout + result.stderr
    assert "exit: nodeagent: --slowdown must be >= 1" in result.stdout.splitlines()


# -- the cluster CA ------------------------------------------------------------------------------------------------

def test_ca_init_never_replaces_a_ca_and_if_missing_keeps_it(tmp_path, capsys):
    """Start-up scripts (systemd ExecStartPre, the compose pki service, the Kubernetes initContainer) run `ca init
    --if-missing` at every start: the first creates the CA, the others keep it; plain `ca init` refuses."""
    state = tmp_path / "state"
    assert coordinator_main(["ca", "init", "--if-missing", "--state-dir", str(state)]) == 0
    created = capsys.readouterr().out.splitlines()
    assert created[0] == f"created the cluster CA in {state / 'ca'}"
    fingerprint = created[1]
    assert fingerprint.startswith("CA fingerprint (sha256): ")
    key = (state / "ca" / "ca.key").read_bytes()

    assert coordinator_main(["ca", "init", "--if-missing", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"kept the cluster CA in {state / 'ca'} (--if-missing)",
                                                   fingerprint]
    assert coordinator_main(["ca", "init", "--state-dir", str(state)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"coordinator: {state / 'ca'} already holds a CA; its certificates would all "
                                         "be lost with it"]
    assert coordinator_main(["ca", "show", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out.splitlines() == [fingerprint]
    assert (state / "ca" / "ca.key").read_bytes() == key


def test_ca_init_if_missing_refuses_a_ca_it_cannot_load(tmp_path, capsys):
    """A key without its certificate is a damaged CA, not a missing one: nothing is created over it."""
    state = tmp_path / "state"
    assert coordinator_main(["ca", "init", "--state-dir", str(state)]) == 0
    (state / "ca" / "ca.crt").unlink()
    key = (state / "ca" / "ca.key").read_bytes()
    capsys.readouterr()
    assert coordinator_main(["ca", "init", "--if-missing", "--state-dir", str(state)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"coordinator: no cluster CA in {state / 'ca'}"), line
    assert (state / "ca" / "ca.key").read_bytes() == key and not (state / "ca" / "ca.crt").exists()
