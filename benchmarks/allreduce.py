"""Starling's sharded all-reduce against torch.distributed gloo `all_reduce`, in the same run.

    python benchmarks/allreduce.py [--peers 2,4] [--size-mb 100] [--repeat 5] [--warmup 1]
                                   [--security plaintext|curve] [--backends starling,gloo]
                                   [--chunk-mb MiB] [--timeout-s 300] [--profile-rank R]

Target checked: averaging a ``--size-mb`` MiB float32 tensor across 2 and 4 peers on
tcp loopback takes at most 1.5x the time of gloo's ``all_reduce`` of the same tensor.

For each peer count, N worker processes (spawned, ``torch.set_num_threads(1)``) each start a
real Starling ``Node`` on ``tcp://127.0.0.1``, join rank 0's swarm, and join a gloo process
group over loopback (a FileStore rendezvous). Then the two backends take turns, round by round,
so that both see the same machine load:

    for each round (warm-up rounds first, not timed):
        reset the vector to this rank's input
        barrier; time ShardedReducer.reduce(...)     # collectives/reduce.py, what `allreduce` uses
        reset the vector to this rank's input
        barrier; time dist.all_reduce(...) / N        # the mean, as Starling computes it

A round's time is the slowest rank's, from the barrier until its own call returned. Each row
reports the best and median round and the algorithmic bandwidth ``bytes / median`` (GB/s =
10**9 bytes/s; bus bandwidth is that times 2(N-1)/N, what each peer's link carries). After the
last round every rank checks its result against the exact mean of all inputs (rank r's input
is ``(r + 1) * base + r`` for one shared random ``base``, so the mean is known without
gathering the inputs). Prints one JSON row per (backend, peers) and a summary row; the summary's
``ratio`` is the median Starling round over the median gloo round, per peer count (what
``met`` judges), ``ratio_best`` the same for the best rounds, ``ratio_cpu`` for CPU time.

Two per-round diagnostics come with each row, medians over ranks and rounds: ``cpu_s_per_round``
(the process's CPU time, every thread; on a loaded machine wall time follows it) and
``page_faults_per_round`` (minor faults: buffers of tens of MB are mapped fresh by glibc and
zeroed by the kernel, which can cost more than copying them). ``--profile-rank R`` prints
cProfile tables of rank R's training and network threads during the timed Starling rounds.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

TARGET_RATIO = 1.5
TOPIC = "bench.allreduce"
BASE_SEED = 1234
RTOL, ATOL = 1e-5, 1e-4  # float32 sums of N terms of up to ~20, then a division
JOIN_POLL_INTERVAL_S = 0.02
BACKENDS = ("starling", "gloo")


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world: int
    numel: int
    rounds: int  # warm-up + timed
    warmup: int
    security: str
    backends: tuple[str, ...]
    store_path: str  # gloo FileStore rendezvous
    timeout_s: float  # every wait in the worker: join, barrier, one round
    profile: bool  # cProfile this rank's Starling rounds, printed to stderr
    chunk_numel: int  # ShardedReducer's values per request; 0: its default


# ------------------------------------------------------------------ worker process
def _loopback_interface() -> str | None:
    """The loopback interface's name, so that gloo's pairs connect over 127.0.0.1."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)


def _inputs(rank: int, world: int, numel: int) -> tuple[Any, Any]:
    """This rank's input and the exact mean over every rank's, both float32."""
    import torch

    gen = torch.Generator().manual_seed(BASE_SEED)
    base = torch.randn(numel, generator=gen)
    mine = base * float(rank + 1) + float(rank)
    # mean over r of ((r + 1) base + r) = base (N + 1) / 2 + (N - 1) / 2
    expected = base.mul_((world + 1) / 2.0).add_((world - 1) / 2.0)
    return mine, expected


def _error(result: Any, expected: Any) -> tuple[bool, float]:
    import torch

    err = float((result - expected).abs().max())
    ok = bool(torch.isfinite(result).all()) and bool(
        ((result - expected).abs() <= ATOL + RTOL * expected.abs()).all())
    return ok, err


