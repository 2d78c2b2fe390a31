"""Sparse, 2-bit, error-fed pseudo-gradients through the sharded all-reduce and
streaming-diloco: bit-identical averages on every peer, residuals that conserve mass and
travel in checkpoints, joiners, and a malformed sparse part refused, counted, and harmless."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import in_parallel, join_with_state, swarm
from torch import nn

from starling.collectives import ShardedReducer
from starling.collectives.compact import view_digest
from starling.collectives.contributions import Contributions
from starling.compressors import Packet, from_spec
from starling.compressors.packing import pack_uints
from starling.node import Refusal, refusal_of
from starling.protocols import PRIVATE_STATE, ProtocolError, get_protocol

SPEC = "chunktopk:8/64+q2:block=8"


def test_peers_apply_bit_identical_averages_and_residuals_conserve_mass(make_node):
    world, numel = 4, 1000
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.sparse", numel, SPEC, chunk_numel=300) for n in nodes]
    gen = torch.Generator().manual_seed(7)
    for t in range(3):
        inputs = [torch.randn(numel, generator=gen) for _ in range(world)]
        vectors = [v.clone() for v in inputs]
        results = in_parallel([lambda r=r: reducers[r].reduce(t, members, vectors[r]) for r in range(world)])
        assert all(res.synced and res.peers == world and not res.lost for res in results)
        assert all(torch.equal(v, vectors[0]) for v in vectors[1:])  # bit for bit, every round
        assert 0 < int(vectors[0].count_nonzero()) < numel  # sparse: most values did not travel
    # every peer's part residuals: per part, input + old residual = sent + new residual; over the
    # rounds nothing a peer did not send is lost, it waits in its residual
    for reducer in reducers:
        residuals = reducer.state_dict()["parts"]["residuals"]
        assert residuals and all(torch.isfinite(r).all() and r.abs().sum() > 0 for r in residuals.values())


def _part_body(sender, topic: str, t: int, members: tuple[str, ...], header: dict, buffers: list) -> dict:
    """A part as its sender signs it: an owner checks the signature before it reads the bytes."""
    sig = Contributions(sender, topic).sign_part(t, 0, 0, view_digest(members), None, Packet(header, tuple(buffers)))
    return {"step": t, "shard": 0, "chunk": 0, "members": list(members), "packet": header, "sig": sig}


@pytest.mark.parametrize("case", ["out of range", "duplicated", "count", "nan scale"])
def test_a_malformed_sparse_part_is_refused_counted_and_changes_nothing(make_node, case):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    numel = 40  # shard 0 is 20 values: one chunk of 16 and a last one of 4
    ra, rb = (ShardedReducer(n, "test.badsparse", numel, "chunktopk:2/16+q2:block=2") for n in (a, b))
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)
    packet = from_spec("chunktopk:2/16+q2:block=2").encode(torch.arange(1.0, 21.0))
    header, buffers = dict(packet.header), list(packet.buffers)
    if case == "out of range":
        buffers[0] = pack_uints(torch.tensor([14, 15, 1, 9]), 4)  # 9 is past the last chunk's 4 values
    elif case == "duplicated":
        buffers[0] = pack_uints(torch.tensor([15, 15, 1, 2]), 4)
    elif case == "count":
        header["k"] = 3  # 3 a chunk: 5 indices and values, the buffers hold 4
    else:
        scales = buffers[1].clone()
        scales.view(torch.float32)[1] = float("nan")
        buffers[1] = scales
    reply = other.request(owner.peer_id, "test.badsparse", _part_body(other, "test.badsparse", 0, members, header, buffers),
                          [bytes(x.numpy()) for x in buffers]).body
    assert refusal_of(reply) is Refusal.BAD_PART and "bad packet field" in reply["reason"]
    assert owner.stats.rejected["test.badsparse.bad_part"] == 1
    # no state changed: round 0 still runs with both peers' real parts and averages them
    va, vb = torch.arange(40.0), torch.arange(40.0)
    results = in_parallel([lambda: ra.reduce(0, members, va), lambda: rb.reduce(0, members, vb)])
    assert all(r.synced and r.peers == 2 and not r.lost for r in results)
    assert torch.equal(va, vb)


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(40, 30)


def train(proto, rank: int, steps: int) -> None:
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + proto.step_count)
        x, y = torch.randn(8, 40, generator=g), torch.randn(8, 30, generator=g)
        proto.step(lambda: nn.functional.mse_loss(proto.model(x), y))


def outer(proto) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in proto.eval_model().parameters()])


@pytest.mark.slow
def test_streaming_diloco_with_sparse_pseudo_gradients_keeps_peers_identical_through_a_join(make_node):
    """Fragments, overlap and alpha, with chunktopk+q2 and error feedback: outer parameters stay
    bit-identical, residuals are checkpointed (private), and a joiner ends its first sync with
    the others' outer parameters."""
    options = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.5, "compressor": SPEC,
               "round_timeout_s": 10.0}
    a, b = swarm(make_node, 2)
    pa, pb = (get_protocol("streaming-diloco").create(n, linear(), options) for n in (a, b))
    in_parallel([lambda: train(pa, 0, 8), lambda: train(pb, 1, 8)])
    assert pa.versions == pb.versions == [2, 2] and torch.equal(outer(pa), outer(pb))
    state = pa.state_dict()
    residuals = state[PRIVATE_STATE]["reducers"][0]["parts"]["residuals"]
    assert residuals and all(r.abs().sum() > 0 for r in residuals.values())  # error feedback is kept
    buffer = io.BytesIO()
    torch.save(state, buffer)  # a checkpoint holds them (weights_only loads them back)
    restored = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert all(torch.equal(restored[PRIVATE_STATE]["reducers"][0]["parts"]["residuals"][k], v)
               for k, v in residuals.items())
    # as the trainer sends it: the donor's residuals stay the donor's
    c, pc = join_with_state(make_node, [a, b], "streaming-diloco", linear(), options, donor=pa)
    in_parallel([lambda p=p, r=r: train(p, r, 4) for r, p in enumerate((pa, pb, pc))])
    assert pa.versions == pb.versions == pc.versions == [3, 3]
    assert torch.equal(outer(pa), outer(pb)) and torch.equal(outer(pa), outer(pc))


