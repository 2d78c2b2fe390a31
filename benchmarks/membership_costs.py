"""What a member's work while a swarm forms costs, one operation at a time.

    python benchmarks/membership_costs.py [--members 1024] [--repeat 200]

Prints one JSON row:
- fingers_ms / fingers_walked_ms / sorted_ring_ms: working out a member's fingers
  (`node.ring.ProbeRing.fingers`) on a view of `--members`, each call on a new view version as
  while a swarm forms, over the ring keys its table keeps beside its live ids, against the
  same with the keys gathered by a walk of the ids in Python, and the same fingers found by
  sorting the ring, in the same run; fingers_speedup is the walk's time over the keys', and
  `same_fingers` checks the keys' fingers against the sort's;
- learn_news_us / learn_known_us: a real node learning `--members` relayed records that are
  news to it, then the same records again (`Node.add_records_here`, signatures already checked
  in the process, as in a simulator's worker where every node hears each record);
- page_walk_ms / page_news_ms: that node's table served as `$sync` pages of a member's page
  size (`table_page_bytes`), the whole of it page by page as to a joiner (paged: the records it
  handed out), and one page for a puller that names half of them as held (anti-entropy);
- pull_forming_us / pull_forming_before_us: one pull while a swarm forms, both ends: the
  asker's list of the peers it holds (its whole table), and the helper reading a list that
  names all but one in fifty of its peers and serving the page of those it lacks; against the
  same done one id at a time in Python (cut and joined, a set of prefixes, each id tested), in
  the same run; pull_forming_speedup is their ratio, and `same_pull_page` checks both pages;
- probe_target_ms / probe_target_before_ms: that node's next probe target past its socket cap
  (`FailureDetector._next_finger`), its fingers worked out afresh each time (the median of
  `--repeat` calls, alternating with the baseline's), against the same with a walk of its
  live members in Python calling `_can_probe` for each, in the same run;
  probe_target_speedup is their ratio, and `same_probe_fingers` checks both pick the same
  fingers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any


def _fingers_by_sorting(ids: list[str], own: str, epochs: list[int], limit: int) -> list[str]:
    """The fingers as a sorted ring gives them: the baseline."""
    from starling.node.ring import finger_steps, place

    everyone = [*ids, own]
    n = len(everyone)
    out: list[str] = []
    rings: dict[int, list[str]] = {}
    for epoch, step in zip(epochs, finger_steps(n, limit)):
        ring = rings.get(epoch)
        if ring is None:
            ring = rings[epoch] = [p for _, p in sorted((place(p, epoch), p) for p in everyone)]
        peer = ring[(ring.index(own) + step) % n]
        if peer != own and peer not in out:
            out.append(peer)
    return out


def fingers(members: int, repeat: int) -> dict[str, Any]:
    from starling.node.ring import MAX_FINGERS, ProbeRing, id_key
    from starling.node.swim import IdSet

    ids = [f"member-{i:06d}" for i in range(members)]
    own, others = ids[0], ids[1:]
    now = 1000.5 * 2048.0  # two fingers' epochs differ here, as they do for 1/16 of each epoch
    ring = ProbeRing(own, 2048.0, lambda: now)
    live = IdSet(id_key)  # as a member's table keeps its live ids, each with its ring key
    for p in others:
        live.add(p)
    limit = 10
    epochs = ring.epochs(min(limit, MAX_FINGERS), now)
    same = ring.fingers(live.ids, 0, limit, live.keys()) == _fingers_by_sorting(others, own, epochs, limit)
    version = [0]

    def fresh() -> None:
        version[0] += 1  # a new view version: worked out afresh, as at every probe while a swarm forms
        ring.fingers(live.ids, version[0], limit, live.keys())

    def walked() -> None:  # the same, the members' keys gathered by a walk of their ids in Python
        version[0] += 1
        ring.fingers(live.ids, version[0], limit)

    new_s = timeit.timeit(fresh, number=repeat) / repeat
    walk_s = timeit.timeit(walked, number=repeat) / repeat
    old_s = timeit.timeit(lambda: _fingers_by_sorting(others, own, epochs, limit), number=repeat) / repeat
    return {"members": members, "fingers_ms": round(new_s * 1e3, 3), "fingers_walked_ms": round(walk_s * 1e3, 3),
            "sorted_ring_ms": round(old_s * 1e3, 3), "fingers_speedup": round(walk_s / new_s, 2),
            "fingers_speedup_over_sorting": round(old_s / new_s, 2), "same_fingers": same}


def learning(members: int, repeat: int) -> dict[str, Any]:
    from starling.node import Node, NodeConfig
    from starling.node.admission import AdmissionConfig
    from starling.node.have import HAVE_CHARS, Have
    from starling.node.records import PeerRecord
    from starling.node.table_sync import parse_sync
    from starling.runtime.simconfig import seeded_identity

    identities = [seeded_identity(0, rank) for rank in range(members + 2)]
    node = Node(identities[0], config=NodeConfig())
    seed = Node(identities[1], config=NodeConfig())
    try:
        node.start("tcp://127.0.0.1:0", [], security="plaintext")
        seed.start("tcp://127.0.0.1:0", [node.address], security="plaintext")
        deadline = time.monotonic() + 30
        while seed.peer_id not in node.live_peers():
            if time.monotonic() > deadline:
                raise TimeoutError("the second node did not join")
            time.sleep(0.05)
        raws = [PeerRecord.create(identities[r], [f"tcp://127.0.0.1:{20000 + r}"], 1).to_wire()
                for r in range(2, members + 2)]
        held = [PeerRecord.from_wire(raw) for raw in raws]  # checked once in the process, and kept alive

        async def learn() -> tuple[int, float, float]:
            t0 = time.perf_counter()
            news = node.add_records_here(raws, told_by=seed.peer_id)
            t1 = time.perf_counter()
            node.add_records_here(raws, told_by=seed.peer_id)
            return news, t1 - t0, time.perf_counter() - t1

        page_bytes = AdmissionConfig().table_page_bytes
        have = Have.of([r.peer_id for r in held[::2]])  # a puller that holds half of them

        async def pages() -> tuple[int, float, float]:
            tables = node._swarm.tables
            t0 = time.perf_counter()
            after, walked = None, 0
            while True:  # a joiner's walk of the whole table, page by page
                page, after, _ = tables.page(after, page_bytes)
                walked += len(page)
                if after is None:
                    break
            t1 = time.perf_counter()
            tables.page(None, page_bytes, have=have)
            return walked, t1 - t0, time.perf_counter() - t1

        swarm, cap = node._swarm, 20

        async def probe_targets() -> tuple[float, float, bool]:
            ring, table = swarm._ring, node._table

            def now() -> None:  # a probe's target on a new view, as while a swarm forms
                ring._key = ()
                swarm._next_finger(cap)

            def before() -> None:  # the same, walking the members in Python with `_can_probe` for each
                ring._key = ()
                live = table.live_ids
                ring.next((p for p in live if (info := table.get(p)) is not None and swarm._can_probe(info)),
                          live.version, max(1, cap // 2))

            now()
            fingers = list(ring.current)
            before()
            same = ring.current == fingers
            return (*_alternating(now, before, repeat), same)

        # a forming member's pull: it names all the peers it holds, the helper lacks a few of them
        forming = b"".join(r.peer_id[:HAVE_CHARS].encode() for i, r in enumerate(held) if i % 50)

        async def pulls() -> tuple[float, float, bool]:
            tables = node._swarm.tables

            def now() -> list[Any]:
                tables.have_digest()  # the asker's list of its whole table
                _, held_now, _, _ = parse_sync({"have": forming})
                return tables.page(None, page_bytes, have=held_now)[0]

            def before() -> list[Any]:
                _have_one_by_one(tables)
                text = forming.decode("ascii")
                held_set = frozenset(text[i:i + HAVE_CHARS] for i in range(0, len(text), HAVE_CHARS))
                return _page_one_by_one(tables, page_bytes, held_set)

            same = now() == before()
            return (*_alternating(now, before, repeat), same)

        news, first_s, again_s = node.run(learn())
        walked, walk_s, have_s = node.run(pages())
        pull_s, pull_before_s, same_pull = node.run(pulls())
        target_s, target_before_s, same_targets = node.run(probe_targets())
        del held
        return {"learned": news, "learn_news_us": round(first_s / len(raws) * 1e6, 1),
                "learn_known_us": round(again_s / len(raws) * 1e6, 1), "paged": walked,
                "page_walk_ms": round(walk_s * 1e3, 2), "page_news_ms": round(have_s * 1e3, 2),
                "pull_forming_us": round(pull_s * 1e6, 1), "pull_forming_before_us": round(pull_before_s * 1e6, 1),
                "pull_forming_speedup": round(pull_before_s / pull_s, 2), "same_pull_page": same_pull,
                "probe_target_ms": round(target_s * 1e3, 3), "probe_target_before_ms": round(target_before_s * 1e3, 3),
                "probe_target_speedup": round(target_before_s / target_s, 2), "same_probe_fingers": same_targets}
    finally:
        seed.close()
        node.close()


def _alternating(now: Callable[[], Any], before: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """The median seconds of `now` and of `before`, called `repeat` times each, alternating and
    each call timed: the machine is shared and noisy."""
    took: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for way, times in ((now, took[0]), (before, took[1])):
            t0 = time.perf_counter()
            way()
            times.append(time.perf_counter() - t0)
    return statistics.median(took[0]), statistics.median(took[1])


def _have_one_by_one(tables: Any) -> bytes:
    """The baseline of a pull's list of held peers: each id's prefix cut and joined in Python."""
    from starling.node.have import HAVE_CHARS

    return "".join(peer_id[:HAVE_CHARS] for peer_id in tables.table.live_ids).encode("ascii", "replace")


def _page_one_by_one(tables: Any, budget: float, held: frozenset[str]) -> list[Any]:
    """The baseline of a page for a pull that names `held`: each of the helper's ids in order
    tested against the set of prefixes, in Python."""
    from starling.node.have import HAVE_CHARS

    page: list[Any] = []
    nbytes = 0
    for peer_id in tables.table.live_ids.in_order():
        if peer_id[:HAVE_CHARS] in held:
            continue
        record = tables.table.get(peer_id).record
        if nbytes + record.wire_bytes > budget:
            break
        page.append(record.wire)
        nbytes += record.wire_bytes
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    if args.members < 2 or args.repeat < 1:
        parser.error("--members must be >= 2 and --repeat >= 1")
    print(json.dumps({**fingers(args.members, args.repeat), **learning(args.members, args.repeat)}))


if __name__ == "__main__":
    main()
