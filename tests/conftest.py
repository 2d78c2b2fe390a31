"""Shared helpers for the socket-level tests."""
from __future__ import annotations

import json
import os

# One OpenMP thread per test process, set before torch is imported here and inherited by every
# process a test starts. A test runs several nodes on a 2-core box; each torch process would
# otherwise keep two OpenMP threads that spin while waiting for work, and the spinning threads of
# one node take the cores the others need: four `node start` processes training a small model
# burned four times the CPU, for the same bits.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch
import zmq
from torch import nn
from zmq.utils import z85

from starling.node.address import parse_address
from starling.node.identity import Identity
from starling.node.node import Node, NodeConfig
from starling.node.swim import Liveness
from starling.node.trust import Evidence

# Fast enough for tests, slow enough not to flap on a loaded 2-core CI box.
TEST_LIVENESS = Liveness(probe_interval_s=0.2, suspicion_base_s=3.0)
# How long a test waits for a death to be seen: a node's suspicions wait out its own stalls
# (the probe loop pardons them), and a starved CI box stalls it for seconds at a time, so this
# is a hang detector, not a latency bound.
DEATH_SEEN_WITHIN_S = TEST_LIVENESS.suspicion_base_s * TEST_LIVENESS.suspicion_max_mult + 30.0


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (they are scripts, not a package), registered in
    sys.modules as `starling_bench_<name>`: dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(f"starling_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def benchmark_row(name: str, *args: str, timeout_s: float = 120) -> dict:
    """Run benchmarks/<name>.py with `args` in a process of its own; the JSON row it printed
    last (the script must succeed)."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def opacus_accountants() -> ModuleType:
    """Opacus's accountants, the reference the privacy tests compare with: imported by the tests
    that call them (about 1 s of CPU), not by every test worker that collects their files."""
    import opacus.accountants
    import opacus.accountants.utils

    return opacus.accountants


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return cond()


def endpoint(transport: str, tmp_path) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    if transport == "ipc":
        return f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock"
    return f"inproc://{uuid.uuid4().hex}"


@pytest.fixture
def make_node(tmp_path) -> Iterator[Callable[..., Node]]:
    """make_node(transport="tcp", join=[...], **start_kwargs) -> a started Node, closed after the test."""
    nodes: list[Node] = []

    def make(transport: str = "tcp", join: list[str] | None = None, config: NodeConfig | None = None,
             **kwargs) -> Node:
        node = Node(config=config or NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0))
        nodes.append(node)
        return node.start(kwargs.pop("listen", None) or endpoint(transport, tmp_path), join or [], **kwargs)

    yield make
    for n in nodes:
        n.close()


ECHO_CONFIG = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0, reach_timeout_s=0.5)


@pytest.fixture
def echo_nodes() -> Iterator[Callable[..., Node]]:
    """echo_nodes(listen="tcp://127.0.0.1:0", join=[...], config=ECHO_CONFIG, **start_kwargs) -> a
    started Node that answers "echo" with {"from": its id, "got": the body}; closed after the test.
    listen=None makes a client (it listens nowhere)."""
    made: list[Node] = []

    def make(listen: str | None = "tcp://127.0.0.1:0", join: list[str] | None = None,
             config: NodeConfig = ECHO_CONFIG, **kwargs) -> Node:
        node = Node(config=config)
        made.append(node)
        node.start(listen, join or [], **kwargs)
        node.on("echo", lambda msg: {"from": node.peer_id, "got": msg.body})
        return node

    yield make
    for node in made:
        node.close()


def bench_rows(capsys) -> dict[str, list[dict]]:
    """A benchmark's JSON rows as it printed them (captured by pytest), grouped by their "bench"."""
    out: dict[str, list[dict]] = {}
    for line in capsys.readouterr().out.splitlines():
        row = json.loads(line)
        out.setdefault(row["bench"], []).append(row)
    return out


rss_mb = load_benchmark("procmem").rss_mb  # this process's resident memory, in MB


def swarm(make_node: Callable[..., Node], n: int) -> list[Node]:
    """n inproc nodes that all joined through the first and see each other alive."""
    nodes = [make_node("inproc")]
    nodes += [make_node("inproc", join=[nodes[0].address]) for _ in range(n - 1)]
    for node in nodes:
        assert wait_until(lambda node=node: len(node.live_peers()) == n - 1)
    return nodes


def join_with_state(make_node: Callable[..., Node], members: list[Node], protocol: str, model, options: dict,
                    donor) -> tuple[Node, object]:
    """A new inproc node joins `members` (through the first), sees them all alive, and starts
    `protocol` from `donor`'s state as a Trainer sends it (the donor's private state stays its own)."""
    from starling.protocols import PRIVATE_STATE, get_protocol

    node = make_node("inproc", join=[members[0].address])
    for peer in (*members, node):
        assert wait_until(lambda peer=peer: len(peer.live_peers()) == len(members))
    proto = get_protocol(protocol).create(node, model, options)
    state = donor.state_dict()
    state.pop(PRIVATE_STATE)
    proto.load_state_dict(state)
    return node, proto


def raw_dealer(address: str, identity: Identity | None = None) -> zmq.Socket:
    """A hand-driven client socket outside any Node (a stranger, unless `identity` is a member's)."""
    target = parse_address(address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A DEALER with no connection blocks its send for ever (one refused by ZAP has none): a
    # test fails with zmq.Again instead of hanging the suite.
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    if target.curve_key is not None:
        ident = identity or Identity.generate()
        sock.curve_serverkey = z85.encode(target.curve_key)
        sock.curve_publickey = ident.curve_public_z85
        sock.curve_secretkey = ident.curve_secret_z85
    sock.connect(target.endpoint)
    return sock


def linear() -> nn.Linear:
    """The protocols' toy model: a 5 -> 3 linear layer, the same initial weights every call."""
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer `rank`'s batch at `step` for `linear()`: 8 inputs and targets scaled by rank + 1."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g) * (rank + 1)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """The mean squared error of `model` on peer `rank`'s batch at `step`."""
    x, y = batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def in_parallel(fns: list) -> list:
    """Run callables in threads (one training thread per peer) and return their results."""
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn) for fn in fns]]


def lying(reducer, factor: float) -> None:
    """The owner behind `reducer` (a ShardedReducer) scales every average it signs and hands
    out by `factor` (a test-only patch of its close)."""
    finish = reducer._finish

    def lie(key, group):
        average = group.average

        def scaled(*args, **kwargs):
            avg, shares, verdict = average(*args, **kwargs)
            return avg * factor, shares, verdict
        group.average = scaled
        finish(key, group)
    reducer._finish = lie


def statuses(node: Node) -> dict[str, str]:
    return {p.id: p.status.value for p in node.peers}


def hold_against(node: Node, banned: Identity, accused: Identity) -> None:
    """Make `node.trust` hold something against two peers, on its network thread: `banned` is
    banned on verifiable evidence (`forged_part`, round 7, confirmed by a check that confirms
    anything) after 3 of its parts were screened and 1 clipped; `accused` had 2 parts refused
    and stands accused (`late_part`, round 8) by this node alone, one witness of the two a ban
    without proof needs."""
    async def on_network_thread() -> None:
        trust = node.trust
        trust.register_check("forged_part", lambda evidence: True)
        trust.note(banned.peer_id, "screened", 3)
        trust.note(banned.peer_id, "clipped")
        trust.note(accused.peer_id, "refused", 2)
        trust.accuse(Evidence("forged_part", banned.peer_id, banned.verify_key, 7))
        trust.accuse(Evidence("late_part", accused.peer_id, accused.verify_key, 8))

    node.run(on_network_thread())


@pytest.fixture
def ray_on_loopback() -> Iterator[None]:
    """Ray as a test may run it: every node it starts or dials on this machine at 127.0.0.1
    (Ray otherwise takes the address other machines would reach this one on, and dials even a
    loopback address there), and no usage report sent anywhere. Set in the environment the
    nodes and their workers inherit, and in this process's Ray, imported or not."""
    import ray._private.ray_constants as ray_constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's switch for "this machine only"
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        yield


@pytest.fixture(autouse=True)
def _cli_tests_run_in_their_own_cwd(request, tmp_path_factory, monkeypatch):
    """Every test under tests/cli runs in its own empty working directory: `starling simulate`
    without --out writes its run and plot under ./runs, which must not land in the checkout."""
    if request.node.path.parent.name == "cli":
        monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


TAIL_SHARE = 0.2  # of each worker's share: short tests only, at its end, what idle workers steal


def pytest_collection_modifyitems(config, items):
    """The slow tests spread over the xdist workers, and through each worker's share.

    pytest-xdist's worksteal hands each worker one contiguous share of this list (each
    `len(left) // workers_left` long, in order) and lets an idle worker steal from the end of a
    busy one's share. Each share gets its part of the slow multi-process tests (in file order
    one share held most of them and the run ended on a tail of heavy tests), spread through
    its first 80% between short tests: the slow ones are mostly processes importing torch
    (CPU) and many short ones wait on timers (sleep), and run at once they fill both cores;
    with the slow tests at the head of every share the box was saturated early and half idle
    at the end. The last 20% of a share is short tests, what gets stolen. Tests marked with
    one `xdist_group` stay together, on one worker: they share a module-scoped fixture too
    costly to build once per worker (the Hugging Face example's run)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    groups: dict[object, list[pytest.Item]] = {}
    fast = []
    for item in items:
        if item.get_closest_marker("slow"):
            group = item.get_closest_marker("xdist_group")
            groups.setdefault(group.args[0] if group else item.nodeid, []).append(item)
        else:
            fast.append(item)
    heads: list[list[list[pytest.Item]]] = [[] for _ in range(workers)]
    for group in groups.values():  # in file order, each to the share with the fewest so far
        min(heads, key=lambda head: sum(map(len, head))).append(group)
    ordered, left = [], len(items)
    for w, head in enumerate(heads):
        size = left // (workers - w)
        take = max(0, size - sum(map(len, head)))
        ordered += _spread(head, fast[:take])
        fast = fast[take:]
        left -= size
    items[:] = ordered + fast


def _spread(slow: list[list[pytest.Item]], short: list[pytest.Item]) -> list[pytest.Item]:
    """The slow groups, a slow one first, evenly between the short tests of the first
    1 - TAIL_SHARE of `short`; the rest of `short` after them."""
    body = len(short) - int(len(short) * TAIL_SHARE)
    out: list[pytest.Item] = []
    done = 0
    for i, group in enumerate(slow):
        out += group
        upto = body * (i + 1) // len(slow)
        out += short[done:upto]
        done = upto
    return out + short[done:]


@pytest.fixture
def procs():
    """Processes a test started: killed (a stopped one continued first) and reaped at its end."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A folder of six small text files: a corpus for the gpt task (`--data`)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for n in range(6):
        (folder / f"doc{n}.txt").write_text(f"document {n}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    return folder