def test_owners_may_send_averages_in_a_denser_codec_that_keeps_the_union_of_supports(make_node):
    world, numel = 3, 96  # shards of 32 values: two chunks of 16 each
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.union", numel, "chunktopk:2/16", average_compressor="chunktopk:6/16")
                for n in nodes]
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(world)])
    assert all(torch.equal(v, vectors[0]) for v in vectors[1:])
    per_chunk = (vectors[0].view(-1, 16) != 0).sum(dim=1)
    assert int(per_chunk.max()) <= 6 and int(per_chunk.max()) > 2  # more than one part's K survived


def test_error_feedback_off_keeps_no_part_residuals_but_owners_keep_theirs(make_node):
    nodes = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.noef", 200, SPEC, part_feedback=False) for n in nodes]
    vectors = [torch.randn(200, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(2)])
    assert torch.equal(vectors[0], vectors[1])
    for reducer in reducers:
        state = reducer.state_dict()
        assert state["parts"] is None and state["averages"]["residuals"]
    proto = get_protocol("streaming-diloco").create(nodes[0], linear(), {"compressor": SPEC, "error_feedback": False})
    assert all(r.state_dict()["parts"] is None for r in proto.reducers)


def test_error_feedback_decay_reaches_the_parts_only(make_node):
    """SparseLoCo's beta decays a peer's own part residuals; an owner's residual of what its
    re-encoded averages dropped is owed to everyone and never decays."""
    nodes = swarm(make_node, 1)
    proto = get_protocol("streaming-diloco").create(nodes[0], linear(), {"compressor": SPEC,
                                                                         "error_feedback_decay": 0.9})
    assert all(r._part_feedback.decay == 0.9 and r._avg_feedback.decay == 1.0 for r in proto.reducers)
    for bad in (0.0, 1.5, True):
        with pytest.raises(ProtocolError, match="error_feedback_decay"):
            get_protocol("streaming-diloco").create(nodes[0], linear(), {"compressor": SPEC,
                                                                         "error_feedback_decay": bad})
