"""Shared-seed SPSA: bytes per projected gradient, loss against MeZO, replay cost, digests.

    python benchmarks/spsa.py [--quick] [--only bytes,loss,replay,digest,defaults] [--peers 8]
                              [--samples 128] [--loss-steps 150] [--digest-steps 1000]
                              [--defaults-task teacher] [--defaults-steps 100] [--defaults-samples 1,64]

Prints one JSON row per measurement. Targets checked:
- ``bytes``: ``--peers`` nodes over tcp on loopback (plaintext, as the simulator runs them)
  train with ``--samples`` projected gradients per peer per step. Bytes are read from the
  kernel's per-socket counters (``ss -ti``: bytes_sent of every TCP connection that touches one
  of the nodes' ports), so they include ZeroMQ and Starling framing. The figure is socket bytes
  per delivered projected gradient (each reaches peers - 1 peers): target <= 1.5. Heartbeats
  are paused during the count (one round at start): they are membership's fixed cost per
  second, measured separately on an idle swarm with the default 1 s interval and added back in
  ``bytes_per_gradient_with_heartbeats`` at this run's pace. Baseline, on the same sockets:
  each gradient sent to each peer as its own message (one float per message).
- ``loss``: ``teacher`` with ``--peers`` peers for ``--loss-steps`` steps against single-peer MeZO
  (float g, same perturbation code) for peers x steps steps: the same number of forward passes.
  Eval loss every tenth of the run; the SPSA curve, smoothed over 3 points, must not rise.
- ``replay``: applying one step's record with ``--peers`` contributors (what every peer does
  for the others' bytes) against one single-peer MeZO step (two forwards, perturb and restore,
  update), in ``shared`` mode (target <= 2x) and ``per-peer`` mode (reported).
- ``digest``: ``--peers`` peers for ``--digest-steps`` steps (per-peer directions); every peer's
  parameter digest must agree at the end.
- ``defaults``: what ``starling simulate --protocol spsa`` reports, for each of
  ``--defaults-samples`` (the protocol's defaults otherwise): ``--peers`` simulated peers on
  ``--defaults-task`` for ``--defaults-steps`` steps, eval loss at each quarter of the run, and
  the summary's ``bytes_per_projected_gradient`` (protocol bytes as the nodes counted them, per
  code delivered to one peer). Not run by default: only on ``--only defaults``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from starling.node import Message, Node
from starling.node.node import NodeConfig
from starling.node.swim import Liveness
from starling.protocols import get_protocol
from starling.protocols.spsa.arith import ParamSpace, direction_seed, peer_key
from starling.protocols.spsa.records import Record
from starling.runtime import SimConfig, Simulation
from starling.tasks import get_task

BYTES_TARGET = 1.5
REPLAY_TARGET = 2.0
# Lenient failure detection: the benchmark shares 2 cores with 8 training threads.
LIVENESS = Liveness(probe_interval_s=1.0, suspicion_base_s=60.0)
# For counting protocol bytes: one heartbeat round at start, then none during the run.
QUIET = Liveness(probe_interval_s=600.0, suspicion_base_s=2400.0)
FULL = {"samples": 128, "byte_steps": 12, "loss_steps": 150, "digest_steps": 1000, "replay_repeats": 30}
QUICK = {"samples": 128, "byte_steps": 4, "loss_steps": 40, "digest_steps": 150, "replay_repeats": 8}
TINY_TEACHER = {"hidden": 16, "depth": 1, "teacher_hidden": 16}
IDLE_WINDOW_S = 5.0


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


# ------------------------------------------------------------------ swarm helpers
def start_swarm(n: int, transport: str, liveness: Liveness = LIVENESS) -> list[Node]:
    config = NodeConfig(liveness=liveness, request_timeout_s=30.0)
    listen = "tcp://127.0.0.1:0" if transport == "tcp" else None
    nodes: list[Node] = []
    for i in range(n):
        endpoint = listen or f"inproc://bench-spsa-{time.monotonic_ns()}-{i}"
        nodes.append(Node(config=config).start(endpoint, [nodes[0].address] if nodes else [], security="plaintext"))
    deadline = time.monotonic() + 60
    while any(len(node.live_peers()) < n - 1 for node in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("swarm did not form")
        time.sleep(0.05)
    return nodes


def in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def train_to(proto: Any, task: Any, rank: int, world: int, steps: int) -> None:
    torch.set_num_threads(1)
    batches = task.batches(rank, world, 0)
    while proto.step_count < steps:
        batch = next(batches)
        proto.step(lambda: task.loss(proto.model, batch))


def socket_bytes(ports: set[int]) -> int:
    """Bytes sent, per the kernel, over every TCP connection that touches one of `ports`
    (each connection's two ends live in this process, so each byte is counted once)."""
    out = subprocess.run(["ss", "-tinHn", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    total, ours = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():
            fields = line.split()
            ours = any(int(addr.rsplit(":", 1)[1]) in ports for addr in fields[2:4])
        elif ours:
            match = re.search(r"bytes_sent:(\d+)", line)
            total += int(match.group(1)) if match else 0
    return total


def tcp_ports(nodes: list[Node]) -> set[int]:
    return {int(node.address.split("#")[0].rsplit(":", 1)[1]) for node in nodes}


# ------------------------------------------------------------------ bytes
def bench_bytes(peers: int, samples: int, steps: int) -> None:
    task = get_task("quadratic", dim=64, noise_std=0.1)
    nodes = start_swarm(peers, "tcp", QUIET)
    ports = tcp_ports(nodes)
    try:
        options = {"lr": 1e-3, "samples": samples, "round_timeout_s": 60.0}
        protos = [get_protocol("spsa").create(node, task.make_model(), options) for node in nodes]
        in_threads([lambda r=r: train_to(protos[r], task, r, peers, 2) for r in range(peers)])  # warm up
        first = min(p.step_count for p in protos)
        wire0, app0 = socket_bytes(ports), sum(n.stats.total_sent("spsa.") for n in nodes)
        t0 = time.monotonic()
        in_threads([lambda r=r: train_to(protos[r], task, r, peers, first + steps) for r in range(peers)])
        time.sleep(0.2)
        wire, wall = socket_bytes(ports) - wire0, time.monotonic() - t0
        app = sum(n.stats.total_sent("spsa.") for n in nodes) - app0
        records = [r for r in protos[0].log_records(first) if r.step < first + steps]
        deliveries = sum(len(r.keys) * samples * (peers - 1) for r in records)
        plain = plain_floats(nodes, ports, samples, steps=2)
    finally:
        for node in nodes:
            node.close()
    beat_rate = heartbeat_rate(peers)
    per_gradient = wire / deliveries
    emit({"bench": "bytes", "transport": "tcp", "security": "plaintext", "peers": peers, "samples": samples,
          "steps": len(records), "delivered_gradients": deliveries, "socket_bytes": wire,
          "bytes_per_gradient": round(per_gradient, 4), "app_bytes_per_gradient": round(app / deliveries, 4),
          "wall_s": round(wall, 1), "heartbeat_bytes_per_s": round(beat_rate, 1),
          "bytes_per_gradient_with_heartbeats": round((wire + beat_rate * wall) / deliveries, 4),
          "baseline_bytes_per_gradient": round(plain, 2), "vs_baseline": round(per_gradient / plain, 4),
          "target": BYTES_TARGET, "met": per_gradient <= BYTES_TARGET})


def heartbeat_rate(peers: int) -> float:
    """Socket bytes per second of an idle swarm with default 1 s heartbeats carrying spsa's
    metadata: membership's fixed cost, which the bytes bench leaves out of its figure."""
    nodes = start_swarm(peers, "tcp")
    try:
        for node in nodes:
            node.set_meta(spsa_leader=min(n.peer_id for n in nodes), spsa_step=123456)
        ports = tcp_ports(nodes)
        time.sleep(2 * LIVENESS.probe_interval_s)
        wire0, t0 = socket_bytes(ports), time.monotonic()
        time.sleep(IDLE_WINDOW_S)
        return (socket_bytes(ports) - wire0) / (time.monotonic() - t0)
    finally:
        for node in nodes:
            node.close()


def plain_floats(nodes: list[Node], ports: set[int], samples: int, steps: int) -> float:
    """Socket bytes per gradient when every gradient goes to every peer as its own message."""
    received = [0]
    lock = threading.Lock()
    expected = len(nodes) * (len(nodes) - 1) * samples * steps

    def on_float(msg: Message) -> None:
        with lock:
            received[0] += 1

    for node in nodes:
        node.on("plain.g", on_float)
    rnd = random.Random(0)
    wire0 = socket_bytes(ports)

    def send_all(node: Node) -> None:
        for t in range(steps):
            futures = [node.send(peer, "plain.g", [t, s, rnd.gauss(0.0, 1.0)])
                       for s in range(samples) for peer in node.live_peers()]
            for fut in futures:
                fut.result(60)

    in_threads([lambda n=n: send_all(n) for n in nodes])
    deadline = time.monotonic() + 60
    while received[0] < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return (socket_bytes(ports) - wire0) / received[0]


# ------------------------------------------------------------------ loss
def mezo(task: Any, steps: int, lr: float, eps: float, evals: int) -> list[float]:
    """Single-peer MeZO with a float g (the reference), same perturbation code as spsa."""
    model = task.make_model()
    model.eval()
    space = ParamSpace(model, "", 1 << 18, eps, 1.0)
    space.snap()
    batches = task.batches(0, 1, 0)
    curve = []
    for t in range(steps):
        batch = next(batches)
        seed = direction_seed(0, t, 0, None)
        with torch.no_grad():
            space.perturb(seed, "rademacher", +1)
            plus = float(task.loss(model, batch))
            space.perturb(seed, "rademacher", -2)
            minus = float(task.loss(model, batch))
            space.perturb(seed, "rademacher", +1)
        space.update([(seed, -lr * (plus - minus) / (2 * eps))], "rademacher")
        if (t + 1) % (steps // evals) == 0:
            curve.append(task.evaluate(model)["eval_loss"])
    return curve


def spsa_curve(task: Any, peers: int, steps: int, options: dict[str, Any], evals: int) -> tuple[list[float], int]:
    nodes = start_swarm(peers, "inproc")
    try:
        protos = [get_protocol("spsa").create(node, task.make_model(), options) for node in nodes]
        curve = []
        for k in range(1, evals + 1):
            in_threads([lambda r=r: train_to(protos[r], task, r, peers, k * steps // evals) for r in range(peers)])
            curve.append(task.evaluate(protos[0].eval_model())["eval_loss"])
        return curve, len({p.digest() for p in protos})
    finally:
        for node in nodes:
            node.close()


def smoothed_monotone(curve: list[float], window: int = 3) -> bool:
    smooth = [statistics.fmean(curve[max(0, i - window + 1):i + 1]) for i in range(len(curve))]
    return all(b <= a + 1e-6 for a, b in itertools.pairwise(smooth))


def bench_loss(peers: int, steps: int, lr: float, eps: float) -> None:
    task = get_task("teacher", hidden=32, depth=1)
    evals = 10
    t0 = time.monotonic()
    reference = mezo(task, peers * steps, lr, eps, evals)
    mezo_s = time.monotonic() - t0
    start = task.evaluate(task.make_model())["eval_loss"]
    for directions, spsa_lr in (("per-peer", lr * peers), ("shared", lr * peers)):
        t0 = time.monotonic()
        curve, digests = spsa_curve(task, peers, steps, {"lr": spsa_lr, "eps": eps, "directions": directions,
                                                         "round_timeout_s": 60.0}, evals)
        emit({"bench": "loss", "task": "teacher(hidden=32, depth=1)", "directions": directions, "peers": peers,
              "steps": steps, "forward_passes": 2 * peers * steps, "lr": spsa_lr, "mezo_lr": lr, "eps": eps,
              "start_eval_loss": round(start, 4), "spsa_eval_loss": [round(x, 4) for x in curve],
              "mezo_eval_loss": [round(x, 4) for x in reference], "spsa_final": round(curve[-1], 4),
              "mezo_final": round(reference[-1], 4), "monotone_smoothed": smoothed_monotone([start, *curve]),
              "lowered": curve[-1] < start, "distinct_digests": digests,
              "wall_s": round(time.monotonic() - t0, 1), "mezo_wall_s": round(mezo_s, 1)})


# ------------------------------------------------------------------ replay
def bench_replay(peers: int, repeats: int) -> None:
    for label, options in (("teacher", {}), ("teacher(hidden=512)", {"hidden": 512})):
        task = get_task("teacher", **options)
        batch = next(task.batches(0, 1, 0))
        times: dict[str, list[float]] = {"mezo": [], "shared": [], "per-peer": []}
        node = Node(config=NodeConfig(liveness=LIVENESS)).start(f"inproc://bench-replay-{time.monotonic_ns()}")
        try:
            protos = {mode: get_protocol("spsa").create(node, task.make_model(), {"directions": mode})
                      for mode in ("shared", "per-peer")}
            reference = get_protocol("spsa").create(node, task.make_model(), {})  # its space, for MeZO
            space, model = reference.space, reference.model
            model.eval()
            keys = tuple(sorted(peer_key(f"peer-{i}") for i in range(peers)))
            rnd = random.Random(0)
            for _ in range(repeats):  # interleaved, so that every kind sees the same machine load
                t0 = time.perf_counter()
                seed = direction_seed(0, 0, 0, None)
                with torch.no_grad():
                    space.perturb(seed, "rademacher", +1)
                    plus = float(task.loss(model, batch))
                    space.perturb(seed, "rademacher", -2)
                    minus = float(task.loss(model, batch))
                    space.perturb(seed, "rademacher", +1)
                space.update([(seed, -1e-9 * (plus - minus))], "rademacher")
                times["mezo"].append(time.perf_counter() - t0)
                for mode, proto in protos.items():
                    codes = bytes(rnd.choice((1, -1)) * rnd.randrange(40, 90) & 0xFF for _ in range(peers))
                    record = Record(proto.step_count, "bench", keys, codes)
                    t0 = time.perf_counter()
                    proto.replay([record])
                    times[mode].append(time.perf_counter() - t0)
            mezo_s = statistics.median(times["mezo"])
            for mode in ("shared", "per-peer"):
                ratio = statistics.median(times[mode]) / mezo_s
                emit({"bench": "replay", "model": label, "parameters": space.numel, "mode": mode, "peers": peers,
                      "replay_ms": round(statistics.median(times[mode]) * 1e3, 3),
                      "mezo_step_ms": round(mezo_s * 1e3, 3), "ratio": round(ratio, 3),
                      "target": REPLAY_TARGET if mode == "shared" else None,
                      "met": ratio <= REPLAY_TARGET if mode == "shared" else None})
        finally:
            node.close()


# ------------------------------------------------------------------ digest
def bench_digest(peers: int, steps: int) -> None:
    task = get_task("teacher", **TINY_TEACHER)
    nodes = start_swarm(peers, "inproc")
    try:
        options = {"lr": 1e-2, "directions": "per-peer", "round_timeout_s": 60.0, "digest_every": 16}
        protos = [get_protocol("spsa").create(node, task.make_model(), options) for node in nodes]
        t0 = time.monotonic()
        in_threads([lambda r=r: train_to(protos[r], task, r, peers, steps) for r in range(peers)])
        digests = {p.digest() for p in protos}
        counters = [dict(p.counters) for p in protos]
        emit({"bench": "digest", "peers": peers, "steps": steps, "directions": "per-peer",
              "distinct_digests": len(digests), "repairs": sum(c.get("repairs", 0) for c in counters),
              "lineage_switches": sum(c.get("lineage_switches", 0) for c in counters),
              "wall_s": round(time.monotonic() - t0, 1), "target": "1 digest", "met": len(digests) == 1})
    finally:
        for node in nodes:
            node.close()


# ------------------------------------------------------------------ defaults
def bench_defaults(peers: int, task: str, steps: int, samples: list[int]) -> None:
    made = get_task(task)
    start = made.evaluate(made.make_model())["eval_loss"]
    for n in samples:
        config = SimConfig(peers=peers, protocol="spsa", task=task, steps=steps, options={"samples": n},
                           eval_every=max(1, steps // 4))
        result = Simulation(config).run()
        s = result.summary
        evals = [(r["step"] + 1, round(r["eval_loss"], 4)) for r in result.peers[0].records if "eval_loss" in r]
        emit({"bench": "defaults", "task": task, "peers": peers, "steps": steps, "samples": n,
              "forward_passes_per_peer": 2 * n * steps, "start_eval_loss": round(start, 4),
              "eval_loss_at_step": evals,
              "eval_loss": round(s["eval_loss"], 4), "train_loss": round(s["train_loss"], 4),
              "bytes_per_projected_gradient": round(s["bytes_per_projected_gradient"], 3),
              "projected_gradients_delivered": s["projected_gradients_delivered"],
              "bytes_sent_per_peer": s["bytes_sent_per_peer"], "wall_s": round(s["wall_s"], 1)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test of every bench)")
    parser.add_argument("--only", default="bytes,loss,replay,digest", help="comma-separated benches to run")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None, help="projected gradients per peer per step (bytes)")
    parser.add_argument("--loss-steps", type=int, default=None)
    parser.add_argument("--digest-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=3e-3, help="MeZO's learning rate; spsa uses peers x lr")
    parser.add_argument("--eps", type=float, default=1e-3)
    parser.add_argument("--defaults-task", default="teacher", help="task of the defaults bench")
    parser.add_argument("--defaults-steps", type=int, default=100, help="steps of the defaults bench")
    parser.add_argument("--defaults-samples", default="1,64", help="samples values the defaults bench compares")
    args = parser.parse_args()
    sizes = dict(QUICK if args.quick else FULL)
    for name in ("samples", "loss_steps", "digest_steps"):
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    torch.set_num_threads(1)
    only = set(args.only.split(","))
    if "bytes" in only:
        bench_bytes(args.peers, sizes["samples"], sizes["byte_steps"])
    if "replay" in only:
        bench_replay(args.peers, sizes["replay_repeats"])
    if "loss" in only:
        bench_loss(args.peers, sizes["loss_steps"], args.lr, args.eps)
    if "digest" in only:
        bench_digest(args.peers, sizes["digest_steps"])
    if "defaults" in only:
        bench_defaults(args.peers, args.defaults_task, args.defaults_steps,
                       [int(n) for n in args.defaults_samples.split(",")])


if __name__ == "__main__":
    main()