def _start_node(spec: WorkerSpec, addresses: Any) -> Any:
    from starling.node.node import Node

    if spec.rank == 0:
        node = Node().start(listen="tcp://127.0.0.1:0", security=spec.security)
        for _ in range(spec.world - 1):
            addresses.put(node.address)
    else:
        address = addresses.get(timeout=spec.timeout_s)
        node = Node().start(listen="tcp://127.0.0.1:0", join=[address], security=spec.security)
    deadline = time.monotonic() + spec.timeout_s
    while len(node.live_peers()) < spec.world - 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {spec.rank} sees {len(node.live_peers())} of {spec.world - 1} peers "
                               f"after {spec.timeout_s} s")
        time.sleep(JOIN_POLL_INTERVAL_S)
    return node


def _minor_faults() -> int:
    """Page faults of this process so far: fresh memory costs more than copies on some VMs."""
    try:
        import resource
    except ImportError:  # not on Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _on_network_thread(node: Any, fn: Any) -> None:
    """Call `fn` on the node's network thread (cProfile profiles the thread that enables it)."""
    async def call() -> None:
        fn()

    node.run(call())


def _print_profile(what: str, profiler: Any) -> None:
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(f"--- cProfile of {what} ---\n{text.getvalue()}", file=sys.stderr, flush=True)


def worker(spec: WorkerSpec, addresses: Any, barrier: Any, results: Any) -> None:
    """One peer: a Starling node and a gloo rank; puts {"rank", per-backend seconds, checks}."""
    node = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # Warnings, and the reducer's reasons for a chunk that kept its local values, to stderr.
        logging.basicConfig(level=logging.WARNING, format=f"rank {spec.rank} %(name)s: %(message)s")
        logging.getLogger("starling.collectives.reduce").setLevel(logging.INFO)
        vector = torch.empty(spec.numel, dtype=torch.float32)
        mine, expected = _inputs(spec.rank, spec.world, spec.numel)
        out: dict[str, Any] = {"rank": spec.rank}

        reducer = members = None
        if "starling" in spec.backends:
            from starling.collectives import ReduceTimeouts, ShardedReducer, membership

            node = _start_node(spec, addresses)
            members = membership(node)
            if len(members) != spec.world:
                raise RuntimeError(f"rank {spec.rank}: swarm view has {len(members)} members, not {spec.world}")
            chunking = {"chunk_numel": spec.chunk_numel} if spec.chunk_numel else {}
            reducer = ShardedReducer(node, TOPIC, spec.numel, "none",
                                     ReduceTimeouts(round_timeout_s=spec.timeout_s, reply_grace_s=2.0), **chunking)
        if "gloo" in spec.backends:
            iface = _loopback_interface()
            if iface:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
            dist.init_process_group("gloo", init_method=f"file://{spec.store_path}", rank=spec.rank,
                                    world_size=spec.world, timeout=timedelta(seconds=spec.timeout_s))

        profiler = net_profiler = None
        if spec.profile:
            import cProfile

            profiler, net_profiler = cProfile.Profile(), cProfile.Profile()
        times: dict[str, list[float]] = {b: [] for b in spec.backends}
        faults: dict[str, list[int]] = {b: [] for b in spec.backends}
        cpu: dict[str, list[float]] = {b: [] for b in spec.backends}
        for t in range(spec.rounds):
            for backend in spec.backends:
                vector.copy_(mine)
                barrier.wait(spec.timeout_s)
                faults_before, cpu_before = _minor_faults(), time.process_time()
                start = time.perf_counter()
                if backend == "starling":
                    assert reducer is not None and members is not None
                    profiling = profiler is not None and t >= spec.warmup
                    if profiling:
                        _on_network_thread(node, net_profiler.enable)
                        profiler.enable()
                    result = reducer.reduce(t, members, vector)
                    if profiling:
                        profiler.disable()
                        _on_network_thread(node, net_profiler.disable)
                    elapsed = time.perf_counter() - start
                    if result.peers != spec.world or result.lost:
                        raise RuntimeError(f"rank {spec.rank} round {t}: {result.peers} peers, lost {result.lost}")
                else:
                    dist.all_reduce(vector)
                    vector.div_(spec.world)
                    elapsed = time.perf_counter() - start
                if t >= spec.warmup:
                    times[backend].append(elapsed)
                    faults[backend].append(_minor_faults() - faults_before)
                    cpu[backend].append(time.process_time() - cpu_before)
                if t == spec.rounds - 1:
                    ok, err = _error(vector, expected)
                    out[f"{backend}_correct"], out[f"{backend}_max_abs_err"] = ok, err
        out["seconds"], out["faults"], out["cpu"] = times, faults, cpu
        barrier.wait(spec.timeout_s)  # nobody closes while a peer still waits for its average
        if profiler is not None:
            _print_profile(f"rank {spec.rank}, Starling rounds, training thread", profiler)
            _print_profile(f"rank {spec.rank}, Starling rounds, network thread", net_profiler)
        results.put(out)
    except BaseException as exc:
        results.put({"rank": spec.rank, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()})
        try:
            barrier.abort()  # wake the peers at once instead of after their timeouts
        except Exception:
            pass
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        if node is not None:
            node.close()


