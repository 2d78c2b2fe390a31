"""Secure aggregation under the protocols that offer it: the same model as without it, within
the ring's rounding, every replica the same, and the combinations that cannot work refused."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, linear, loss_of, swarm

from starling.protocols import get_protocol

SCALE = 2.0**16


def run(make_node, protocol: str, options: dict, world: int = 3, steps: int = 6) -> list[torch.Tensor]:
    protos = [get_protocol(protocol).create(n, linear(), {"round_timeout_s": 10.0, **options})
              for n in swarm(make_node, world)]

    def train(rank: int) -> None:
        proto = protos[rank]
        for _ in range(steps):
            proto.step(lambda: loss_of(proto.model, rank, proto.step_count))

    in_parallel([lambda r=r: train(r) for r in range(world)])
    models = [p.eval_model() if hasattr(p, "outer") else p.model for p in protos]
    out = [torch.cat([q.detach().reshape(-1) for q in m.parameters()]) for m in models]
    for p in protos:
        p.close()
    return out


@pytest.mark.parametrize("protocol, options", [
    ("allreduce", {"lr": 0.1}),
    ("diloco", {"lr": 0.1, "sync_every": 2, "compressor": "none"}),
    ("streaming-diloco", {"lr": 0.1, "sync_every": 2, "fragments": 2, "compressor": "none"}),
])
def test_a_secure_run_ends_where_the_plain_one_does(make_node, protocol, options):
    plain = run(make_node, protocol, options)
    secure = run(make_node, protocol, {**options, "secure_aggregation": "on"})
    assert all(torch.equal(p, plain[0]) for p in plain[1:])
    assert all(torch.equal(s, secure[0]) for s in secure[1:])  # every replica decodes the same sums
    torch.testing.assert_close(secure[0], plain[0], rtol=0, atol=1e-3)
    assert not torch.equal(secure[0], plain[0])  # the ring's rounding: the secure rounds did run


@pytest.mark.parametrize("protocol, options, why", [
    ("allreduce", {"aggregator": "centered_clip"}, "robust aggregator"),
    ("allreduce", {"owner_replication": 3}, "owner_replication 1"),
    ("allreduce", {"audit_rate": 0.5}, "audit_rate exclude"),
    ("streaming-diloco", {}, "compressor 'none'"),  # its default exchange is int4
])
def test_combinations_that_must_see_the_parts_are_refused(protocol, options, why):
    with pytest.raises(ValueError, match=why):
        get_protocol(protocol).config_class(**{"secure_aggregation": "on", **options})
