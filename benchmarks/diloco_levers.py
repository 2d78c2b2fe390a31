"""Which levers move (Streaming) DiLoCo's gap to data-parallel on `charlm`? A fast, socket-free model.

    python benchmarks/diloco_levers.py [--steps N] [--peers P] [--sync-every H] [--fragments F]
                                       [--inner-lr LR] [--dp-lr LR] [--outer-lr LR]
                                       [--outer-momentum M] [--alpha A] [--batch-size B]
                                       [--shards contiguous|shuffled] [--only dp,diloco]

`benchmarks/diloco.py` measures the real protocols (real nodes, sockets, int4 exchange,
overlap); one of its 512-step runs takes about 17 minutes here. This script runs the same
arithmetic in one thread with no node, no compression and no overlap: P replicas of the
model, AdamW inside, every H steps fragment f's pseudo-gradients averaged exactly and
applied by outer Nesterov SGD on a staggered schedule (fragment f at steps = (f + 1) H / F
mod H), the local fragment then set to alpha * local + (1 - alpha) * outer. `dp` is AdamW on
the exact mean of the P peers' gradients each step, as `allreduce` computes it. It is for
screening hyper-parameters in minutes; figures for the targets come from
`benchmarks/diloco.py`.

`--shards shuffled` gives every peer random windows of the whole training split (IID
peers, as in the papers); `contiguous` (the task's own sharding) gives peer r the r-th slice
of the sorted stdlib source, so peers see different files (non-IID). Prints one JSON row.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from starling.tasks.base import make_generator
from starling.tasks.charlm import CharLMConfig, CharLMTask

EVAL_TASK = CharLMTask()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=64, help="H, inner steps per outer step of a fragment")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--dp-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--alpha", type=float, default=0.5, help="merge: alpha * local + (1 - alpha) * outer")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=CharLMConfig.n_embd,
                        help="model width (charlm's default 64, 0.11M parameters); a multiple of its 4 heads")
    parser.add_argument("--shards", choices=("contiguous", "shuffled"), default="contiguous")
    parser.add_argument("--only", default="dp,diloco", help="comma-separated: dp, diloco")
    args = parser.parse_args(argv)
    for name in ("steps", "peers", "sync_every", "fragments", "batch_size", "n_embd"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fragments > args.sync_every:
        parser.error("--fragments must be <= --sync-every (each fragment needs its own step)")
    if not 0.0 <= args.alpha <= 1.0:
        parser.error("--alpha must be in [0, 1]")
    try:
        CharLMConfig(n_embd=args.n_embd)
    except ValueError as exc:
        parser.error(f"--n-embd: {exc}")
    args.only = [name for name in args.only.split(",") if name]
    if not args.only or set(args.only) - {"dp", "diloco"}:
        parser.error("--only takes dp and/or diloco")
    return args


def peer_batches(task: CharLMTask, args: argparse.Namespace, rank: int) -> Iterator[Any]:
    if args.shards == "contiguous":
        return task.batches(rank, args.peers, 0)
    train, _ = task.splits()
    return task.windows(train, make_generator("diloco_levers.shuffled", rank, args.peers))


def evaluate(model: torch.nn.Module) -> float:
    """On the default config's held-out windows, whatever --batch-size trains with."""
    return EVAL_TASK.evaluate(model)["eval_loss"]


def data_parallel(task: CharLMTask, args: argparse.Namespace) -> dict[str, float]:
    model = task.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.dp_lr)
    streams = [peer_batches(task, args, r) for r in range(args.peers)]
    for _ in range(args.steps):
        optimizer.zero_grad()
        for stream in streams:
            (task.loss(model, next(stream)) / args.peers).backward()
        optimizer.step()
    return {"dp_eval_loss": evaluate(model)}


def diloco(task: CharLMTask, args: argparse.Namespace) -> dict[str, float]:
    start = task.make_model()
    replicas = [copy.deepcopy(start) for _ in range(args.peers)]
    inner = [torch.optim.AdamW(m.parameters(), lr=args.inner_lr) for m in replicas]
    streams = [peer_batches(task, args, r) for r in range(args.peers)]
    outer = parameters_to_vector(start.parameters()).detach().clone()
    momentum = torch.zeros_like(outer)
    n, h, f_count = outer.numel(), args.sync_every, args.fragments
    bounds = [(n * f // f_count, n * (f + 1) // f_count) for f in range(f_count)]
    for step in range(1, args.steps + 1):
        for model, optimizer, stream in zip(replicas, inner, streams):
            optimizer.zero_grad()
            task.loss(model, next(stream)).backward()
            optimizer.step()
        for f, (lo, hi) in enumerate(bounds):
            if step % h != (h * (f + 1) // f_count) % h:
                continue
            local = [parameters_to_vector(m.parameters()).detach() for m in replicas]
            delta = torch.stack([outer[lo:hi] - vec[lo:hi] for vec in local]).mean(0)
            momentum[lo:hi].mul_(args.outer_momentum).add_(delta)
            outer[lo:hi] -= args.outer_lr * (delta + args.outer_momentum * momentum[lo:hi])
            for model, vec in zip(replicas, local):
                vec[lo:hi] = args.alpha * vec[lo:hi] + (1.0 - args.alpha) * outer[lo:hi]
                vector_to_parameters(vec, model.parameters())
    evaluated = copy.deepcopy(start)
    vector_to_parameters(outer, evaluated.parameters())
    local_losses = [evaluate(m) for m in replicas]
    return {"diloco_eval_loss": evaluate(evaluated),
            "diloco_eval_loss_local": sum(local_losses) / len(local_losses)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    task = CharLMTask(CharLMConfig(batch_size=args.batch_size, n_embd=args.n_embd))
    started = time.monotonic()
    row: dict[str, Any] = {"bench": "diloco_levers", **{k: v for k, v in vars(args).items() if k != "only"},
                           "parameters": sum(p.numel() for p in task.make_model().parameters())}
    if "dp" in args.only:
        row.update(data_parallel(task, args))
    if "diloco" in args.only:
        row.update(diloco(task, args))
    if "dp_eval_loss" in row and "diloco_eval_loss" in row:
        row["loss_gap"] = row["diloco_eval_loss"] / row["dp_eval_loss"] - 1.0
    row["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
