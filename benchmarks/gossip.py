"""`gossip` against `allreduce` on `charlm`, and the memory of hundreds of gossip peers in one process.

    python benchmarks/gossip.py                      # both parts: 15-20 minutes on 2 busy cores
    python benchmarks/gossip.py --quick              # smoke run: fewer steps, one small swarm
    python benchmarks/gossip.py --only charlm --steps 100 --local-steps 2
    python benchmarks/gossip.py --only mem --peers-mem 32,64,256 [--mem-max-dealers 16]

Prints one JSON row per measurement, then a summary row with a `met` flag per target:

- ``charlm``: `--peers` (8) peers train `--steps` steps of `charlm` with `allreduce` (the
  baseline: gradients averaged every step) and with `gossip` (the options in the row), same
  task, seed, optimizer (AdamW, lr 3e-3) and steps, in the same run. Target: gossip's eval
  loss (mean over peers, each peer's own parameters) within 5% of allreduce's, with fewer
  bytes sent per peer (protocol topics; membership traffic left out for both).
  By default gossip averages exact parameters with one random peer every 2 local steps. An
  exchange sends the parameters both ways, and a peer starts one and answers one on average
  every `local_steps` steps, so it sends about 2 x params / local_steps per step, against
  allreduce's 2 (P-1)/P x params (gradients) every step: gossip's own default,
  local_steps=1, sends more than allreduce. `allreduce_partial_peer_steps` counts (peer, step)
  pairs where an allreduce peer averaged with fewer than all peers (a round that went on
  without a slow peer); 0 is an exact baseline.
- ``mem``: for each count in `--peers-mem`, a fresh Python process runs that many `gossip`
  peers on `quadratic` (1000 parameters) in one process (the simulator's thread mode: real
  nodes over inproc, one training thread per peer) for `--mem-steps` steps, with a slow
  heartbeat (`MEM_LIVENESS`). Memory per peer is the process's RSS growth (/proc/self/statm,
  peak sampled every 20 ms, from just before the first peer's node starts) divided by the
  peers whose node started, minus the model's own bytes per peer (parameters, gradients, the
  protocol's flat gradient buffer, optimizer state). One-time costs are paid before the
  baseline (`warm_up`: torch's lazy imports, about 75 MB, and the network thread); whatever
  fixed cost is left is charged to the peers, so the number is an upper bound. A run that
  breaks (an error, or `--mem-deadline-s` passed) says at which stage, how many nodes were up,
  and the memory so far; `start_curve` shows how starting the nodes slows down with their
  number. The summary gives the marginal cost per peer between the smallest and the largest
  count. Target: under 2 MB (2,000,000 bytes) per peer at the largest count.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

LOSS_TARGET = 0.05  # relative eval-loss gap to allreduce
MEM_TARGET_BYTES = 2_000_000
OPTIMIZER = {"optimizer": "adamw", "lr": 3e-3}  # both protocols (as benchmarks/diloco.py's baseline)
GOSSIP = {"local_steps": 2, "fanout": 1, "topology": "complete", "compressor": "none"}
# A heartbeat slow enough that hundreds of nodes on one network thread stay mostly idle.
# Each ping carries the beats of every live peer (node/swarm.py), so n nodes sharing one
# network thread handle n * fanout * n digest entries per interval: ~2.5 ms of CPU per ping
# measured at 32-112 nodes. With a 5 s interval 256 nodes took more than the loaded core
# this process gets and joins starved (147-153 of 256 up after 600 s); 30 s leaves it idle.
# In a real swarm each node has its own process and pays n * fanout entries per interval.
MEM_LIVENESS = {"probe_interval_s": 30.0, "suspicion_base_s": 1200.0, "gossip_interval_s": 30.0}
MEM_JOIN_TIMEOUT_S = 60.0  # a hello answered by a network thread serving hundreds of nodes
MEM_OPTIONS = {"lr": 0.1, "local_steps": 1, "fanout": 1, "topology": "complete"}
FULL = {"steps": 100, "peers": 8, "peers_mem": "32,64,256", "mem_steps": 5}
QUICK = {"steps": 30, "peers": 8, "peers_mem": "32", "mem_steps": 3}


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------- charlm
def run_charlm(protocol: str, peers: int, steps: int, options: dict[str, Any], task_options: dict[str, Any],
               seed: int) -> dict[str, Any]:
    from starling.runtime import SimConfig, Simulation

    config = SimConfig(peers=peers, protocol=protocol, task="charlm", steps=steps, options=options,
                       task_options=task_options, seed=seed)
    started = time.monotonic()
    result = Simulation(config).run()
    summary = result.summary
    row = {"eval_loss": summary["eval_loss"], "train_loss": summary["train_loss"],
           "bytes_per_peer": summary["bytes_sent_per_peer"],
           "parameters": summary["protocol_info"].get("parameters"), "wall_s": round(summary["wall_s"], 1),
           "run_s": round(time.monotonic() - started, 1)}
    if protocol == "allreduce":  # gossip averages with a few peers by design
        row["partial_peer_steps"] = sum(1 for p in result.peers for r in p.records if r["peers"] < peers)
    return row


def charlm(args: argparse.Namespace) -> dict[str, Any]:
    task_options = json.loads(args.task_options)
    base = run_charlm("allreduce", args.peers, args.steps, OPTIMIZER, task_options, args.seed)
    emit({"bench": "run", "protocol": "allreduce", "task": "charlm", "task_options": task_options,
          "peers": args.peers, "steps": args.steps, "options": OPTIMIZER, **base})
    options = {**OPTIMIZER, **gossip_options(args)}
    mine = run_charlm("gossip", args.peers, args.steps, options, task_options, args.seed)
    emit({"bench": "run", "protocol": "gossip", "task": "charlm", "task_options": task_options,
          "peers": args.peers, "steps": args.steps, "options": options, **mine})
    gap = mine["eval_loss"] / base["eval_loss"] - 1.0
    ratio = mine["bytes_per_peer"] / base["bytes_per_peer"]
    row = {"bench": "charlm", "peers": args.peers, "steps": args.steps, "seed": args.seed,
           "task_options": task_options, "gossip_options": options,
           "allreduce_eval_loss": round(base["eval_loss"], 4), "gossip_eval_loss": round(mine["eval_loss"], 4),
           "loss_gap": round(gap, 4), "allreduce_bytes_per_peer": round(base["bytes_per_peer"]),
           "gossip_bytes_per_peer": round(mine["bytes_per_peer"]), "bytes_ratio": round(ratio, 4),
           "allreduce_partial_peer_steps": base["partial_peer_steps"],
           "target": f"loss_gap <= {LOSS_TARGET} and bytes_ratio < 1",
           "loss_met": bool(gap <= LOSS_TARGET), "bytes_met": bool(ratio < 1.0)}
    emit(row)
    return row


def gossip_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"local_steps": args.local_steps, "fanout": args.fanout, "topology": args.topology,
            "compressor": args.compressor}


# ---------------------------------------------------------------------------------------- mem
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


class PeakRss:
    """Samples the process's RSS every `interval_s` on a thread of its own; `.peak` is the max."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def model_bytes(proto: Any) -> int:
    """What one peer's model costs: parameters, their gradients, the protocol's flat buffers
    (gradient; CHOCO's public copy) and the optimizer's state."""
    import torch

    total = 0
    for p in proto.model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    flat = getattr(proto, "flat", None)
    for buffer in (getattr(flat, "grad", None), getattr(proto, "x_hat", None)):
        if isinstance(buffer, torch.Tensor):
            total += buffer.numel() * buffer.element_size()
    for state in proto.optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def warm_up(task: Any, peers: int, seed: int) -> None:
    """Pay the process's one-time costs before the baseline RSS: torch's lazy imports on the
    first optimizer (torch._dynamo, about 75 MB), the first backward, and the network thread
    with its ZeroMQ context (started by the first node)."""
    from starling.node.node import Node, NodeConfig
    from starling.protocols.optim import make_optimizer

    model = task.make_model()
    optimizer = make_optimizer(list(model.parameters()), "sgd", 0.1, 0.0, 0.0)
    task.loss(model, next(task.batches(0, peers, seed))).backward()
    optimizer.step()
    task.evaluate(model)
    Node(config=NodeConfig()).start(f"inproc://warm-up-{uuid.uuid4().hex[:8]}", [], security="plaintext").close()


