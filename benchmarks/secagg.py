"""Federated mode: secure aggregation inside the sharded all-reduce, dropouts killed with
SIGKILL, and sampled clients on non-IID data.

    python benchmarks/secagg.py [--only secure|dropout|sampling] [--protocols allreduce,streaming-diloco]
                                [--peers 16] [--clients 1000] [--fraction 0.1]

Secure (`secure` rows). `--peers` simulated peers train `charlm` with `allreduce` (30 steps)
and `streaming-diloco` (40 steps, H 10, 2 fragments, compressor none: secure aggregation
encodes parts itself), with `--secure-aggregation on` and without, twice each in alternating
order: eval loss of each run (equal within the ring's rounding: at the scale fitted to 16
members, 2^22, an average moves by at most 0.5 / 2^22 a value), bytes sent per peer and the
median step's wall time, and the ratios secure / plain. Targets: bytes <= 1.25x, step time <= 1.5x.

Precision (`precision` rows). The relative error of a secure average against the float one,
chunk by chunk, on real gradients (`charlm`; `teacher`'s small MLP) for 4, 16 and 64 members,
at a fixed scale 2^16 and at the scale fitted to the round's members. Target: <= 1e-4.

Dropout (`dropout` rows). `--peers` real processes, one node each on loopback tcp, average a
vector the size of `charlm`'s (110,464 values) with secure aggregation every round; in round 4
two of them are SIGKILLed as soon as they have masked and dealt their shares (their parts on
the wire). Each survivor checks every chunk it got back against the mean of the vectors of
the members that could have contributed (every member draws every vector from a shared
seed); the row reports whether the round of the kill and every later one completed with the
survivors' sum, and the groups owners dropped.

Sampling (`sampling` rows). `--clients` simulated peers (2 processes) train `diloco` (H 5, 20
steps) on the `teacher` task partitioned `dirichlet:0.5`, with `--fraction` of them drawn per
round, against the same swarm with every peer in every round: whether the run completes, the
participation the summary reports, how many parts each merge held, eval loss and wall time of
each; then the same rounds computed in one process (`fedavg`: every drawn part in every merge,
unquantized) as the reference both networked runs are read against.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from starling.collectives.secagg import discrete_gaussian
from starling.collectives.secure import SecureAggregation
from starling.node.identity import Identity
from starling.runtime import SimConfig, Simulation


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def step_wall(result: Any) -> float:
    """The median step's wall time over every peer's steps after its first (which includes
    the swarm settling)."""
    walls = [r["step_wall_s"] for peer in result.peers for r in peer.records[1:] if "step_wall_s" in r]
    return statistics.median(walls) if walls else float("nan")


SECURE_RUNS = {
    "allreduce": {"steps": 30, "options": {}},
    "streaming-diloco": {"steps": 40, "options": {"compressor": "none", "sync_every": 10, "fragments": 2}},
}


def secure(protocol: str, peers: int = 16, repeats: int = 2) -> None:
    """One protocol on `charlm` with and without secure aggregation, `repeats` times each in
    alternating order (the machine is shared): eval loss, bytes per peer and the median step's
    wall time of each, and the ratios."""
    spec = SECURE_RUNS[protocol]
    runs: dict[str, list[Any]] = {"plain": [], "secure": []}
    for i in range(repeats):
        for label in ("plain", "secure") if i % 2 == 0 else ("secure", "plain"):
            options = {**spec["options"], **({"secure_aggregation": "on"} if label == "secure" else {})}
            config = SimConfig(peers=peers, protocol=protocol, steps=spec["steps"], task="charlm", options=options)
            runs[label].append(Simulation(config).run())
    row: dict[str, Any] = {"row": "secure", "protocol": protocol, "peers": peers, "steps": spec["steps"],
                           "options": spec["options"], "repeats": repeats}
    for label, results in runs.items():
        row[label] = {"eval_loss": [round(r.summary["eval_loss"], 5) for r in results],
                      "bytes_sent_per_peer": round(statistics.mean(r.summary["bytes_sent_per_peer"] for r in results)),
                      "step_wall_s": [round(step_wall(r), 4) for r in results],
                      "final_peers": [r.summary["final_peers"] for r in results]}
    plain, masked = runs["plain"], runs["secure"]
    row["eval_loss_diff"] = round(max(abs(a.summary["eval_loss"] - b.summary["eval_loss"])
                                      for a, b in zip(plain, masked)), 6)
    row["bytes_ratio"] = round(row["secure"]["bytes_sent_per_peer"] / row["plain"]["bytes_sent_per_peer"], 4)
    row["step_time_ratio"] = round(statistics.median(step_wall(r) for r in masked)
                                   / statistics.median(step_wall(r) for r in plain), 3)
    codec = SecureAggregation().codec(peers)
    row["scale"], row["clip"], row["max_error_of_average"] = codec.scale, codec.clip, 0.5 / codec.scale
    emit(row)


def _gradients(task_name: str, members: int) -> list[torch.Tensor]:
    """One flat gradient per member, of the task's model at its initial weights on each member's
    own first batch."""
    from starling.tasks import get_task

    task = get_task(task_name)
    model = task.make_model()
    out = []
    for rank in range(members):
        model.zero_grad()
        task.loss(model, next(task.batches(rank, members, 0))).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    return out


def precision(members_list: tuple[int, ...] = (4, 16, 64), chunk: int = 1 << 14) -> list[dict[str, Any]]:
    """The relative error of a secure average against the float one, chunk by chunk, on real
    gradients (`charlm`, and `teacher`'s small MLP), at the old fixed scale 2^16 and at the
    fitted one. The masks cancel exactly (every other test checks that), so the ring's
    rounding is the whole error: each member's gradient is encoded, the integers are summed
    modulo 2^32, and the sum is decoded, as an owner does. Target: <= 1e-4 in every chunk."""
    rows = []
    for task_name in ("charlm", "teacher"):
        for members in members_list:
            grads = _gradients(task_name, members)
            exact = torch.stack(grads).to(torch.float64).mean(0)
            row: dict[str, Any] = {"row": "precision", "task": task_name, "members": members,
                                   "numel": exact.numel(), "chunk": chunk,
                                   "rms_of_average": float(exact.pow(2).mean().sqrt())}
            for label, config in (("fixed_2^16", SecureAggregation(scale=2.0**16)), ("fitted", SecureAggregation())):
                codec = config.codec(members)
                total = np.zeros(exact.numel(), dtype=np.uint32)
                for g in grads:
                    np.add(total, codec.encode(g), out=total)
                got = codec.decode_sum(total, members).to(torch.float64) / members
                errors = []
                for lo in range(0, exact.numel(), chunk):
                    want = exact[lo:lo + chunk]
                    norm = float(want.norm())
                    if norm > 0:
                        errors.append(float((got[lo:lo + chunk] - want).norm()) / norm)
                row[label] = {"scale": codec.scale, "max_chunk_rel_error": max(errors),
                              "median_chunk_rel_error": statistics.median(errors)}
            row["met"] = row["fitted"]["max_chunk_rel_error"] <= 1e-4
            emit(row)
            rows.append(row)
    return rows


def distributed_dp(peers: int = 16, sigma: float = 1.0, rounds: int = 100, steps: int = 30) -> None:
    """Opacus' epsilon for the members' noise shares against the same total noise added
    centrally, the shares' sum measured, and sketch-dp trained both ways."""
    from opacus.accountants import RDPAccountant

    codec = SecureAggregation().codec(peers)
    share = sigma / math.sqrt(peers)  # each member's std, in the release's units (C = 1)
    total = math.sqrt(peers * share**2)  # the sum's std: what the accountant is given
    central, distributed = RDPAccountant(), RDPAccountant()
    for _ in range(rounds):
        central.step(noise_multiplier=sigma, sample_rate=1.0)
        distributed.step(noise_multiplier=total, sample_rate=1.0)
    rng = np.random.default_rng(0)
    ring_share = share * codec.scale
    summed = sum(discrete_gaussian(100_000, ring_share, rng) for _ in range(peers)) / codec.scale
    # Kairouz et al. 2021 (Thm. 11): the sum of n discrete Gaussians is within tau of one in Renyi divergence
    tau = 10 * sum(math.exp(-2 * math.pi**2 * ring_share**2 * k / (k + 1)) for k in range(1, peers))
    row: dict[str, Any] = {"row": "distributed_dp", "peers": peers, "sigma": sigma, "rounds": rounds, "delta": 1e-5,
                           "epsilon_central": central.get_epsilon(delta=1e-5),
                           "epsilon_distributed": distributed.get_epsilon(delta=1e-5),
                           "share_std": share, "sum_std_measured": round(float(summed.std()), 5),
                           "sum_std_expected": sigma, "kairouz_tau": tau}
    row["epsilon_equal"] = row["epsilon_central"] == row["epsilon_distributed"]
    common = {"noise_multiplier": sigma, "sketch": "countsketch:1x4096,hash=shift", "lr": 0.05}
    for label, options in (("local", common),
                           ("distributed", {**common, "secure_aggregation": "on", "dp_noise": "distributed"})):
        result = Simulation(SimConfig(peers=peers, protocol="sketch-dp", steps=steps, task="charlm",
                                      options=options)).run()
        privacy = result.peers[0].protocol_info.get("privacy", {})
        row[label] = {"eval_loss": round(result.summary["eval_loss"], 4), "epsilon": privacy.get("epsilon"),
                      "noise": privacy.get("noise"), "step_wall_s": round(step_wall(result), 4),
                      "bytes_sent_per_peer": round(result.summary["bytes_sent_per_peer"])}
    emit(row)


DROPOUT_VALUES = 110_464  # charlm's parameters


def _identity(rank: int) -> Identity:
    return Identity.from_seed(f"secagg-dropout-{rank}")


def _vector(t: int, rank: int) -> torch.Tensor:
    return torch.randn(DROPOUT_VALUES, generator=torch.Generator().manual_seed(1000 * t + rank)) * 0.1


def worker(rank: int, peers: int, join: str, rounds: int, kill_round: int, victims: set[int]) -> None:
    """One dropout peer: a node on loopback tcp (a port the system picks; rank 0 prints its
    address for the others to join), a secure reducer, one JSON line per round."""
    from starling.collectives import ReduceTimeouts, ShardedReducer
    from starling.collectives.secure import SecureAggregation
    from starling.node import Node

    if os.environ.get("STARLING_BENCH_LOG"):  # the workers' logs on stderr, at that level
        import logging
        logging.basicConfig(level=os.environ["STARLING_BENCH_LOG"], format=f"%(asctime)s r{rank} %(name)s %(message)s")
    node = Node(_identity(rank))
    node.start("tcp://127.0.0.1:0", [join] if join else [])
    if rank == 0:
        emit({"address": node.address})
    deadline = time.monotonic() + 180
    while len(node.live_peers()) < peers - 1:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the swarm did not form")
        time.sleep(0.05)
    reducer = ShardedReducer(node, "bench.secure", DROPOUT_VALUES, "none",
                             ReduceTimeouts(round_timeout_s=10.0, reply_grace_s=4.0), secure=SecureAggregation())
    rank_of = {_identity(r).peer_id: r for r in range(peers)}
    emit({"ready": rank})
    sys.stdin.readline()  # the parent's go, once every peer is ready
    for t in range(rounds):
        members = tuple(sorted({*node.live_peers(), node.peer_id}))
        vector = _vector(t, rank)
        mine = vector.clone()
        pending = reducer.start(t, members, vector)
        emit({"masked": t, "rank": rank})
        if rank in victims and t == kill_round:
            time.sleep(600)  # the parent SIGKILLs this process now, its parts on the wire
        result = pending.wait()
        lost = sorted(result.lost)[:4]
        means = {}
        for k in range(1 << len(lost)):  # the members that may have contributed: all but some of the lost
            left_out = {m for b, m in enumerate(lost) if k >> b & 1}
            means[k] = torch.stack([_vector(t, rank_of[m]) for m in members if m not in left_out]).mean(0)
        counts = {"sum": 0, "kept": 0, "wrong": 0}
        without = set()
        for chunks, _owners in reducer.placement.shards(members, t):
            for lo, hi in chunks:
                got = vector[lo:hi]
                if torch.equal(got, mine[lo:hi]):
                    counts["kept"] += 1
                    continue
                match = next((k for k, mean in means.items()
                              if float((got - mean[lo:hi]).abs().max()) <= 1e-4), None)
                if match is None:
                    counts["wrong"] += 1
                else:
                    counts["sum"] += 1
                    without.add(bin(match).count("1"))
        emit({"round": t, "rank": rank, "members": len(members), "peers": result.peers, "lost": len(result.lost),
              "chunks": counts, "left_out": sorted(without)})
        time.sleep(0.05)  # a little compute
    emit({"done": rank, "dropped_groups": reducer._secure.dropped if reducer._secure else 0,
          "rejected": {k: v for k, v in node.stats.rejected.items() if "secagg" in k}})
    node.close()


def dropout(peers: int = 16, kill: int = 2, rounds: int = 10, kill_round: int = 4,
            timeout_s: float = 600.0) -> dict[str, Any]:
    victims = set(range(peers - kill, peers))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--peers", str(peers), "--rounds", str(rounds),
            "--kill-round", str(kill_round), "--victims", ",".join(map(str, victims))]
    lines: dict[int, list[dict[str, Any]]] = {r: [] for r in range(peers)}
    ready, killed_at, address = threading.Semaphore(0), {}, queue.Queue()
    began = time.monotonic()

    def launch(r: int, join: str) -> subprocess.Popen:
        return subprocess.Popen([*args, "--rank", str(r), "--join", join], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)

    procs = [launch(0, "")]

    def read(r: int) -> None:
        assert procs[r].stdout is not None
        for line in procs[r].stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("masked") == kill_round and r in victims:
                procs[r].send_signal(signal.SIGKILL)
                killed_at[r] = time.monotonic() - began
            lines[r].append(record)
            if "ready" in record:
                ready.release()
            if "address" in record:
                address.put(record["address"])

    def reader(r: int) -> None:
        threading.Thread(target=read, args=(r,), daemon=True).start()

    reader(0)
    try:
        join = address.get(timeout=timeout_s)
        for r in range(1, peers):
            procs.append(launch(r, join))
            reader(r)
        for _ in range(peers):
            if not ready.acquire(timeout=timeout_s):
                raise RuntimeError("the dropout swarm did not form")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for r in range(peers):
            if r not in victims:
                procs[r].wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    survivors = [r for r in range(peers) if r not in victims]
    rounds_of = {r: [x for x in lines[r] if "round" in x] for r in survivors}
    kill_rows = [x for r in survivors for x in rounds_of[r] if x["round"] == kill_round]
    later = [x for r in survivors for x in rounds_of[r] if x["round"] > kill_round]
    done = [x for r in survivors for x in lines[r] if "done" in x]
    row = {"row": "dropout", "peers": peers, "killed": len(killed_at), "kill_round": kill_round, "rounds": rounds,
           "survivors_finished": len(done) == len(survivors)
           and all(len(rounds_of[r]) == rounds for r in survivors),
           "wrong_chunks": sum(x["chunks"]["wrong"] for x in kill_rows + later),
           "at_kill": {"chunks_with_survivors_sum": min(x["chunks"]["sum"] for x in kill_rows) if kill_rows else 0,
                          "chunks_kept_local": max(x["chunks"]["kept"] for x in kill_rows) if kill_rows else 0,
                          "left_out": sorted({n for x in kill_rows for n in x["left_out"]}),
                          "peers": sorted({x["peers"] for x in kill_rows})},
           "after": {"rounds": len({x["round"] for x in later}),
                     "members": sorted({x["members"] for x in later}),
                     "chunks_kept_local": sum(x["chunks"]["kept"] for x in later)},
           "dropped_groups": sum(x["dropped_groups"] for x in done),
           "rejected": {k: sum(x["rejected"].get(k, 0) for x in done) for x in done for k in x["rejected"]},
           "seconds": round(time.monotonic() - began, 1)}
    return row


