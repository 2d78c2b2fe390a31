"""What a member's share of one all-reduce round costs at `--members`, one operation at a time,
each against the way it was done before, in the same run.

    python benchmarks/round_costs.py [--members 1024] [--repeat 200]

Prints one JSON row (microseconds, the median of `--repeat` calls, the two ways alternating):
- owners_us / owners_before_us: a round's owners, from the table's list of peers without an
  address (`Node.unreachable_peers`, empty where every peer listens), against asking whether
  each member is reachable (`Node.is_reachable`), on a real node whose table holds the members;
- contributors_us / contributors_before_us: the contributors an average's mask names (here
  half the members; `collectives.compact.contributors_of`), against a walk of the bits in Python;
- statement_us / statement_before_us: the statement a member checks an owner's signed average
  against (`Contributions.average_statement`), against the same fields made canonical item by
  item; `same_statement` checks both give the same bytes;
- verify_us / verify_kept_us: an Ed25519 signature of that statement checked in full, and
  checked again once this process has verified it (`node.identity.verify_signature`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack


def _alternating(now: Callable[[], Any], before: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median microseconds of `now` and of `before`, called in turn `repeat` times each."""
    a, b = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        now()
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        before()
        b.append(time.perf_counter() - t0)
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def _canonical_item_by_item(obj: Any) -> Any:
    """The baseline: every list copied item by item, maps sorted, at any depth."""
    if isinstance(obj, dict):
        return [[k, _canonical_item_by_item(v)] for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))]
    if isinstance(obj, (list, tuple)):
        return [_canonical_item_by_item(v) for v in obj]
    return obj


def costs(members: int, repeat: int) -> dict[str, Any]:
    from starling.collectives.compact import contributor_mask, contributors_of, view_digest
    from starling.collectives.contributions import Contributions
    from starling.node import Node
    from starling.node.identity import Identity, verify_signature
    from starling.node.membership import PeerRecord
    from starling.node.trust import _DOMAIN

    node = Node()
    node.start("inproc://round-costs", [])
    try:
        identities = [Identity.generate() for _ in range(members - 1)]
        records = [PeerRecord.create(ident, [f"tcp://127.0.0.1:{20000 + k}"], 1).to_wire()
                   for k, ident in enumerate(identities)]
        if node.add_records(records) != members - 1:
            raise RuntimeError("the node did not learn every member")
        ids = tuple(sorted([node.peer_id, *(ident.peer_id for ident in identities)]))
        owners_us, owners_before_us = _alternating(
            lambda: (lambda gone: tuple(m for m in ids if m not in gone) if gone else ids)(node.unreachable_peers()),
            lambda: tuple(m for m in ids if node.is_reachable(m)), repeat)
    finally:
        node.close()

    mask = contributor_mask(ids, ids[::2])
    contributors_us, contributors_before_us = _alternating(
        lambda: contributors_of(ids, mask),
        lambda: tuple(m for k, m in enumerate(ids) if mask[k // 8] >> (k % 8) & 1), repeat)

    owner = Identity.generate()
    contributions = Contributions.__new__(Contributions)
    contributions.topic = "bench.reduce"
    view, content, contributors = view_digest(ids), bytes(32), contributors_of(ids, mask)
    statement = contributions.average_statement(7, 0, 0, view, contributors, content)
    fields = ["avg", "bench.reduce", 7, 0, 0, view, list(contributors), content]
    before = msgpack.packb([_DOMAIN, *(_canonical_item_by_item(f) for f in fields)], use_bin_type=True)
    statement_us, statement_before_us = _alternating(
        lambda: contributions.average_statement(7, 0, 0, view, contributors, content),
        lambda: msgpack.packb([_DOMAIN, *(_canonical_item_by_item(f) for f in fields)], use_bin_type=True), repeat)

    signatures = [owner.sign(statement + bytes([k % 256, k // 256])) for k in range(repeat)]
    t0 = time.perf_counter()
    for k, sig in enumerate(signatures):
        if not verify_signature(owner.verify_key, statement + bytes([k % 256, k // 256]), sig):
            raise RuntimeError("a good signature did not verify")
    verify_us = (time.perf_counter() - t0) / repeat * 1e6
    t0 = time.perf_counter()
    for k, sig in enumerate(signatures):
        verify_signature(owner.verify_key, statement + bytes([k % 256, k // 256]), sig)
    verify_kept_us = (time.perf_counter() - t0) / repeat * 1e6
    return {"bench": "round_costs", "members": members, "repeat": repeat,
            "owners_us": round(owners_us, 1), "owners_before_us": round(owners_before_us, 1),
            "contributors_us": round(contributors_us, 1), "contributors_before_us": round(contributors_before_us, 1),
            "statement_us": round(statement_us, 1), "statement_before_us": round(statement_before_us, 1),
            "same_statement": statement == before,
            "verify_us": round(verify_us, 1), "verify_kept_us": round(verify_kept_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    if args.members < 2 or not 1 <= args.repeat <= 65536:
        parser.error("--members must be >= 2 and --repeat between 1 and 65536")
    print(json.dumps(costs(args.members, args.repeat)))


if __name__ == "__main__":
    main()
