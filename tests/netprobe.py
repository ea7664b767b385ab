"""What a partition of coordinator/chaos.py's private network does to an established TCP connection: run by
tests/test_chaos_cluster.py in a user and network namespace of its own (`unshare --user --map-root-user --net`).

An echo server as agent 0 and a client as agent 1, each in its own namespace behind the router; the client sends a
byte every 0.1 s on one connection and notes when each echo comes back. After 1 s the two are cut off from each
other for 3 s, then healed; the probe ends at the first echo after the heal (or when the client gives up, after
CLIENT_FOR_S). Writes {"cut", "healed", "echoes": [Unix times], "error"} as JSON to argv[1]."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from coordinator.chaos import LINK_TIMEOUT_S, PrivateNetwork

PORT = 9000
# Each side runs under this: a network namespace of its own, waiting until `attach` has made its default route, then
# exec'ing the script (so that its pid stays the one attached). The agents do the same in Python once forked
# (coordinator.chaos.enter_own_network); these scripts are plain interpreters with pipes.
LAUNCHER = ("unshare", "--net", "--", "sh", "-c",
            f"i=0; until ip route show default | grep -q via; do i=$((i+1)); "
            f"if [ $i -gt {int(LINK_TIMEOUT_S / 0.02)} ]; then echo 'no link to the router' >&2; exit 75; fi; "
            'sleep 0.02; done; exec "$@"', "netprobe-launcher")
CUT_AFTER_S = 1.0
CUT_FOR_S = 3.0
CLIENT_FOR_S = 18.0  # TCP's retransmission timer has backed off during the cut: the next try may come seconds later

SERVER = f"""
import socket, sys
with socket.create_server((sys.argv[1], {PORT})) as server:
    connection, _ = server.accept()
    while data := connection.recv(64):
        connection.sendall(data)
"""

CLIENT = f"""
import socket, sys, threading, time
deadline = time.monotonic() + 10
while True:
    try:
        connection = socket.create_connection((sys.argv[1], {PORT}), timeout=1)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("connected", flush=True)
end = time.monotonic() + {CLIENT_FOR_S}

def send():
    while time.monotonic() < end:
        connection.sendall(b"x")
        time.sleep(0.1)

threading.Thread(target=send, daemon=True).start()
connection.settimeout(0.2)
while time.monotonic() < end:
    try:
        data = connection.recv(64)
    except TimeoutError:
        continue
    if not data:
        raise SystemExit("the connection was closed")
    for _ in data:
        print(time.time(), flush=True)
"""


def _is_echo(line: str) -> bool:
    return line.strip().replace(".", "", 1).isdigit()


def main() -> int:
    network = PrivateNetwork()
    network.setup()
    processes = []
    try:
        for index, script in ((0, SERVER), (1, CLIENT)):
            process = subprocess.Popen([*LAUNCHER, sys.executable, "-c", script, network.address(0)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            processes.append(process)
            network.attach(index, process)
        client = processes[1]
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "connected"
        time.sleep(CUT_AFTER_S)
        cut = time.time()
        network.partition([[0], [1]])
        time.sleep(CUT_FOR_S)
        healed = time.time()
        network.heal()
        # The echoes so far wait in the pipe; then the first one after the heal, or the client's end (it gave up, or
        # the connection was closed).
        lines = []
        while line := client.stdout.readline():
            lines.append(line)
            if _is_echo(line) and float(line) > healed:
                break
        else:
            client.wait(timeout=10)
        error = "" if client.returncode in (None, 0) else "".join(lines[-5:])
    finally:
        for process in processes:
            process.kill()
            process.wait()
    echoes = [float(line) for line in lines if _is_echo(line)]
    with open(sys.argv[1], "w") as out:
        json.dump({"cut": cut, "healed": healed, "echoes": echoes, "error": error}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
