"""sketch-dp's three claims, measured on real nodes (inproc sockets, one thread per peer).

    python benchmarks/sketch_dp.py            # 8-10 minutes on 2 busy cores
    python benchmarks/sketch_dp.py --quick    # smoke run: fewer steps, fewer rows

Prints one JSON object per line:
- "sketch_vs_allreduce": sketch size d/100, no noise (no clipping unless the row says so),
  against `allreduce` with the same optimizer and steps on `teacher`: eval loss (mean over
  peers) and protocol bytes sent per peer; target loss ratio <= 1.05 with >= 50x fewer bytes.
  Rows for the default teacher (d = 6922: a d/100 sketch is 69 floats, so message headers
  weigh) and a wider one (hidden=256, d = 76810), at learning rates where the sketch keeps up
  and where it does not. A diverged run reports eval_loss NaN.
- "loss_vs_epsilon": sample-level DP (Poisson rate q, per-sample clipping C in sketch space),
  sigma solved by Opacus for (epsilon, delta = 1e-5) over the run's rounds; epsilon inf is the
  same run without noise.
- "speed_10m": sketch + unsketch of a 10M-value update against `tensor.clone()` of it,
  interleaved, best of the repeats (noise on a shared box only ever slows a run); target
  >= 0.25 of clone's speed.
"""
from __future__ import annotations

import argparse
import json
import math
import threading
import time
import uuid
from typing import Any

import torch

from starling.compressors import CountSketch
from starling.node.node import Node, NodeConfig
from starling.protocols import DivergedError, get_protocol
from starling.runtime import SIM_LIVENESS
from starling.tasks import get_task

