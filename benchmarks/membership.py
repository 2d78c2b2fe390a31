"""Membership at scale: what SWIM costs each peer, how fast a crash and a join are known, and
whether anyone is declared dead who is not.

    python benchmarks/membership.py [--sizes 128,1024,4096] [--processes 8] [--window-s 30]
                                    [--soak-s 0] [--timeout-s 900] [--max-dealers N]
                                    [--settle-s S | --settle-periods K] [--dead-wait-s S]

Each size is one swarm of N bare nodes (no model: the membership layer alone) spread over P
worker processes on this box, on ipc sockets, with the simulator's liveness for that size
(`runtime.simconfig.sim_liveness`: the probe period grows once the box would probe more than
SIM_PROBES_PER_S times a second). Every node sets its meta every 0.5 s, as a training peer's
progress does. Per size it prints one JSON row:
- join_s: until every node sees at least 99% of the others;
- per peer, over a window of `--window-s` once joined: membership messages and bytes sent per
  second, and per probe period (the scaling claim: constant per period, whatever N), the bytes
  per probe period by topic too, and the bytes of the membership updates they carried by
  priority (urgent: claims, refutations, leaves; news: joins and members' own new meta;
  routine: beats passed on), the updates a member queued to pass on, by priority, the news
  still waiting at the window's end, and the news dropped unsent for its age before the
  window and in it (also printed to stderr as soon as measured), from
  `--settle-s` after the swarm formed (by default the window's length, at most 5 s: a large
  swarm's last joiners are still being pulled then), or `--settle-periods` of that size's
  probe periods (each size settles as many periods: the news of the last joins rides on a
  member's messages for up to its retransmit limit, about a dozen periods, before the swarm
  is at rest); and the
  sends that had to open a socket to their peer, per probe period, by topic (past the socket
  cap, a send to a member not used lately opens one and closes another);
- sockets_opened_per_peer_joining: the same opens per peer, by topic, from the start until
  that window; messages_per_peer_joining, the messages each peer sent by then, by topic; and
  rejected_per_peer_joining, what each peer turned down by then, by reason (busy: among
  them, hellos turned away to other members while a loop ran behind);
- cpu_ms_per_peer_period: the workers' CPU over the same window (every thread of each process)
  per peer and probe period, and cores_busy, the cores they kept busy: what bounds the probe
  period a box can carry;
- a separate process joins (join_seen_p99_s: from when it began its join until 99% of the
  nodes know it; victim_join_s: until its own join returned), then is SIGKILLed;
  dead_median_s and dead_max_s: until each node holds it dead (most nodes hold no connection
  to it: they learn it from the claims of those that do, or from their own probes), waited for
  up to `--dead-wait-s` (by default 60 probe periods, at least 120 s);
- never_knew_victim: nodes the join had not reached by the kill; dead_max_of_those_that_knew_s,
  dead_max_s over the others;
- false_deaths: deaths declared of any node but the killed one, over the whole run (with
  `--soak-s S`, a further S seconds of watching after the kill);
- refused_deaths: deaths decided because a dropped connection's reconnects were refused (the
  victim's watchers; any more would be false ones), and bursts_per_peer: gossip rounds sent at
  once on news, over the whole run.
A last row holds the ratios between the smallest and each larger size.
Targets: per-peer messages and bytes at 4096 within 1.5x of 128; at 1024, dead_median_s <= 5,
dead_max_s <= 15, join_seen_p99_s <= 10, false_deaths 0. Run it alone on a 2-core box.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing as mp
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

MEMBERSHIP_TOPICS = ("$probe", "$probe-via", "$gossip", "$want", "$announce", "$sync", "$leave", "$hello")
META_EVERY_S = 0.5
STARTING_AT_ONCE = 16  # nodes a worker starts (binds and joins) at once

VICTIM = textwrap.dedent("""
    import sys, time
    from starling.node import Node, NodeConfig
    from starling.node.swim import Liveness
    from starling.node.transport import TransportConfig
    import json
    listen, join, liveness = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    node = Node(config=NodeConfig(liveness=Liveness(**liveness), join_deadline_s=120.0,
                                  transport=TransportConfig(max_open_dealers=16)))
    began_at = time.monotonic()
    node.start(listen, [join], security="plaintext")
    print(json.dumps({"id": node.peer_id, "began_at": began_at, "joined_at": time.monotonic()}), flush=True)
    while True:
        time.sleep(0.5)
        node.set_meta(step=int(time.monotonic()))
