"""Train your own `nn.Module` on your own data with any registered protocol.

Three peers in this one process, each a real `Node` on its own inproc socket, each
training in its own thread on its own slice of the data. Swap "gossip" for "allreduce",
"diloco", "streaming-diloco", "spsa" or "sketch-dp" (`starling protocols` lists them; each
protocol's hyper-parameters are its config fields: `starling protocols NAME`).

    python examples/train_your_model.py [PROTOCOL]

On separate machines, the same code runs with tcp:// listen addresses, CurveZMQ on
(the default), and the first node's `node.address` passed to the others' `join`.
"""
from __future__ import annotations

import sys
import threading

import torch
from torch import nn

from starling.node.node import Node
from starling.protocols import get_protocol

PEERS, STEPS = 3, 200
PROTOCOL = sys.argv[1] if len(sys.argv) > 1 else "gossip"
OPTIONS = {"lr": 0.05}


def my_model() -> nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def my_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each peer holds its own samples of y = sum(sin(x))."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(512, 8, generator=g)
    return x, torch.sin(x).sum(1, keepdim=True)


def train(rank: int, node: Node, losses: dict[int, float]) -> None:
    torch.set_num_threads(1)
    model = my_model()
    proto = get_protocol(PROTOCOL).create(node, model, OPTIONS)
    x, y = my_data(rank)
    for step in range(STEPS):
        i = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step * PEERS + rank))
        report = proto.step(lambda: nn.functional.mse_loss(model(x[i]), y[i]))
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {report.loss:.4f}  sent {report.bytes_sent} B  peers {report.peers}")
    with torch.no_grad():
        losses[rank] = float(nn.functional.mse_loss(proto.eval_model()(x), y))
    proto.close()


def main() -> None:
    first = Node().start("inproc://example-0", security="plaintext")
    nodes = [first] + [Node().start(f"inproc://example-{r}", [first.address], security="plaintext")
                       for r in range(1, PEERS)]
    while any(len(n.live_peers()) < PEERS - 1 for n in nodes):
        threading.Event().wait(0.05)
    losses: dict[int, float] = {}
    threads = [threading.Thread(target=train, args=(r, n, losses)) for r, n in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{PROTOCOL}: final loss per peer", {r: round(v, 4) for r, v in sorted(losses.items())})
    for node in nodes:
        node.leave()


if __name__ == "__main__":
    main()
