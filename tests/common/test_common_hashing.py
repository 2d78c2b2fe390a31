"""starling.common.hashing: one seed derivation and one peer hash, with the exact values each
caller had before they shared them (recorded runs, data shards and SPSA keys depend on them)."""
from __future__ import annotations

import hashlib
import random

import pytest

from starling.common import derive_seed, peer_hash
from starling.common.hashing import tensor_digest
from starling.compressors import rng
from starling.protocols.spsa.arith import peer_key
from starling.runtime import shard_for
from starling.tasks import derive_seed as task_derive_seed

PEERS = ["", "a", "peer-0", "peer-17", "12D3KooWxyz", "ünïcode-peer", *(f"peer-{i}" for i in range(200))]


def old_task_seed(purpose: str, *parts: int) -> int:
    text = "/".join([purpose, *(str(int(p)) for p in parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def test_int_roots_keep_the_rng_values() -> None:
    assert derive_seed(0, 1, 2) == 9056455758235018220  # pinned in test_compressors_rng too
    assert rng.derive_seed is derive_seed
    assert derive_seed(7, 3) == rng.derive_seed(7, 3)


@pytest.mark.parametrize("parts", [(), (0,), (0, 1), (3, 16), (-5,), (2**40, 7, 9)])
@pytest.mark.parametrize("purpose", ["charlm.batches", "teacher.teacher", "quadratic.offsets", "x"])
def test_str_roots_keep_the_task_values(purpose: str, parts: tuple[int, ...]) -> None:
    assert derive_seed(purpose, *parts) == old_task_seed(purpose, *parts)
    assert task_derive_seed is derive_seed


def test_seeds_are_63_bit_and_separate_streams() -> None:
    for root in (0, 1, -1, 2**64 - 1, "x", "y"):
        for parts in ((), (0, 1), (1, 0), (-5,)):
            assert 0 <= derive_seed(root, *parts) < 2**63
    assert derive_seed(1, 0, 1) != derive_seed(1, 1, 0) != derive_seed(2, 0, 1)
    assert derive_seed("x", 0, 1) != derive_seed("x", 1, 0) != derive_seed("y", 0, 1)


def test_int_roots_are_checked() -> None:
    with pytest.raises(TypeError):
        derive_seed(True, 1)
    with pytest.raises(TypeError):
        derive_seed(1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        derive_seed(1 << 64)


@pytest.mark.parametrize("peer_id", PEERS)
def test_peer_hash_keeps_each_callers_values(peer_id: str) -> None:
    sha8 = hashlib.sha256(peer_id.encode()).digest()[:8]
    # runtime.shard_for: a real swarm's data shard
    assert peer_hash(peer_id) == int.from_bytes(sha8, "big")
    for world in (1, 2, 16, 1000):
        assert shard_for(peer_id, world) == int.from_bytes(sha8, "big") % world
    # gossip's partner RNG seed
    assert peer_hash(peer_id, byteorder="little") == int.from_bytes(sha8, "little")
    # SPSA's peer key
    blake = hashlib.blake2b(peer_id.encode(), digest_size=8).digest()
    assert peer_hash(peer_id, digest="blake2b", byteorder="little", bits=63) == int.from_bytes(blake, "little") >> 1
    assert peer_key(peer_id) == int.from_bytes(blake, "little") >> 1


def test_pinned_values() -> None:
    # Literals computed with the formulas each caller had before, so that a change on both
    # sides of the comparisons above cannot hide.
    assert peer_hash("peer-0") == 606093711320162910
    assert shard_for("peer-0", 16) == 606093711320162910 % 16
    assert peer_hash("peer-0", byteorder="little") == 6783220293650835720
    assert peer_key("peer-0") == 2988948123259910540
    assert peer_key("peer-3") == 8275585936827193668
    assert derive_seed("charlm.batches", 0, 3, 16) == 4632542076615856829


def test_gossip_partner_stream_is_unchanged() -> None:
    seed = int.from_bytes(hashlib.sha256(b"peer-3").digest()[:8], "little")
    old, new = random.Random(seed), random.Random(peer_hash("peer-3", byteorder="little"))
    assert [old.random() for _ in range(5)] == [new.random() for _ in range(5)]


def test_peer_hash_range_and_bad_schemes() -> None:
    for peer_id in PEERS:
        assert 0 <= peer_hash(peer_id) < 2**64
        assert 0 <= peer_hash(peer_id, digest="blake2b", bits=63) < 2**63
    with pytest.raises(ValueError, match="digest"):
        peer_hash("a", digest="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits"):
        peer_hash("a", bits=32)  # type: ignore[arg-type]


def test_a_tensor_state_is_hashed_one_way_with_or_without_names():
    """Model state digests and the round agreement's hash the same bytes through one function;
    the values are pinned, since peers of one build compare them."""
    import torch

    from starling.collectives.agreement import digest_bytes
    from starling.runtime.modelspec import state_digest

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor([7], dtype=torch.int64)}
    model = torch.nn.Module()
    for name, value in state.items():
        model.register_buffer(name, value)
    by_hand = hashlib.sha256()
    for name, value in state.items():
        by_hand.update(name.encode())
        by_hand.update(value.contiguous().reshape(-1).view(torch.uint8).numpy())
    assert state_digest(model) == by_hand.hexdigest()[:16] == tensor_digest(state.values(), state.keys()).hexdigest()[:16]
    values_only = hashlib.sha256(b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for v in state.values()))
    assert digest_bytes(list(state.values())) == values_only.digest()[:8] == tensor_digest(state.values()).digest()[:8]
    with pytest.raises(ValueError):  # a name for each tensor, no more and no fewer
        tensor_digest(state.values(), ["w"])