""")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _worker(index: int, count: int, ipc_dir: str, liveness: dict[str, Any], max_dealers: int,
            conn: Any) -> None:
    """Host `count` nodes; answer the parent's commands on `conn`."""
    _raise_fd_limit()
    if os.environ.get("STARLING_BENCH_LOG_DIR"):  # --log-dir: each worker's INFO log, to read what happened
        import logging
        logging.basicConfig(filename=f"{os.environ['STARLING_BENCH_LOG_DIR']}/worker-{index}.log", level=logging.INFO,
                            format="%(asctime)s %(name)s %(message)s")
    from starling.common.heap import building_heap
    from starling.node import Node, NodeConfig
    from starling.node.loop import NetworkThread
    from starling.node.swim import NEWS, Liveness
    from starling.node.transport import TransportConfig

    config = NodeConfig(liveness=Liveness(**liveness), join_deadline_s=600.0, join_timeout_s=30.0, stats_peers=0,
                        transport=TransportConfig(max_open_dealers=max_dealers))
    nodes: list[Any] = []
    # node id -> peer id -> status -> first time, from when the swarm formed on (the victim's
    # times): kept for every peer while it forms, it would be n^2 dicts, more than the tables
    seen: dict[str, dict[str, dict[str, float]]] = {}
    deaths: list[tuple[str, str, float]] = []
    stop, formed = threading.Event(), threading.Event()

    def listener(node_id: str):
        def on_change(change: Any) -> None:
            if formed.is_set():
                first = seen.setdefault(node_id, {}).setdefault(change.peer_id, {})
                first.setdefault(change.new.value, time.monotonic())
            if change.new.value == "dead":
                deaths.append((node_id, change.peer_id, time.monotonic()))
        return on_change

    def meta_loop() -> None:
        step = 0
        while not stop.wait(META_EVERY_S):
            step += 1
            for node in nodes:
                node.set_meta(step=step)

    threading.Thread(target=meta_loop, daemon=True).start()
    heap = contextlib.ExitStack()  # as the simulator's workers do: the tables built while the swarm
    heap.enter_context(building_heap())  # forms stay out of the collector's scans (common/heap.py)
    while True:
        cmd, arg = conn.recv()
        if cmd == "start":  # arg: [(rank, join addresses)]: started at once, as a mass join is
            def start(rank: int, joins: list[str]) -> Any:
                node = Node(config=config)
                node.on_peer_change(listener(node.peer_id))
                return node.start(f"ipc://{ipc_dir}/n{rank}", joins, security="plaintext")

            with concurrent.futures.ThreadPoolExecutor(max_workers=STARTING_AT_ONCE) as pool:
                started = list(pool.map(lambda share: start(*share), arg))
            nodes.extend(started)
            conn.send([node.address for node in started])
        elif cmd == "known":  # the fewest live peers any node here sees, and what that node holds
            if not nodes:
                conn.send((0, {}))
                continue

            async def counts() -> list[int]:  # one call on the nodes' shared network thread
                return [len(n._table.live_ids) for n in nodes]  # no bans here: every live peer counts

            seen_by = NetworkThread.get().run(counts())
            worst = nodes[seen_by.index(min(seen_by))]
            snap = worst.stats.snapshot()
            conn.send((min(seen_by), {"syncs": snap["messages_sent_by_topic"].get("$sync", 0),
                                      "rejected": dict(snap["rejected"]), "pulls": dict(worst._swarm.tables.pulls)}))
        elif cmd == "formed":
            formed.set()
            heap.close()
            conn.send(True)
        elif cmd == "stats":
            out = []
            for n in nodes:
                snap = n.stats.snapshot()
                sent = {t: 0 for t in MEMBERSHIP_TOPICS}
                for per in snap["bytes_sent"].values():
                    for topic, nbytes in per.items():
                        if topic in sent:
                            sent[topic] += nbytes
                msgs = sum(snap["messages_sent_by_topic"].get(t, 0) for t in MEMBERSHIP_TOPICS)
                by_topic = {t: c for t, c in snap["messages_sent_by_topic"].items() if t in MEMBERSHIP_TOPICS}
                out.append((msgs, sum(sent.values()), snap["sockets_opened_by_topic"], by_topic, sent,
                            list(n._swarm.broadcasts.taken), list(n._swarm.broadcasts.queued),
                            n._swarm.broadcasts.count(NEWS), n._swarm.broadcasts.expired, dict(snap["rejected"])))
            conn.send((out, time.process_time()))
        elif cmd == "seen":  # arg: a peer id; per node here: the first time it was alive, dead
            conn.send([(seen.get(n.peer_id, {}).get(arg, {}).get("alive"),
                        seen.get(n.peer_id, {}).get(arg, {}).get("dead")) for n in nodes])
        elif cmd == "deaths":  # and, per node here: deaths it decided on refused reconnects, bursts sent
            conn.send((list(deaths), [(n.stats.refused_deaths, n._swarm.bursts) for n in nodes]))
        elif cmd == "stop":
            stop.set()

            def close(node: Any) -> None:
                try:
                    node.close()
                except Exception:
                    pass
            with concurrent.futures.ThreadPoolExecutor(max_workers=STARTING_AT_ONCE) as pool:
                list(pool.map(close, nodes))
            conn.send(True)
            return