def fedavg(clients: int, drawn_per_round: int, rounds: int, sync_every: int = 5, lr: float = 1e-3,
           seed: int = 0, task_options: dict[str, Any] | None = None) -> float:
    """DiLoCo's rounds computed in one process, without a network: each round `drawn_per_round`
    of `clients` (drawn by `draw_clients` from the round and a list every client shares) start
    from the outer model, take `sync_every` AdamW steps on their own partition (each keeps its
    own AdamW state, as a peer does), and the outer model takes one Nesterov step (DiLoCo's
    outer_lr and momentum) on the exact mean of their pseudo-gradients. The eval loss of the
    outer model after `rounds` rounds: what the networked run would reach if every merge held
    every drawn member's part, unquantized."""
    from starling.protocols.diloco_config import DiLoCoConfig
    from starling.protocols.sampling import draw_clients
    from starling.tasks import get_task

    config = DiLoCoConfig(sync_every=sync_every, clients_per_round=drawn_per_round)
    task = get_task("teacher", **(task_options or {}))
    outer_model = task.make_model()
    outer = torch.nn.utils.parameters_to_vector(outer_model.parameters()).detach().clone()
    momentum = torch.zeros_like(outer)
    ids = [f"client-{r:05d}" for r in range(clients)]
    streams: dict[int, Any] = {}
    locals_: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for k in range(rounds):
        drawn = [ids.index(m) for m in draw_clients(ids, k, config)]
        delta = torch.zeros_like(outer)
        for r in drawn:
            if r not in locals_:
                model = task.make_model()
                locals_[r] = (model, torch.optim.AdamW(model.parameters(), lr=lr))
                streams[r] = task.batches(r, clients, seed)
            model, optimizer = locals_[r]
            with torch.no_grad():  # a copy: vector_to_parameters would make the parameters views of `outer`
                torch.nn.utils.parameters_to_vector(model.parameters())  # (checks the layout)
                offset = 0
                for param in model.parameters():
                    param.copy_(outer[offset:offset + param.numel()].view_as(param))
                    offset += param.numel()
            for _ in range(sync_every):
                optimizer.zero_grad()
                task.loss(model, next(streams[r])).backward()
                optimizer.step()
            delta += outer - torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        delta /= len(drawn)
        momentum = momentum * config.outer_momentum + delta
        outer = outer - config.outer_lr * (momentum * config.outer_momentum + delta)
    torch.nn.utils.vector_to_parameters(outer, outer_model.parameters())
    return float(task.evaluate(outer_model)["eval_loss"])