# ------------------------------------------------------------------ parent
def run_peers(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn `world` workers, collect their timings; always reaps every process."""
    ctx = mp.get_context("spawn")
    numel = int(args.size_mb * 2**20) // 4
    addresses, results = ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(world)
    backends = tuple(b for b in BACKENDS if b in args.backends)
    with tempfile.TemporaryDirectory(prefix="starling-bench-allreduce-") as tmp:
        specs = [WorkerSpec(rank, world, numel, args.warmup + args.repeat, args.warmup, args.security, backends,
                            os.path.join(tmp, "gloo-store"), args.timeout_s, rank == args.profile_rank,
                            int(args.chunk_mb * 2**20) // 4)
                 for rank in range(world)]
        procs = [ctx.Process(target=worker, args=(spec, addresses, barrier, results), daemon=True,
                             name=f"allreduce-bench-{world}-{spec.rank}") for spec in specs]
        outs: list[dict[str, Any]] = []
        try:
            for proc in procs:
                proc.start()
            # Setup (spawn, imports, inputs, join) plus every round, each bounded by timeout_s.
            deadline = time.monotonic() + args.timeout_s * (3 + 2 * (args.warmup + args.repeat))
            while len(outs) < world:
                try:
                    out = results.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{world} peers: {len(outs)} of {world} workers reported in time") from None
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"{world} peers: worker {dead[0].name} died with exit code "
                                           f"{dead[0].exitcode}") from None
                    continue
                if "error" in out:
                    raise RuntimeError(f"{world} peers: rank {out['rank']} failed: {out['error']}\n{out['traceback']}")
                outs.append(out)
            for proc in procs:
                proc.join(args.timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    return [_row(backend, world, numel, outs, args) for backend in backends]


def _row(backend: str, world: int, numel: int, outs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    # A round lasts until its slowest rank is done.
    rounds = [max(out["seconds"][backend][i] for out in outs) for i in range(args.repeat)]
    nbytes = numel * 4
    median, best = statistics.median(rounds), min(rounds)
    algbw = nbytes / median / 1e9
    return {
        "bench": "allreduce", "backend": backend, "peers": world, "size_mb": args.size_mb, "bytes": nbytes,
        "repeat": args.repeat, "warmup": args.warmup,
        "security": args.security if backend == "starling" else "none",
        **({"chunk_mb": _chunk_mb(args)} if backend == "starling" else {}),
        "best_s": round(best, 4), "median_s": round(median, 4), "rounds_s": [round(r, 4) for r in rounds],
        "algbw_GBps": _sig(algbw), "busbw_GBps": _sig(algbw * 2 * (world - 1) / world),
        "cpu_s_per_round": round(statistics.median(c for out in outs for c in out["cpu"][backend]), 3),
        "page_faults_per_round": int(statistics.median(f for out in outs for f in out["faults"][backend])),
        "correct": all(out[f"{backend}_correct"] for out in outs),
        "max_abs_err": max(out[f"{backend}_max_abs_err"] for out in outs),
    }


def _sig(x: float, digits: int = 4) -> float:
    """Rounded to significant digits: a slow round on a starved box is still a nonzero rate."""
    return float(f"{x:.{digits}g}")


def _chunk_mb(args: argparse.Namespace) -> float:
    if args.chunk_mb:
        return args.chunk_mb
    from starling.collectives import DEFAULT_CHUNK_NUMEL

    return DEFAULT_CHUNK_NUMEL * 4 / 2**20


def summary(rows: list[dict[str, Any]], peers: list[int]) -> dict[str, Any]:
    by = {(r["backend"], r["peers"]): r for r in rows}
    ratios: dict[str, float] = {}
    best: dict[str, float] = {}
    cpu: dict[str, float] = {}
    met: dict[str, bool] = {}
    for world in peers:
        if ("starling", world) in by and ("gloo", world) in by:
            mine, theirs = by["starling", world], by["gloo", world]
            ratios[str(world)] = round(mine["median_s"] / theirs["median_s"], 3)
            best[str(world)] = round(mine["best_s"] / theirs["best_s"], 3)
            cpu[str(world)] = round(mine["cpu_s_per_round"] / max(theirs["cpu_s_per_round"], 1e-9), 3)
            met[str(world)] = ratios[str(world)] <= TARGET_RATIO
    correct = all(r["correct"] for r in rows)
    return {"bench": "summary", "metric": "median starling_s / gloo_s", "target_ratio": TARGET_RATIO,
            "ratio": ratios, "met": met, "ratio_best": best, "ratio_cpu": cpu, "correct": correct,
            "all_met": bool(met) and all(met.values()) and correct}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="2,4", help="comma-separated peer counts (2,4)")
    parser.add_argument("--size-mb", type=float, default=100.0, help="tensor size in MiB (100)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per backend (5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument("--security", choices=("plaintext", "curve"), default="plaintext",
                        help="Starling's transport security (gloo has none; plaintext)")
    parser.add_argument("--backends", default="starling,gloo", help="which backends to time (starling,gloo)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="bound on each wait: join, barrier, one round (300)")
    parser.add_argument("--chunk-mb", type=float, default=0.0,
                        help="Starling's chunk per request in MiB (0: ShardedReducer's default)")
    parser.add_argument("--profile-rank", type=int, default=-1,
                        help="cProfile this rank's Starling rounds to stderr (-1: none)")
    args = parser.parse_args(argv)
    try:
        args.peer_counts = [int(p) for p in args.peers.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--peers must be comma-separated integers, got {args.peers!r}")
    args.backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        parser.error(f"--backends must name some of {', '.join(BACKENDS)}, got {','.join(args.backends)!r}")
    if not args.peer_counts or min(args.peer_counts) < 2:
        parser.error("--peers needs counts >= 2")
    if not (args.size_mb > 0 and math.isfinite(args.size_mb)) or int(args.size_mb * 2**20) // 4 < max(args.peer_counts):
        parser.error("--size-mb must be > 0 and hold at least one float per peer")
    if args.repeat < 1 or args.warmup < 0 or not args.timeout_s > 0 or not args.chunk_mb >= 0:
        parser.error("need --repeat >= 1, --warmup >= 0, --timeout-s > 0, --chunk-mb >= 0")
    if args.chunk_mb and int(args.chunk_mb * 2**20) // 4 < 1:
        parser.error("--chunk-mb must hold at least one float")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for world in args.peer_counts:
        for row in run_peers(world, args):
            emit(row)
            rows.append(row)
    emit({**summary(rows, args.peer_counts), "benchmark_s": round(time.monotonic() - started, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
