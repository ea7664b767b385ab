"""Every expected error of the command lines is one line on stderr naming the file or address, and a non-zero exit:
directories that cannot be written, a name the coordinator would refuse. Never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.cli import main as nodeagent_main

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


# -- directories the daemons cannot use ----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_coordinator_refuses_a_state_dir_it_cannot_create(tmp_path):
    state = a_file(tmp_path) / "state"
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(state))
    assert_one_line_error(result, f"coordinator: cannot create state directory {state}: Not a directory")


@pytest.mark.slow
def test_the_coordinator_refuses_a_state_dir_it_cannot_write_in(tmp_path):
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(UNWRITABLE))
    assert_one_line_error(result, f"coordinator: cannot write in state directory {UNWRITABLE}: Permission denied")


@pytest.mark.slow
def test_the_coordinator_refuses_a_runs_dir_it_cannot_create(tmp_path):
    runs = a_file(tmp_path) / "runs"
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                 "--state-dir", str(tmp_path / "state"), "--runs-dir", str(runs))
    assert_one_line_error(result, f"coordinator: cannot create runs directory {runs}: Not a directory")


@pytest.mark.slow
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