def sampling(clients: int, fraction: float, steps: int = 20) -> None:
    """`clients` simulated peers, `fraction` of them drawn per round, against every one of
    them drawn in every round (`clients_per_round` = all: the same rounds, the same shards)."""
    common = {"peers": clients, "protocol": "diloco", "steps": steps, "task": "teacher", "transport": "tcp",
              "processes": 2, "task_options": {"partition": "dirichlet:0.5", "batch_size": 16}}
    rows = {}
    for label, options in (("sampled", {"sync_every": 5, "sample_fraction": fraction}),
                           ("full", {"sync_every": 5, "clients_per_round": clients})):
        began = time.perf_counter()
        try:
            result = Simulation(SimConfig(**common, options=options)).run()
        except Exception as exc:  # a run that cannot finish here is a row that says so
            emit({"row": "sampling", "run": label, "clients": clients, "completed": False,
                  "error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": round(time.perf_counter() - began)})
            continue
        summary = rows[label] = result.summary
        # who actually contributed to each merge: the peers the drawn members' rounds counted
        merged = [r["peers"] for peer in result.peers for r in peer.records
                  if r.get("sampled", True) and r.get("synced") and "peers" in r]
        emit({"row": "sampling", "run": label, "clients": clients, "fraction": fraction if label == "sampled" else 1.0,
              "completed": summary["final_peers"] == clients,
              "participation": {k: v for k, v in summary.get("participation", {}).items() if k != "clients_per_step"},
              "clients_per_round": sorted(set(summary.get("participation", {}).get("clients_per_step", [clients]))),
              "contributors_per_merge": {"median": statistics.median(merged) if merged else None,
                                         "min": min(merged, default=None), "max": max(merged, default=None)},
              "eval_loss": summary["eval_loss"], "bytes_sent_per_peer": summary["bytes_sent_per_peer"],
              "wall_s": round(summary["wall_s"], 1), "seconds": round(time.perf_counter() - began)})
    if len(rows) == 2:
        emit({"row": "sampling", "compare": "sampled/full", "clients": clients,
              "eval_loss_ratio": round(rows["sampled"]["eval_loss"] / rows["full"]["eval_loss"], 4),
              "bytes_ratio": round(rows["sampled"]["bytes_sent_per_peer"] / rows["full"]["bytes_sent_per_peer"], 4)})
    # the same rounds computed in one process, every drawn part in every merge and unquantized:
    # what the networked runs reach if their merges hold every part
    drawn = max(1, round(fraction * clients))
    reference = {label: fedavg(clients, count, steps // 5, task_options=common["task_options"])
                 for label, count in (("sampled", drawn), ("full", clients))}
    emit({"row": "sampling", "reference": "in-process FedAvg", "clients": clients, "drawn": drawn,
          "eval_loss": {k: round(v, 4) for k, v in reference.items()},
          "eval_loss_ratio": round(reference["sampled"] / reference["full"], 4),
          "networked_over_reference": {k: round(rows[k]["eval_loss"] / reference[k], 4) for k in rows}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("secure", "precision", "dp", "dropout", "sampling"))
    parser.add_argument("--protocols", default="allreduce,streaming-diloco")
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--join", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--kill-round", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--victims", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rank, args.peers, args.join, args.rounds, args.kill_round,
               {int(v) for v in args.victims.split(",") if v})
        return
    if args.only in (None, "secure"):
        for protocol in args.protocols.split(","):
            secure(protocol, args.peers)
    if args.only in (None, "precision"):
        precision()
    if args.only in (None, "dp"):
        distributed_dp(args.peers)
    if args.only in (None, "dropout"):
        emit(dropout(args.peers))
    if args.only in (None, "sampling"):
        sampling(args.clients, args.fraction)


if __name__ == "__main__":
    main()
