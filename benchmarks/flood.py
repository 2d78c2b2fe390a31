"""Request flood: a stranger pipelines `$status` for 30 s at a node that trains.

    python benchmarks/flood.py [--seconds 30] [--baseline-s 15] [--task charlm] [--quick]

Three processes on tcp loopback with CurveZMQ (open mode, so any key may connect):
- A, the target: a node that trains `allreduce` on `--task` with B;
- B, a member: trains with A, and every 0.1 s asks A for its status with its own identity
  (`starling node status --key B.key` does the same: a fresh connection per request);
- the flooder: one unauthenticated DEALER that sends `$status` requests as fast as A takes
  them. Its sends block only when ZeroMQ's queue toward A is full, and it reads the replies
  it gets.

The run first trains `--baseline-s` without the flood, then `--seconds` with it, so the step
time with and without the flood is measured on the same machine load. Targets:
- A's RSS grows at most 100 MB: its peak during the flood, minus its level just before;
- every status request of B during the flood is answered within 1 s (max and p99 printed);
- A's median step time during the flood is at most 2x its median before.

Prints one JSON row: the figures, the flooder's counts, A's rejection counters, and `met`.

A first row, `status_growth`, checks that stats stay bounded. `--status-calls` status
requests, each from a fresh identity (as `starling node status` sends them, paced under the
node's rate for strangers), go to a node with one member. The row gives the status reply's
size, its count of stats entries, and its latency over the first and the last 50 requests.
The target is at most 8 entries after every call: an entry per request would grow the reply
without bound (from 304 B to 346 KB after 6,000 calls).
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

from procmem import rss_mb  # a sibling script module (benchmarks/ is not a package)

RSS_TARGET_MB = 100.0
STATUS_TARGET_S = 1.0
STEP_RATIO_TARGET = 2.0
PROBE_INTERVAL_S = 0.1
# the member's membership topics and the strangers' $hello and $status, sent and received;
# not one entry per status request
STATUS_ENTRIES_TARGET = 8
RSS_INTERVAL_S = 0.1


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _trainer(node: Any, task: str, task_options: dict[str, Any], joining: bool) -> Any:
    from starling.runtime import Trainer, TrainSpec

    spec = TrainSpec.from_swarm_config(node.swarm_config) if joining else \
        TrainSpec("allreduce", task, {"lr": 0.01}, task_options, 0)
    trainer = Trainer(node, spec, 1 if joining else 0, 2)
    trainer.create_protocol()
    if joining:
        trainer.fetch_state()
    return trainer


def _train(trainer: Any, stop: Any, steps: list[float]) -> None:
    """Step until `stop`; `steps` gets the wall time at which each step ended."""
    batches = trainer.batches()
    while not stop.is_set():
        trainer.step(next(batches))
        steps.append(time.time())


def target(task: str, task_options: dict[str, Any], out: Any, stop: Any) -> None:
    """Node A: trains, samples its own RSS, and reports both."""
    import torch

    from starling.node import Node
    from starling.runtime import TrainSpec

    torch.set_num_threads(1)
    spec = TrainSpec("allreduce", task, {"lr": 0.01}, task_options, 0)
    node = Node().start("tcp://127.0.0.1:0", swarm_config=spec.to_swarm_config())
    trainer = _trainer(node, task, task_options, joining=False)
    out.put(("address", node.address))
    rss: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss.append((time.time(), rss_mb()))
            time.sleep(RSS_INTERVAL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    while not node.live_peers():
        time.sleep(0.05)
    steps: list[float] = []
    _train(trainer, stop, steps)
    done.set()
    sampler.join()
    out.put(("target", {"steps": steps, "rss": rss, "rejected": node.stats.snapshot()["rejected"]}))
    trainer.close()
    node.close()


def member(address: str, out: Any, stop: Any) -> None:
    """Node B: trains with A and asks A for its status every PROBE_INTERVAL_S."""
    import torch

    from starling.node import Node
    from starling.node.client import ClientError, query

    torch.set_num_threads(1)
    node = Node().start("tcp://127.0.0.1:0", join=[address])
    trainer = _trainer(node, "", {}, joining=True)
    probes: list[tuple[float, float | None]] = []  # (sent at, seconds to the answer or None)

    def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            sent_at = time.time()
            try:
                query(address, identity=node.identity, timeout_s=5.0)
                probes.append((sent_at, time.monotonic() - t0))
            except ClientError:
                probes.append((sent_at, None))
            time.sleep(PROBE_INTERVAL_S)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    out.put(("training", None))
    steps: list[float] = []
    _train(trainer, stop, steps)
    prober.join()
    out.put(("member", {"steps": steps, "probes": probes}))
    trainer.close()
    node.close()


def flooder(endpoint: str, server_key: bytes, frames: list[bytes], seconds: float, out: Any) -> None:
    """A stranger pipelining one `$status` request after another (its key is fresh)."""
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    sock.connect(endpoint)
    sent = replies = 0
    start = time.time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(256):
            try:
                sock.send_multipart(frames)
                sent += 1
            except zmq.Again:
                break
        while sock.poll(0):
            sock.recv_multipart()
            replies += 1
    out.put(("flood", {"start": start, "end": time.time(), "sent": sent, "replies": replies}))
    sock.close()
    context.term()


def status_growth(calls: int) -> dict[str, Any]:
    """Status requests from fresh identities: does the answer grow with them?"""
    from starling.node import Identity, Node
    from starling.node.client import ClientError, query

    a = Node().start("tcp://127.0.0.1:0")
    b = Node().start("tcp://127.0.0.1:0", join=[a.address])
    sizes: list[int] = []
    entries: list[int] = []  # (peer, topic) pairs in the answer's byte counters
    latencies: list[float] = []
    failed = 0
    try:
        for _ in range(calls):
            t0 = time.monotonic()
            try:
                answer = query(a.address, identity=Identity.generate(), timeout_s=5.0)
            except ClientError:
                failed += 1
                continue
            latencies.append(time.monotonic() - t0)
            sizes.append(len(json.dumps(answer)))
            entries.append(sum(len(topics) for key in ("bytes_sent", "bytes_received")
                               for topics in answer["stats"][key].values()))
            time.sleep(max(0.0, 1 / 150 - (time.monotonic() - t0)))  # under the strangers' 200/s
    finally:
        b.close()
        a.close()
    head, tail = min(50, len(sizes)), min(50, len(sizes))
    return {"bench": "status_growth", "calls": calls, "failed": failed,
            "status_bytes_first": sizes[0], "status_bytes_last": sizes[-1],
            "stats_entries_first": entries[0], "stats_entries_last": entries[-1],
            "median_ms_first": round(1000 * statistics.median(latencies[:head]), 2),
            "median_ms_last": round(1000 * statistics.median(latencies[-tail:]), 2),
            "met": failed == 0 and entries[-1] <= STATUS_ENTRIES_TARGET}


def _between(stamps: list[float], lo: float, hi: float) -> list[float]:
    """Durations of the steps that ended in [lo, hi)."""
    return [b - a for a, b in itertools.pairwise(stamps) if lo <= b < hi]


def _median_step(stamps: list[float], lo: float, hi: float) -> float:
    """The median step time in [lo, hi); with no step ending there, at least the whole span."""
    durations = _between(stamps, lo, hi)
    return statistics.median(durations) if durations else hi - lo


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the flood lasts")
    parser.add_argument("--baseline-s", type=float, default=15.0, help="training without the flood first")
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--status-calls", type=int, default=2000, help="for the status_growth row")
    parser.add_argument("--quick", action="store_true", help="smoke run: a 1.5 s flood, a tiny model")
    args = parser.parse_args()
    task_options: dict[str, Any] = {}
    if args.quick:
        args.seconds, args.baseline_s, args.status_calls = 1.5, 1.5, 60
        task_options = {"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16, "batch_size": 4,
                        "corpus_chars": 20_000, "eval_batches": 1}

    from zmq.utils import z85

    from starling.node.address import parse_address
    from starling.node.rpc import REQUEST_TOPIC, request_body
    from starling.node.wire import encode

    if args.status_calls > 0:
        emit(status_growth(args.status_calls))

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    a = ctx.Process(target=target, args=(args.task, task_options, out, stop))
    a.start()
    kind, address = out.get(timeout=300)
    b = ctx.Process(target=member, args=(address, out, stop))
    b.start()
    kind, _ = out.get(timeout=300)
    time.sleep(1.0 if args.quick else 3.0)  # warm up
    baseline_start = time.time()
    time.sleep(args.baseline_s)
    endpoint = parse_address(address)
    frames = [bytes(f) for f in encode(REQUEST_TOPIC, "flooder", 0, request_body("$status", 1, None))]
    f = ctx.Process(target=flooder, args=(endpoint.endpoint, z85.encode(endpoint.curve_key), frames,
                                          args.seconds, out))
    f.start()
    results: dict[str, Any] = {}
    kind, flood = out.get(timeout=args.seconds + 300)
    results[kind] = flood
    stop.set()
    for _ in range(2):
        kind, value = out.get(timeout=300)
        results[kind] = value
    for p in (a, b, f):
        p.join(60)

    flood = results["flood"]
    lo, hi = flood["start"], flood["end"]
    a_steps, b_steps = results["target"]["steps"], results["member"]["steps"]
    before = [mb for t, mb in results["target"]["rss"] if t < lo]
    during = [mb for t, mb in results["target"]["rss"] if lo <= t < hi + 1.0]
    latencies = [s for t, s in results["member"]["probes"] if lo <= t < hi]
    answered = [s for s in latencies if s is not None]
    step_a = (_median_step(a_steps, baseline_start, lo), _median_step(a_steps, lo, hi))
    step_b = (_median_step(b_steps, baseline_start, lo), _median_step(b_steps, lo, hi))
    row = {
        "bench": "flood", "task": args.task, "flood_s": round(hi - lo, 1), "baseline_s": args.baseline_s,
        "flood_sent": flood["sent"], "flood_replies": flood["replies"],
        "flood_req_per_s": round(flood["sent"] / (hi - lo)),
        "rss_before_mb": round(before[-1], 1), "rss_peak_mb": round(max(during), 1),
        "rss_growth_mb": round(max(during) - before[-1], 1),
        "status_requests": len(latencies), "status_unanswered": len(latencies) - len(answered),
        "status_max_s": round(max(answered), 3) if answered else None,
        "status_p99_s": round(_p99(answered), 3) if answered else None,
        "status_median_s": round(statistics.median(answered), 4) if answered else None,
        "steps_during": len(_between(a_steps, lo, hi)),
        "step_s_before": round(step_a[0], 4), "step_s_during": round(step_a[1], 4),
        "step_ratio": round(step_a[1] / step_a[0], 2),
        "member_step_ratio": round(step_b[1] / step_b[0], 2),
        "rejected": results["target"]["rejected"],
    }
    row["met"] = bool(row["rss_growth_mb"] <= RSS_TARGET_MB and row["status_unanswered"] == 0
                      and answered and max(answered) <= STATUS_TARGET_S and row["step_ratio"] <= STEP_RATIO_TARGET)
    emit(row)


if __name__ == "__main__":
    main()