PEERS = 4
LOSS_TARGET, BYTES_TARGET, SPEED_TARGET = 1.05, 50.0, 0.25


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def run_swarm(protocol: str, options: dict[str, Any], task_options: dict[str, Any], steps: int,
              private_data: bool = False) -> dict[str, Any]:
    """`PEERS` real nodes train `steps` steps on teacher; mean eval loss and bytes per peer."""
    task = get_task("teacher", **task_options)
    config = NodeConfig(liveness=SIM_LIVENESS)
    tag = uuid.uuid4().hex[:8]
    nodes = [Node(config=config).start(f"inproc://bench-{tag}-0", [], security="plaintext")]
    for rank in range(1, PEERS):
        nodes.append(Node(config=config).start(f"inproc://bench-{tag}-{rank}", [nodes[0].address],
                                               security="plaintext"))
    try:
        deadline = time.monotonic() + 60
        while not all(len(n.live_peers()) == PEERS - 1 for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark swarm did not form")
            time.sleep(0.05)
        protos = [get_protocol(protocol).create(n, task.make_model(), options) for n in nodes]
        if private_data:
            for rank, proto in enumerate(protos):
                proto.attach_task(task, rank, PEERS, seed=0)
        sent = [0] * PEERS
        errors: list[BaseException] = []

        def train(rank: int) -> None:  # a diverged peer stops; the others then run alone
            try:
                batches = task.batches(rank, PEERS, seed=0)
                for _ in range(steps):
                    batch = next(batches)
                    sent[rank] += protos[rank].step(lambda: task.loss(protos[rank].model, batch)).bytes_sent
            except BaseException as exc:  # reported below
                errors.append(exc)

        start = time.monotonic()
        threads = [threading.Thread(target=train, args=(r,)) for r in range(PEERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        diverged = any(isinstance(e, DivergedError) for e in errors)
        if errors and not diverged:
            raise errors[0]
        losses = [math.nan if diverged else task.evaluate(p.eval_model())["eval_loss"] for p in protos]
        out = {"eval_loss": sum(losses) / PEERS, "bytes_per_peer": sum(sent) / PEERS,
               "wall_s": round(time.monotonic() - start, 1), "parameters": protos[0].flat.numel}
        if protocol == "sketch-dp":
            out["privacy"] = protos[0].privacy.as_dict()
            out["sketch_size"] = protos[0].sketches.size
        for p in protos:
            p.close()
        return out
    finally:
        for n in nodes:
            n.close()


def sketch_vs_allreduce(label: str, task_options: dict[str, Any], sketch: str, optimizer: dict[str, Any],
                        steps: int, clip: float = math.inf) -> None:
    base = run_swarm("allreduce", optimizer, task_options, steps)
    ours = run_swarm("sketch-dp", {**optimizer, "sketch": sketch, "clip": clip}, task_options, steps)
    loss_ratio = ours["eval_loss"] / base["eval_loss"]
    bytes_ratio = base["bytes_per_peer"] / max(ours["bytes_per_peer"], 1.0)
    emit({"bench": "sketch_vs_allreduce", "case": label, "task": "teacher", "task_options": task_options,
          "peers": PEERS, "steps": steps, "optimizer": optimizer, "sketch": sketch, "clip": clip if math.isfinite(clip)
          else "none", "d": ours["parameters"],
          "sketch_size": ours["sketch_size"], "eval_loss": round(ours["eval_loss"], 4),
          "allreduce_eval_loss": round(base["eval_loss"], 4), "loss_ratio": round(loss_ratio, 4),
          "bytes_per_peer": round(ours["bytes_per_peer"]), "allreduce_bytes_per_peer": round(base["bytes_per_peer"]),
          "bytes_ratio": round(bytes_ratio, 1), "wall_s": [base["wall_s"], ours["wall_s"]],
          "target": f"loss_ratio <= {LOSS_TARGET} and bytes_ratio >= {BYTES_TARGET}",
          "met": bool(loss_ratio <= LOSS_TARGET and bytes_ratio >= BYTES_TARGET)})


def loss_vs_epsilon(epsilons: list[float], steps: int, sketch: str, optimizer: dict[str, Any]) -> None:
    for epsilon in epsilons:
        privacy: dict[str, Any] = {"dp_unit": "sample", "sample_rate": 0.01, "dataset_size": 6400, "clip": 1.0,
                                   "delta": 1e-5, "sketch": sketch}
        if math.isfinite(epsilon):
            privacy.update(target_epsilon=epsilon, budget_steps=steps)
        result = run_swarm("sketch-dp", {**optimizer, **privacy}, {}, steps, private_data=True)
        spent = result["privacy"]
        emit({"bench": "loss_vs_epsilon", "task": "teacher", "peers": PEERS, "steps": steps, "sketch": sketch,
              "sketch_size": result["sketch_size"], "d": result["parameters"], "optimizer": optimizer,
              "target_epsilon": epsilon if math.isfinite(epsilon) else "inf", "epsilon": spent["epsilon"],
              "delta": spent["delta"], "sigma": round(spent["noise_multiplier"], 4), "clip": spent["clip"],
              "dp_unit": spent["dp_unit"], "sample_rate": spent["sample_rate"], "accountant": spent["accountant"],
              "eval_loss": round(result["eval_loss"], 4), "wall_s": result["wall_s"]})


def speed_10m(repeats: int, numel: int = 10_000_000) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    for spec, codec, reps in (("countsketch:1x100000,hash=shift", CountSketch((1, 100_000), hash="shift"), repeats),
                              ("countsketch:5x20000,hash=shift", CountSketch((5, 20_000), hash="shift"),
                               max(2, repeats // 4))):
        clone_s, sketch_s, unsketch_s = math.inf, math.inf, math.inf
        for seed in range(reps):
            t0 = time.perf_counter()
            x.clone()
            t1 = time.perf_counter()
            table = codec.sketch(x, seed)
            t2 = time.perf_counter()
            codec.transpose(table, numel, seed) if codec.size[0] == 1 else codec.unsketch(table, numel, seed)
            t3 = time.perf_counter()
            clone_s, sketch_s, unsketch_s = min(clone_s, t1 - t0), min(sketch_s, t2 - t1), min(unsketch_s, t3 - t2)
        ratio = clone_s / (sketch_s + unsketch_s)
        context = codec.size[0] > 1  # the 5-row median (FetchSGD's estimate) is shown for context
        emit({"bench": "speed_10m", "sketch": spec, "numel": numel, "unsketch": "R^T" if codec.size[0] == 1 else
              "median of rows", "clone_ms": round(clone_s * 1e3, 2), "sketch_ms": round(sketch_s * 1e3, 2),
              "unsketch_ms": round(unsketch_s * 1e3, 2), "speed_vs_clone": round(ratio, 3), "repeats": reps,
              "target": None if context else f">= {SPEED_TARGET}",
              "met": None if context else bool(ratio >= SPEED_TARGET)})


def main() -> None:
    parser = argparse.ArgumentParser(description="sketch-dp benchmarks (JSON lines)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rows (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per simulated peer, as `starling simulate` does
    steps = 30 if args.quick else 100
    speed_10m(5 if args.quick else 15)
    wide = {"hidden": 256}
    sketch_vs_allreduce("teacher, d/100 Gaussian sketch, lr 0.1", {}, "gsketch:69", {"lr": 0.1}, steps)
    sketch_vs_allreduce("teacher hidden=256, d/100 count sketch, lr 0.03", wide, "countsketch:1x768,hash=shift",
                        {"lr": 0.03}, steps)
    if not args.quick:  # where the sketch's variance (about d/s times the gradient's) starts to cost
        sketch_vs_allreduce("teacher hidden=256, lr 0.1, sketch clipped to C = 1", wide,
                            "countsketch:1x768,hash=shift", {"lr": 0.1}, steps, clip=1.0)
    # Per-sample clipping bounds each update by C, so DP-SGD takes a larger step than plain SGD.
    loss_vs_epsilon([1.0, 8.0, math.inf] if args.quick else [1.0, 4.0, 8.0, math.inf], steps, "gsketch:69",
                    {"lr": 1.0})

if __name__ == "__main__":
    main()
