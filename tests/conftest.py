"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from clusters import agents_up
from devices import DEVICES

from coordinator.cluster import LocalCluster
from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.jobspec import DEFAULT_DATA_DIR
from nodeagent.metrics import Metrics
from nodeagent.security.pki import Role, certificate_pem, create_ca, issue, new_private_key, private_key_pem
from nodeagent.security.tls import Credentials, TlsDir

# Every test module is in exactly one tier (pyproject's markers; `make test-fast` runs unit and integration).
TIERS = ("unit", "integration", "cluster", "system")

_IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# The order modules are handed to the xdist workers (`make test` runs with --no-loadscope-reorder): the paced modules
# first, then the longest tier first, so that no worker starts a minutes-long cluster module near the end while the
# others have finished. xdist's own order (the most tests first) put the single-test cluster modules, the longest,
# last.
FIRST_TIERS = ("cluster", "system", "integration", "unit")
# The cluster modules whose jobs are paced (`min_step_s`): minutes of wall time each, at a fraction of a core. One
# worker takes them together, first, one after the other in this order (pytest_xdist_make_scheduler), while the
# others run the CPU-bound rest. Chaos last: its last two tests take seconds, and xdist hands a worker its next
# module when two of its tests are left (after a minutes-long one, the other workers would wait at the end).
PACED_MODULES = ("test_allreduce_faults", "test_elastic_cluster", "test_byzantine_cluster", "test_edges_cluster",
                 "test_chaos_cluster")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist (`make test-gpu` on a bare image) has none
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadfile (a module at a time, whose shared fixtures are set up once), the paced modules as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PacedTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "paced" if Path(path).stem in PACED_MODULES else path

    return PacedTogether(config, log)


def module_tier(module: object) -> list[str]:
    marks = getattr(module, "pytestmark", [])
    return [mark.name for mark in (marks if isinstance(marks, list) else [marks]) if mark.name in TIERS]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail the run when a collected module is in no tier or in more than one: a module without one would be left out
    of `make test-fast` (or in it by mistake) without anyone noticing. Then order the items: the paced modules first,
    then tier by tier (FIRST_TIERS), each module's together, in their collection order within a tier."""
    wrong = {}
    for item in items:
        module = item.module
        if module is None or module.__name__ in wrong:
            continue
        tiers = module_tier(module)
        if len(tiers) != 1:
            wrong[module.__name__] = tiers
    if wrong:
        raise pytest.UsageError("each test module needs exactly one tier, `pytestmark = pytest.mark.<tier>` with "
                                f"<tier> one of {', '.join(TIERS)}; these have {wrong}")
    items.sort(key=order)


def order(item: pytest.Item) -> tuple[int, int]:
    if item.module is None:
        return (len(PACED_MODULES), 0)
    name = item.module.__name__
    paced = PACED_MODULES.index(name) if name in PACED_MODULES else len(PACED_MODULES)
    return (paced, FIRST_TIERS.index(module_tier(item.module)[0]))


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device present, in turn (DEVICES)."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    """The directory of the Fashion-MNIST IDX files: $PEERTRAIN_DATA_DIR, else Debian's location."""
    directory = Path(os.environ.get("PEERTRAIN_DATA_DIR") or DEFAULT_DATA_DIR)
    missing = [
        stem for stem in _IDX_STEMS if not (directory / stem).is_file() and not (directory / f"{stem}.gz").is_file()
    ]
    if missing:  # the learning tests need the real data: missing data fails them rather than hiding them
        pytest.fail(
            f"Fashion-MNIST is not in {directory} (missing {', '.join(missing)}): install the Debian package "
            "dataset-fashion-mnist (make data) or set PEERTRAIN_DATA_DIR to a directory holding the IDX files"
        )
    return directory


@pytest.fixture(scope="session")
def four_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One coordinator and 4 agent processes on the CPU, started once and shared by the cluster tests that fit it
    (through `cluster` or `agents_up`): no --data-dir on the agents (each job names its data.data_dir), the default
    heartbeat timeout."""
    with LocalCluster(root=tmp_path_factory.mktemp("four-agents"), agents=4) as running:
        yield running


@pytest.fixture
def cluster(four_agents: LocalCluster) -> LocalCluster:
    """The shared cluster of 4 agents (four_agents), each up."""
    return agents_up(four_agents)


@pytest.fixture
def coordinator_service(tmp_path: Path) -> Iterator[tuple[CoordinatorService, coordinator_pb2_grpc.CoordinatorStub]]:
    """A coordinator service on loopback with a fresh state dir, and a stub to it."""
    service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path), Metrics())
    # Enough threads for many ready reports held at the start barrier at once.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add_coordinator_servicer(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield service, coordinator_pb2_grpc.CoordinatorStub(channel)
    server.stop(grace=None)
    service.stop()


@pytest.fixture
def coordinator_address(tmp_path: Path) -> Iterator[str]:
    """A coordinator service on loopback (insecure) with a fresh state dir: its address, for a client of its own
    (the command line, an agent)."""
    service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path / "coordinator"), Metrics())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_coordinator_servicer(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)
    service.stop()


@pytest.fixture
def coordinator_stub(coordinator_service) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_service[1]


@pytest.fixture
def cluster_pki(tmp_path: Path) -> Callable[[Role, str], TlsDir]:
    """A cluster CA made for the test. Returns `credentials(role, name)`: a certificate for `role` `name` issued by
    that CA, written with its key and the CA certificate to a directory of its own under tmp_path."""
    ca_key, ca_cert = create_ca()

    def credentials(role: Role, name: str) -> TlsDir:
        key = new_private_key()
        cert = issue(ca_key, ca_cert, key.public_key(), role, name)
        directory = TlsDir(tmp_path / "pki" / f"{role}-{name}")
        directory.save(Credentials(certificate_pem(ca_cert), certificate_pem(cert), private_key_pem(key)))
        return directory

    return credentials