def _per_peer(nodes: list[tuple[Any, ...]], at: int, n: int, digits: int) -> dict[str, float]:
    """The counts by key in field `at` of each node's stats, summed over the nodes, per peer,
    the largest first."""
    total: dict[str, int] = {}
    for stats in nodes:
        for key, count in stats[at].items():
            total[key] = total.get(key, 0) + count
    return {key: round(count / n, digits) for key, count in sorted(total.items(), key=lambda kv: -kv[1])}


def run_size(n: int, processes: int, window_s: float, soak_s: float, timeout_s: float,
             max_dealers: int | None = None, settle_s: float | None = None,
             dead_wait_s: float | None = None, settle_periods: float | None = None) -> dict[str, Any]:
    from starling.runtime.simconfig import sim_liveness

    _raise_fd_limit()
    lv = sim_liveness(n, n)
    liveness = {k: getattr(lv, k) for k in lv.__dataclass_fields__}
    # the simulator's own plan: the socket cap for the swarm that fits a worker's descriptors
    from starling.runtime.capacity import plan_capacity
    max_dealers = plan_capacity(-(-n // processes), n, "ipc", True, max_dealers).max_dealers
    ipc_dir = tempfile.mkdtemp(prefix="starling-membership-")
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    per = [n // processes + (1 if i < n % processes else 0) for i in range(processes)]
    for i in range(processes):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(i, per[i], ipc_dir, liveness, max_dealers, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    row: dict[str, Any] = {"peers": n, "processes": processes, "probe_interval_s": round(lv.probe_interval_s, 3),
                           "max_dealers": max_dealers}
    started = time.monotonic()
    try:
        conns[0].send(("start", [(0, [])]))
        addresses = conns[0].recv()
        # Each wave joins through random members already in: no single seed serves every table.
        rank = 1
        import random
        rng = random.Random(0)
        batch = 16
        while rank < n:
            for i, conn in enumerate(conns):
                share = [(r, [rng.choice(addresses)]) for r in range(rank, min(n, rank + batch)) if r % processes == i]
                conn.send(("start", share))
            wave_started = time.monotonic()
            for conn in conns:
                addresses += conn.recv()
            print(f"membership: a wave of {min(batch, n - rank)} started in {time.monotonic() - wave_started:.1f} s",
                  file=sys.stderr, flush=True)
            rank += batch
            batch = min(batch * 2, 256)
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{n} nodes did not start within {timeout_s} s")
        row["started_s"] = round(time.monotonic() - started, 1)
        print(f"membership: {n} nodes started in {row['started_s']} s", file=sys.stderr, flush=True)
        last_note = time.monotonic()
        while True:
            for conn in conns:
                conn.send(("known", None))
            fewest, held = min((conn.recv() for conn in conns), key=lambda answer: answer[0])
            if fewest >= 0.99 * (n - 1):
                break
            if time.monotonic() - last_note >= 10.0:
                last_note = time.monotonic()
                print(f"membership: {time.monotonic() - started:.0f} s: the node that sees fewest sees {fewest} "
                      f"({held})", file=sys.stderr, flush=True)
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the swarm of {n} did not converge: a node sees {fewest}")
            time.sleep(1.0)
        row["join_s"] = round(time.monotonic() - started, 1)
        print(f"membership: {n} joined in {row['join_s']} s", file=sys.stderr, flush=True)
        for conn in conns:
            conn.send(("formed", None))
        for conn in conns:
            conn.recv()

        def stats() -> tuple[list[tuple[int, int, dict[str, int], dict[str, int], dict[str, int], list[int]]], float]:
            for conn in conns:
                conn.send(("stats", None))
            answers = [conn.recv() for conn in conns]
            return [s for per_node, _ in answers for s in per_node], sum(cpu for _, cpu in answers)

        if settle_periods is not None:
            settle_s = settle_periods * lv.probe_interval_s
        row["settle_s"] = round(min(window_s, 5.0) if settle_s is None else settle_s, 1)
        time.sleep(row["settle_s"])  # past the join's own burst of gossip
        (before, cpu0), t0 = stats(), time.monotonic()
        time.sleep(window_s)
        (after, cpu1), t1 = stats(), time.monotonic()
        span = t1 - t0
        row["cores_busy"] = round((cpu1 - cpu0) / span, 2)
        row["cpu_ms_per_peer_period"] = round((cpu1 - cpu0) / span / n * lv.probe_interval_s * 1000, 2)
        msgs = [(a[0] - b[0]) / span for a, b in zip(after, before)]
        nbytes = [(a[1] - b[1]) / span for a, b in zip(after, before)]
        row["msgs_per_peer_s"] = round(statistics.mean(msgs), 2)
        row["bytes_per_peer_s"] = round(statistics.mean(nbytes), 1)
        row["msgs_per_peer_period"] = round(statistics.mean(msgs) * lv.probe_interval_s, 2)
        row["bytes_per_peer_period"] = round(statistics.mean(nbytes) * lv.probe_interval_s, 1)
        by_topic_bytes = {t: sum(a[4][t] - b[4][t] for a, b in zip(after, before)) / span / n * lv.probe_interval_s
                          for t in MEMBERSHIP_TOPICS}
        row["bytes_per_peer_period_by_topic"] = {t: round(v, 1) for t, v in
                                                 sorted(by_topic_bytes.items(), key=lambda kv: -kv[1]) if v > 0}
        # the updates those messages carried, by priority: urgent (claims, refutations, leaves),
        # news (joins, a member's own new meta), routine (beats passed on)
        row["update_bytes_per_peer_period"] = {
            name: round(sum(a[5][i] - b[5][i] for a, b in zip(after, before)) / span / n * lv.probe_interval_s, 1)
            for i, name in enumerate(("urgent", "news", "routine"))}
        # how many updates a member queued to pass on, by priority, and how much news waits at the
        # window's end: news that waits long after a swarm formed is its joins still queued
        row["updates_queued_per_peer_period"] = {
            name: round(sum(a[6][i] - b[6][i] for a, b in zip(after, before)) / span / n * lv.probe_interval_s, 2)
            for i, name in enumerate(("urgent", "news", "routine"))}
        row["news_waiting_per_peer"] = round(statistics.mean(a[7] for a in after), 1)
        # news a member dropped unsent for its age (`Liveness.news_for_s`), until the window and in it
        row["news_expired_per_peer"] = {"before": round(statistics.mean(b[8] for b in before), 1),
                                        "window": round(statistics.mean(a[8] - b[8] for a, b in zip(after, before)), 1)}
        # sends that opened a socket (past the socket cap, most sends to a member not used lately)
        opened: dict[str, float] = {}
        for a, b in zip(after, before):
            for topic, count in a[2].items():
                opened[topic] = opened.get(topic, 0.0) + (count - b[2].get(topic, 0)) / span / n
        row["sockets_opened_per_peer_period"] = round(sum(opened.values()) * lv.probe_interval_s, 2)
        row["sockets_opened_by_topic"] = {t: round(v * lv.probe_interval_s, 3) for t, v in
                                          sorted(opened.items(), key=lambda kv: -kv[1]) if v > 0}
        row["sockets_opened_per_peer_joining"] = _per_peer(before, 2, n, 1)
        print("membership: window: " + json.dumps({k: row[k] for k in ("msgs_per_peer_period", "bytes_per_peer_period",
                                                                      "bytes_per_peer_period_by_topic",
                                                                      "update_bytes_per_peer_period",
                                                                      "updates_queued_per_peer_period",
                                                                      "news_waiting_per_peer",
                                                                      "news_expired_per_peer")}),
              file=sys.stderr, flush=True)
        row["messages_per_peer_joining"] = _per_peer(before, 3, n, 1)
        row["rejected_per_peer_joining"] = _per_peer(before, 9, n, 2)

        victim = subprocess.Popen([sys.executable, "-c", VICTIM, f"ipc://{ipc_dir}/victim", rng.choice(addresses),
                                   json.dumps(liveness)], stdout=subprocess.PIPE, text=True)
        hello = json.loads(victim.stdout.readline())
        # from when the joiner began: members the seed tells while its join is under way know it
        # before its `start` returns
        vid, joined_at = hello["id"], hello["began_at"]
        row["victim_join_s"] = round(hello["joined_at"] - joined_at, 2)

        def seen() -> list[tuple[float | None, float | None]]:
            for conn in conns:
                conn.send(("seen", vid))
            return [s for conn in conns for s in conn.recv()]

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            alive = sorted(a - joined_at for a, _ in seen() if a is not None)
            if len(alive) >= 0.99 * n:
                break
            time.sleep(0.5)
        alive = sorted(a - joined_at for a, _ in seen() if a is not None)
        row["join_seen_by"] = len(alive)
        row["join_seen_p99_s"] = round(alive[max(0, int(0.99 * n) - 1)], 2) if len(alive) >= 0.99 * n else None
        time.sleep(max(3.0, 3 * lv.probe_interval_s))  # it probes and is probed a while first
        print(f"membership: {row['join_seen_by']} of {n} saw the joiner; killing it", file=sys.stderr, flush=True)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        deadline = killed_at + (max(120.0, 60 * lv.probe_interval_s) if dead_wait_s is None else dead_wait_s)
        while time.monotonic() < deadline:
            dead = [d for _, d in seen() if d is not None]
            if len(dead) >= n:
                break
            time.sleep(0.5)
        views = seen()
        dead = sorted(d - killed_at for _, d in views if d is not None)
        # nodes the join never reached before the kill learn of the victim, if ever, from a
        # table page or a claim kept for its record: the slowest of the nodes that knew it alive
        knew = sorted(d - killed_at for a, d in views if a is not None and d is not None)
        row["never_knew_victim"] = sum(1 for a, _ in views if a is None)
        row["dead_max_of_those_that_knew_s"] = round(knew[-1], 2) if len(knew) == n - row["never_knew_victim"] \
            else None
        row["dead_seen_by"] = len(dead)
        row["dead_median_s"] = round(statistics.median(dead), 2) if dead else None
        row["dead_max_s"] = round(dead[-1], 2) if len(dead) == n else None
        if soak_s:
            time.sleep(soak_s)
            row["soak_s"] = soak_s
        for conn in conns:
            conn.send(("deaths", None))
        answers = [conn.recv() for conn in conns]
        false = [d for deaths, _ in answers for d in deaths if d[1] != vid]
        row["false_deaths"] = len(false)
        per_node = [counts for _, nodes in answers for counts in nodes]
        # deaths decided because a dropped connection's reconnects were refused (the victim's
        # watchers; any more were false), and gossip rounds sent at once on news, per peer
        row["refused_deaths"] = sum(r for r, _ in per_node)
        row["bursts_per_peer"] = round(sum(b for _, b in per_node) / n, 1)
        row["ok"] = True
    except Exception as exc:
        row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"
    finally:
        for conn in conns:
            try:
                conn.send(("stop", None))
                conn.poll(30) and conn.recv()
            except Exception:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    row["total_s"] = round(time.monotonic() - started, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="128,1024,4096")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--soak-s", type=float, default=0.0)
    parser.add_argument("--settle-s", type=float, default=None,
                        help="seconds from formed to the window (default: the window's, at most 5)")
    parser.add_argument("--settle-periods", type=float, default=None,
                        help="probe periods of each size from formed to the window (instead of --settle-s)")
    parser.add_argument("--dead-wait-s", type=float, default=None,
                        help="longest wait for every node to hold the killed one dead (default: 60 periods, "
                             "at least 120 s)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="write each worker's INFO log there")
    parser.add_argument("--max-dealers", type=int, default=None,
                        help="every node's socket cap (default: the simulator's, for the size and the descriptors)")
    args = parser.parse_args()
    if args.max_dealers is not None and args.max_dealers < 1:
        parser.error("--max-dealers must be at least 1")
    if args.settle_s is not None and args.settle_periods is not None:
        parser.error("give --settle-s or --settle-periods, not both")
    for name in ("settle_s", "settle_periods", "dead_wait_s"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, at least 0")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        os.environ["STARLING_BENCH_LOG_DIR"] = args.log_dir
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        row = run_size(n, min(args.processes, n), args.window_s, args.soak_s, args.timeout_s, args.max_dealers,
                       args.settle_s, args.dead_wait_s, args.settle_periods)
        print(json.dumps(row), flush=True)
        rows.append(row)
    ok = [r for r in rows if r.get("ok")]
    if len(ok) > 1:
        base = ok[0]
        print(json.dumps({"ratios_to": base["peers"], **{
            str(r["peers"]): {k: round(r[k] / base[k], 2) for k in
                              ("msgs_per_peer_period", "bytes_per_peer_period", "msgs_per_peer_s", "bytes_per_peer_s")
                              if base.get(k)} for r in ok[1:]}}), flush=True)


if __name__ == "__main__":
    main()