def mem_child(peers: int, steps: int, deadline_s: float, max_dealers: int | None = None) -> dict[str, Any]:
    """In this (fresh) process: `peers` gossip peers on quadratic, RSS at each phase. Gives up
    after `deadline_s` and reports how far it got. The nodes are left open: the process is
    meant to exit right after (closing hundreds of nodes one by one takes minutes)."""
    import torch
    import zmq

    import starling.protocols  # noqa: F401  (registers the protocols before the baseline RSS)
    from starling.node.loop import NetworkThread
    from starling.node.swim import Liveness
    from starling.node.transport import TransportConfig
    from starling.runtime import SimConfig, SimPeer, check_config, endpoint_for, wait_for
    from starling.tasks import get_task

    config = SimConfig(peers=peers, protocol="gossip", task="quadratic", steps=steps, options=MEM_OPTIONS,
                       liveness=Liveness(**MEM_LIVENESS), join_timeout_s=MEM_JOIN_TIMEOUT_S)
    check_config(config)
    task = get_task(config.task, **config.task_options)
    out: dict[str, Any] = {"peers": peers, "steps": steps,
                           "max_open_dealers": max_dealers or getattr(TransportConfig(), "max_open_dealers", None),
                           "zmq_max_sockets": NetworkThread.get().context.get(zmq.MAX_SOCKETS), "nodes_up": 0}
    warm_up(task, peers, config.seed)
    torch.set_num_threads(1)
    gc.collect()
    phases: dict[str, int] = {"base": rss_bytes()}
    timings: dict[str, float] = {}
    sampler = PeakRss()
    started = time.monotonic()
    deadline = started + deadline_s

    def left_s() -> float:
        return max(deadline - time.monotonic(), 0.0)

    run_id = uuid.uuid4().hex[:8]
    sims = [SimPeer(config, task, rank, endpoint_for("inproc", rank, "", run_id)) for rank in range(peers)]
    if max_dealers is not None:
        for sim in sims:
            sim.node.config = dataclasses.replace(sim.node.config, transport=dataclasses.replace(
                sim.node.config.transport, max_open_dealers=max_dealers))
    out["start_curve"] = curve = []  # [nodes up, seconds since the first started, RSS] every 32 nodes
    stage = "start nodes"
    try:
        address = sims[0].start([])
        for sim in sims:
            if sim is not sims[0]:
                if not left_s():
                    raise TimeoutError(f"{deadline_s:g} s deadline")
                sim.start([address])
            out["nodes_up"] += 1
            if out["nodes_up"] % 32 == 0:
                curve.append([out["nodes_up"], round(time.monotonic() - started, 1), rss_bytes()])
        phases["nodes_started"] = rss_bytes()
        timings["start_s"] = time.monotonic() - started
        stage = "form the swarm"
        wait_for(lambda: all(len(s.node.live_peers()) == peers - 1 for s in sims), left_s(),
                 f"{peers} peers to see each other")
        phases["swarm_formed"] = rss_bytes()
        timings["form_s"] = time.monotonic() - started - timings["start_s"]
        stage = "create protocols"
        for sim in sims:
            sim.create_protocol()
        phases["protocols"] = rss_bytes()
        stage = "train"
        t0 = time.time()
        threads = [threading.Thread(target=s.train, args=(t0,), name=f"sim-peer-{s.rank}", daemon=True)
                   for s in sims]
        for thread in threads:
            thread.start()
        out["threads_peak"] = os_threads()
        for thread in threads:
            thread.join(left_s())
        if any(thread.is_alive() for thread in threads):
            raise TimeoutError(f"{deadline_s:g} s deadline; {sum(s.step for s in sims)} of {peers * steps} steps done")
        timings["train_s"] = time.time() - t0
        phases["trained"] = rss_bytes()
        failed = [s.result for s in sims if s.result.status != "finished"]
        if failed:
            raise RuntimeError(f"{len(failed)} peers did not finish; peer {failed[0].rank}: {failed[0].error}")
        for sim in sims:
            sim.collect()
        out["model_bytes_per_peer"] = statistics.fmean(model_bytes(s.proto) for s in sims)
        out["parameters"] = sims[0].proto.flat.numel  # type: ignore[union-attr]
        out["eval_loss"] = statistics.fmean(s.result.eval_loss for s in sims)  # type: ignore[misc]
        out["bytes_per_peer"] = statistics.fmean(s.result.bytes_sent for s in sims)
        out["open_dealers_per_node"] = statistics.fmean(_open_dealers(s.node) for s in sims)
        out["known_peers_per_node"] = statistics.fmean(len(s.node.peers) for s in sims)
        out["ok"] = True
    except Exception as exc:  # report where it broke, with the memory and time so far
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}", stage=stage)
    out["peak_rss"] = sampler.stop()
    timings["total_s"] = time.monotonic() - started
    out["rss"] = phases
    out["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    growth = out["peak_rss"] - phases["base"]
    up = max(out["nodes_up"], 1)  # the peers that got as far as a running node
    out["rss_growth_per_peer"] = round(growth / up)
    out["per_peer_beyond_model"] = round(growth / up - out.get("model_bytes_per_peer", 0.0))
    out["thread_stack_size"] = threading.stack_size()  # 0: the platform default (RLIMIT_STACK below)
    out["rlimit_stack"] = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return out


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _open_dealers(node: Any) -> int:
    transport = node._transport  # a diagnostic: how many DEALER sockets this node holds
    count = getattr(transport, "open_dealers", None)
    return count if isinstance(count, int) else len(transport._dealers)


def mem(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(n) for n in str(args.peers_mem).split(",") if n.strip()]
    rows = []
    for peers in counts:
        command = [sys.executable, os.path.abspath(__file__), "--mem-child", str(peers),
                   "--mem-steps", str(args.mem_steps), "--mem-deadline-s", str(args.mem_deadline_s)]
        if args.mem_max_dealers is not None:
            command += ["--mem-max-dealers", str(args.mem_max_dealers)]
        started = time.monotonic()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=args.mem_deadline_s + 300)
        except subprocess.TimeoutExpired as exc:
            child = {"peers": peers, "ok": False, "error": f"no answer in {exc.timeout:g} s",
                     "stderr_tail": _text(exc.stderr)[-2000:]}
        else:
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                child = {"peers": peers, "ok": False, "error": f"exit code {proc.returncode}",
                         "stderr_tail": proc.stderr[-2000:]}
            else:
                child = json.loads(lines[-1])
        row = {"bench": "mem", "task": "quadratic", "protocol": "gossip", "options": MEM_OPTIONS,
               "liveness": MEM_LIVENESS, **child, "process_s": round(time.monotonic() - started, 1)}
        row["met"] = bool(row.get("ok") and row["per_peer_beyond_model"] < MEM_TARGET_BYTES)
        emit(row)
        rows.append(row)
    done = [r for r in rows if r.get("ok")]
    summary: dict[str, Any] = {"bench": "mem_scaling", "counts": counts, "target_bytes": MEM_TARGET_BYTES,
                               "all_ok": all(r.get("ok") for r in rows) and bool(rows)}
    if len(done) >= 2:  # between the smallest and the largest count that ran to the end
        small, large = done[0], done[-1]
        summary["marginal_between"] = [small["peers"], large["peers"]]
        summary["marginal_bytes_per_peer"] = round((large["peak_rss"] - large["rss"]["base"]
                                                    - small["peak_rss"] + small["rss"]["base"])
                                                   / (large["peers"] - small["peers"]))
    summary["per_peer_beyond_model"] = {str(r["peers"]): r.get("per_peer_beyond_model") for r in rows}
    summary["met"] = bool(rows and rows[-1].get("met", False))
    emit(summary)
    return summary


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small run for a smoke test")
    parser.add_argument("--only", default="charlm,mem", help="comma-separated parts: charlm, mem")
    parser.add_argument("--steps", type=int, default=None, help="charlm steps (both protocols)")
    parser.add_argument("--peers", type=int, default=None, help="charlm peers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task-options", default="{}", help="charlm options as JSON, e.g. '{\"n_embd\": 32}'")
    parser.add_argument("--local-steps", type=int, default=GOSSIP["local_steps"])
    parser.add_argument("--fanout", type=int, default=GOSSIP["fanout"])
    parser.add_argument("--topology", default=GOSSIP["topology"])
    parser.add_argument("--compressor", default=GOSSIP["compressor"], help="none (exact averaging) or a spec (CHOCO)")
    parser.add_argument("--peers-mem", default=None, help="comma-separated peer counts for the memory part")
    parser.add_argument("--mem-steps", type=int, default=None)
    parser.add_argument("--mem-max-dealers", type=int, default=None,
                        help="cap on open DEALER sockets per node (default: the transport's own)")
    parser.add_argument("--mem-deadline-s", type=float, default=300.0,
                        help="one memory run gives up after this and reports how far it got")
    parser.add_argument("--mem-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.mem_child is not None:
        emit(mem_child(args.mem_child, args.mem_steps, args.mem_deadline_s, args.mem_max_dealers))
        sys.stdout.flush()
        os._exit(0)  # without closing the nodes (see mem_child)
    parts = set(args.only.split(","))
    started = time.monotonic()
    summary: dict[str, Any] = {"bench": "summary"}
    if "charlm" in parts:
        row = charlm(args)
        summary.update(charlm_loss_met=row["loss_met"], charlm_bytes_met=row["bytes_met"])
    if "mem" in parts:
        summary["mem_met"] = mem(args)["met"]
    summary["benchmark_s"] = round(time.monotonic() - started, 1)
    emit(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
