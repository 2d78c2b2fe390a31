"""Byzantine members: what the defences of the sharded all-reduce do against hostile peers.

    python benchmarks/byzantine.py [--quick] [--only ATTACK[,..]] [--protocol allreduce|streaming-diloco[,..]]
                                   [--attackers 1|2[,..]] [--defences off|on[,..]] [--steps N] [--diloco-steps N]
                                   [--placement adjacent|spread] [--seed S] [--straggler SPEED]

Every run is a simulated swarm of 8 real nodes over inproc sockets (`starling.runtime`'s
`SimPeer`, one training thread per peer, one shared network thread) training `charlm`; 1, then
2, of them attack (`benchmarks/attacks.py`: each attack patches the attacker's own protocol
instances after the protocol is built, so the honest peers run the library as it is). Each
attack runs twice per protocol and attacker count: defences off (aggregator `mean`, one owner
per shard) and on (`centered_clip`, three owners per shard); and once each way with no attacker.

Protocols: `allreduce` (AdamW, every step a round) and `streaming-diloco` (int4 pseudo-gradients,
a small `sync_every` so that there are many rounds; the quorum leader's runs add `quorum`).
Where the attackers sit: their ids sort first among the members (`adjacent`, the default; an
attacker can grind a key to sort where it likes, and the member that sorts first is the one a
drift guard or a fixed owner order would favour), or apart in member order (`spread`).

One JSON row per run ("bench": "run"): the honest peers' mean eval loss, `loss_vs_clean`
(over the no-attacker run with defences off), bytes per honest peer, seconds per round,
`banned_attackers` (attackers banned by every honest peer, with the step and the count of
rounds by then at which the last honest peer banned it, the kind of evidence and whether it
was verifiable), `honest_banned` (bans that honest peers hold against honest peers, with their
kinds: must be 0), and a summary of the trust counts honest peers hold against attackers and
against honest peers. Then a "cost" row per protocol (no attacker: defences on over off, eval
loss, bytes and time per round), a "drift" row (a member that sorts first and holds a drifted
state: the drift guard repairs it from the majority, and no honest peer takes its state), and a
"targets" row:

- defences on: eval loss within 5% of the no-attacker plain run, for every attack (and, reported
  beside it, within 5% of the no-attacker run with defences on: the attack's harm alone);
- defences off: scale (x100), weight, NaN and the lying owner leave the loss >= 20% worse, or
  diverged (reported, to show the attacks bite);
- every attacker of a poisoning attack is banned by every honest peer within 20 rounds (runs
  with defences on);
- no honest peer is ever banned by an honest peer;
- no attacker: the defences cost <= 1% eval loss.

A round: an all-reduce of one vector (allreduce: a step; streaming-diloco: one fragment's sync,
F of them every sync_every steps).

Read allreduce's attacked rows as single runs of a short, aggressive schedule (SGD at lr 0.3
with momentum 0.9, 26 steps): how many poisoned rounds land before a ban depends on timing, and
momentum carries them, so one row moves by several percent from run to run (sign_flip with 2
attackers and defences on gave 1.07, 1.12 and 2.37 in three runs). A swarm of 7 honest peers
with defences on and no attacker ends 0.5% above 8: the rest of a row's excess is the rounds
before the ban. streaming-diloco's rows repeat within about 1%.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from starling.node.swim import Liveness
from starling.runtime import SimConfig, SimPeer, check_config, endpoint_for, wait_for
from starling.runtime.peer import start_together
from starling.tasks import get_task


def _load_attacks() -> Any:
    """benchmarks/attacks.py (the benchmarks are scripts, not a package)."""
    name = "starling_bench_attacks"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "attacks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


attacks = _load_attacks()

PEERS = 8
PROTOCOLS = ("allreduce", "streaming-diloco")
# Generous detectors: this loaded 2-core box starves the network thread at times, and a false
# death would close rounds without a peer (see benchmarks/diloco.py).
BENCH_LIVENESS = Liveness(probe_interval_s=0.5, suspicion_base_s=60.0)
# A round waits this long for a member's part. Honest peers deliver within half a second here
# (defended rounds took at most 0.5 s); what the timeout bounds is how long a round waits for a
# part that never comes (refused, or from a peer banned in the middle of the round).
ROUND_TIMEOUT_S = 3.0
# allreduce trains with SGD (momentum 0.9, lr 0.3: the lowest loss at 40 steps before 1.0 diverged).
# Under AdamW a scaled gradient is normalized away: x100 from one of 8 peers under the plain mean
# cost 1.2% eval loss at 40 steps, so the attacks that scale would not show what they do to SGD.
ALLREDUCE = {"optimizer": "sgd", "lr": 0.3, "momentum": 0.9, "round_timeout_s": ROUND_TIMEOUT_S}
ALLREDUCE_ADAMW = {"optimizer": "adamw", "lr": 3e-3}  # --allreduce-optimizer adamw
DILOCO = {"lr": 3e-3, "sync_every": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.5, "compressor": "int4",
          "round_timeout_s": ROUND_TIMEOUT_S}
QUORUM = 6  # streaming-diloco's quorum for the quorum leader's runs
DEFENCES = {"off": {"aggregator": "mean", "owner_replication": 1},
            "on": {"aggregator": "centered_clip", "owner_replication": 3},
            # one owner per shard: the robust aggregator alone, then half of each round's chunks
            # checked by a member drawn after the round
            "clip": {"aggregator": "centered_clip", "owner_replication": 1},
            "checked": {"aggregator": "centered_clip", "owner_replication": 1, "check_rate": 0.5},
            # and recomputation: allreduce's audits, DiLoCo's checks of pseudo-gradients
            "verified": {"aggregator": "centered_clip", "owner_replication": 1, "check_rate": 0.5}}
RECOMPUTATION = {"allreduce": {"audit_rate": 0.5}, "streaming-diloco": {"verify_rate": 0.5}}
# allreduce: a round per step; streaming-diloco (H = 4, F = 2): a round every 2 steps; 26 rounds
# each. The whole default bench (92 swarms) takes about 20 minutes on a loaded 2-core box (30 and
# 60 steps with 5 s round timeouts took 27).
FULL = {"steps": 26, "diloco_steps": 52, "drift_steps": 12}
QUICK = {"steps": 12, "diloco_steps": 24, "drift_steps": 8}
# targets
DEFENDED_LOSS = 0.05
UNDEFENDED_HARM = 0.20
MUST_HARM = ("scale", "weight", "nan", "lying_owner")
BAN_WITHIN_ROUNDS = 20
DEFENCES_COST = 0.01
DIVERGED = 1e3  # an eval loss above this (or not finite) counts as diverged
HONEST_DEADLINE_S = 600.0  # a run whose honest peers have not finished by then is an error row


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def options_for(protocol: str, defences: str, attack: str | None) -> dict[str, Any]:
    base = dict(ALLREDUCE if protocol == "allreduce" else DILOCO)
    if attack == "quorum_leader":
        base["quorum"] = QUORUM
    return {**base, **defences_of(defences), **(RECOMPUTATION[protocol] if defences == "verified" else {})}


def defences_of(mode: str) -> dict[str, Any]:
    """A mode's options: a name in DEFENCES, or "checked:RATE" (one owner, that check_rate)."""
    if mode.startswith("checked:"):
        rate = float(mode.split(":", 1)[1])
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"check rate must be in (0, 1], got {rate}")
        return {**DEFENCES["checked"], "check_rate": rate}
    return DEFENCES[mode]


def form(sims: list[SimPeer]) -> None:
    """Start the peers, each joining through the first, and wait until all see each other."""
    address = sims[0].start([])
    start_together(sims[1:], [address])
    wait_for(lambda: all(len(s.node.live_peers()) == len(sims) - 1 for s in sims), 60.0, "the swarm to form")


def rounds_by(proto: Any, step: int) -> int:
    """Rounds (all-reduces of one vector) a peer has started by the end of `step` steps."""
    if not hasattr(proto, "schedule"):
        return step
    return sum(1 for s in range(1, step + 1) if proto.schedule.sending_at(s) is not None)


def attacker_ranks(sims: list[SimPeer], count: int, placement: str) -> list[int]:
    """The ranks of the peers whose ids sort first (adjacent in owner order), or of peers
    spread over the member order."""
    order = sorted(range(len(sims)), key=lambda r: sims[r].node.peer_id)
    if placement == "spread":
        step = len(order) // max(1, count)
        return sorted(order[k * step] for k in range(count))
    return sorted(order[:count])


def run_swarm(protocol: str, attack_name: str | None, attackers: int, defences: str, steps: int,
              placement: str = "adjacent", seed: int = 0, straggler: float = 1.0) -> dict[str, Any]:
    """One swarm to the end of the honest peers' steps; the row of what happened. `straggler`
    below 1: the honest peer whose id sorts last computes at that speed (0.33: 3x slower)."""
    options = options_for(protocol, defences, attack_name)
    config = SimConfig(peers=PEERS, protocol=protocol, task="charlm", steps=steps, options=options, seed=seed,
                       liveness=BENCH_LIVENESS)
    check_config(config)
    task = get_task(config.task, **config.task_options)
    run_id = uuid.uuid4().hex[:8]
    sims = [SimPeer(config, task, rank, endpoint_for("inproc", rank, "", run_id)) for rank in range(PEERS)]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    threads: dict[int, threading.Thread] = {}
    try:
        form(sims)
        bad = attacker_ranks(sims, attackers, placement) if attack_name else []
        honest = [s for s in sims if s.rank not in bad]
        slow = None
        if straggler < 1.0:
            slow = max(honest, key=lambda s: s.node.peer_id).rank
            speeds = tuple(straggler if r == slow else 1.0 for r in range(PEERS))
            for sim in sims:
                sim.config = dataclasses.replace(sim.config, peer_speed=speeds)
        ids = {s.node.peer_id: s.rank for s in sims}
        bans: dict[tuple[int, str], tuple[int, float]] = {}  # (observer rank, banned id) -> (its step, time)

        def watch(sim: SimPeer) -> None:
            sim.node.trust.on_ban(lambda peer: bans.setdefault((sim.rank, peer), (sim.step, time.time())))

        for sim in sims:
            sim.create_protocol()
            watch(sim)
        attack_objects = []
        if attack_name:
            board = attacks.Board(len(honest)) if attack_name in attacks.NEEDS_BOARD else None
            if board is not None:
                for sim in honest:
                    attacks.tap(sim.proto, board)
            for rank in bad:
                attack = attacks.make(attack_name)
                attack.apply(sims[rank].proto, board=board, seed=seed * 101 + rank)
                attack_objects.append(attack)
        t0 = time.time()
        threads.update({s.rank: threading.Thread(target=s.train, args=(t0,), daemon=True) for s in sims})
        for thread in threads.values():
            thread.start()
        # Attackers banned everywhere wait out their rounds, and so does an honest peer that the
        # other honest peers banned (cut off): nobody waits for them, nor does this run.
        deadline = time.monotonic() + HONEST_DEADLINE_S
        while True:
            training = [s for s in honest if threads[s.rank].is_alive()]
            if not training or all(s.node.peer_id in _cut_off(honest) for s in training):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"honest peers still training after {HONEST_DEADLINE_S:.0f} s")
            time.sleep(0.2)
        for sim in honest:
            if sim.result.status == "finished":
                sim.collect()
        trust = {s.rank: s.node.run(_trust_of(s.node)) for s in honest}
        row = _row(protocol, attack_name, attackers, defences, steps, placement, options, sims, bad, honest, ids,
                   trust, bans, attack_objects, t0)
        return {**row, "straggler": {"rank": slow, "speed": straggler}} if slow is not None else row
    finally:
        for sim in sims:
            sim.close()
        # Peers still training (attackers, peers cut off) fail their next step on the closed
        # node: let them end here rather than in torch's code at interpreter exit.
        deadline = time.monotonic() + 2 * ROUND_TIMEOUT_S + 5.0
        for thread in threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        torch.set_num_threads(threads_before)


def _cut_off(honest: list[SimPeer]) -> set[str]:
    """The peers that more than half of the honest peers have banned."""
    held: Counter[str] = Counter()
    for s in honest:
        try:
            held.update(tuple(s.node.trust.banned))  # written by the network thread: a copy may race
        except RuntimeError:
            pass
    return {p for p, n in held.items() if 2 * n > len(honest)}


async def _trust_of(node: Any) -> dict[str, Any]:
    """The node's trust as plain data, read on its network thread."""
    trust = node.trust
    return {"counts": {p: dict(c) for p, c in trust.counts.items()},
            "banned": {p: (b.kind, b.round, b.verifiable) for p, b in trust.banned.items()}}


def _row(protocol: str, attack_name: str | None, attackers: int, defences: str, steps: int, placement: str,
         options: dict[str, Any], sims: list[SimPeer], bad: list[int], honest: list[SimPeer], ids: dict[str, int],
         trust: dict[int, dict[str, Any]], bans: dict[tuple[int, str], tuple[int, float]],
         attack_objects: list[Any], t0: float) -> dict[str, Any]:
    cut_off = sorted(s.rank for s in honest if s.result.status == "running")  # banned by the other honest peers
    ended = [s for s in honest if s.result.status != "running"]
    losses = [s.result.eval_loss for s in ended]
    failed = {s.rank: s.result.error for s in ended if s.result.status != "finished"}
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    # an honest peer that failed on a non-finite value (its pseudo-gradient, its loss) diverged
    diverged = (len(finite) < len(losses) or any(v > DIVERGED for v in finite)) and \
        all("NonFinite" in (e or "") or "finite" in (e or "") for e in failed.values())
    if failed and not diverged:
        raise RuntimeError(f"honest peer {min(failed)} failed: {failed[min(failed)]}")
    eval_loss = statistics.fmean(finite) if finite and not diverged else None
    proto: Any = honest[0].proto
    rounds = rounds_by(proto, steps)
    wall = statistics.fmean((s.result.train_end or time.time()) - t0 for s in ended)
    attacker_ids = {sims[r].node.peer_id for r in bad}
    # attackers banned by every honest peer: when the last honest peer banned it
    banned_attackers = []
    for peer in sorted(attacker_ids):
        held = [trust[s.rank]["banned"].get(peer) for s in honest]
        if all(h is not None for h in held):
            step = max(bans.get((s.rank, peer), (steps, 0.0))[0] for s in honest)
            kinds = Counter(h[0] for h in held)
            banned_attackers.append({"rank": ids[peer], "step": step, "rounds": rounds_by(proto, step + 1),
                                     "kind": kinds.most_common(1)[0][0],
                                     "verifiable": all(h[2] for h in held)})
    banned_by_some = sorted({ids[p] for s in honest for p in trust[s.rank]["banned"] if p in attacker_ids})
    honest_banned = Counter()
    for s in honest:
        for peer, (kind, _, verifiable) in trust[s.rank]["banned"].items():
            if peer not in attacker_ids:
                honest_banned[f"{kind}{'' if verifiable else ' (witnessed)'}"] += 1
    against: dict[str, Counter] = {"attackers": Counter(), "honest": Counter()}
    for s in honest:
        for peer, counts in trust[s.rank]["counts"].items():
            side = "attackers" if peer in attacker_ids else "honest"
            against[side].update(counts)
    suspicion = _suspicion_of(proto, attacker_ids, ids)
    return {"bench": "run", "protocol": protocol, "attack": attack_name or "none", "attackers": len(bad),
            "attacker_ranks": bad, "placement": placement if bad else None, "defences": defences,
            "steps": steps, "rounds": rounds, "options": options,
            "eval_loss": eval_loss, "eval_losses": losses, "diverged": diverged, "honest_failed": failed,
            "bytes_per_peer": statistics.fmean(s.result.bytes_sent for s in ended), "honest_cut_off": cut_off,
            "s_per_round": wall / max(1, rounds), "wall_s": round(wall, 2),
            "banned_attackers": banned_attackers, "banned_by_some": banned_by_some,
            "honest_banned": sum(honest_banned.values()), "honest_banned_kinds": dict(honest_banned),
            "trust_counts": {side: dict(sorted(c.items())) for side, c in against.items()},
            "suspicion": suspicion, "checks": _checks_of(proto),
            "attack_rounds": sum(a.rounds for a in attack_objects),
            "attack_estimated": sum(a.estimated for a in attack_objects)}


def _suspicion_of(proto: Any, attacker_ids: set[str], ids: dict[str, int]) -> dict[str, Any]:
    """The running test of accumulated evidence (collectives/suspicion.py) as one honest peer
    holds it, over its reducers: each member's flagged and scored rounds, its highest statistic,
    and its whole-round cosines with the median (for calibration)."""
    def key(member: str) -> str:
        return f"{'attacker' if member in attacker_ids else 'honest'}:{ids.get(member)}"

    out: dict[str, Any] = {"max_statistic": {}, "flags": {}, "rounds": {}, "cos_by_member": {}}
    for reducer in getattr(proto, "reducers", []):
        suspicion = getattr(reducer, "suspicion", None)
        if suspicion is None:
            continue
        ledger = suspicion.ledger
        for _t, member, cos in ledger.history:
            out["cos_by_member"].setdefault(key(member), []).append(round(cos, 3))
        for member, stat in ledger.peak.items():
            out["max_statistic"][key(member)] = round(max(stat, out["max_statistic"].get(key(member), 0.0)), 3)
        for name, counts in (("flags", ledger.flags), ("rounds", ledger.rounds)):
            for member, n in counts.items():
                out[name][key(member)] = out[name].get(key(member), 0) + n
    return out


def _checks_of(proto: Any) -> dict[str, Any]:
    """One honest peer's checks of owners' averages (collectives/checking.py), over its reducers,
    and its audits or checks of pseudo-gradients (protocols/audit.py, protocols/verification.py)."""
    out: Counter = Counter()
    for reducer in getattr(proto, "reducers", []):
        checks = getattr(reducer, "checks", None)
        if checks is not None:
            out.update(checks.counts)
    auditor, verifier = getattr(proto, "auditor", None), getattr(proto, "verifier", None)
    if auditor is not None:
        out.update(auditor.counts())
    if verifier is not None:
        out.update(verifier.counts)
        margins = sorted(m for _, m in verifier.margins)
        return {**out, "margins": [round(m, 5) for m in margins]}
    return dict(out)


def drift_row(steps: int, seed: int = 0) -> dict[str, Any]:
    """allreduce with the drift guard every 2 steps; the member whose id sorts first starts
    from drifted parameters. The guard must repair it from the majority and no honest peer."""
    options = {**ALLREDUCE, "check_every": 2}
    config = SimConfig(peers=PEERS, protocol="allreduce", task="charlm", steps=steps, options=options, seed=seed,
                       liveness=BENCH_LIVENESS)
    check_config(config)
    task = get_task(config.task)
    run_id = uuid.uuid4().hex[:8]
    sims = [SimPeer(config, task, rank, endpoint_for("inproc", rank, "", run_id)) for rank in range(PEERS)]
    torch.set_num_threads(1)
    try:
        form(sims)
        for sim in sims:
            sim.create_protocol()
        (drifted,) = attacker_ranks(sims, 1, "adjacent")
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed + 1)
            for p in sims[drifted].proto.model.parameters():  # type: ignore[union-attr]
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        t0 = time.time()
        threads = [threading.Thread(target=s.train, args=(t0,), daemon=True) for s in sims]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        digests = {s.rank: _digest(s.proto.model) for s in sims}  # type: ignore[union-attr]
        repairs = {s.rank: s.proto.guard.repairs for s in sims}  # type: ignore[union-attr]
        honest_repairs = sum(n for r, n in repairs.items() if r != drifted)
        agree = len(set(digests.values())) == 1
        return {"bench": "drift", "protocol": "allreduce", "steps": steps, "check_every": 2, "drifted_rank": drifted,
                "drifted_sorts_first": True, "repairs": repairs, "drifted_repaired": repairs[drifted] >= 1,
                "honest_repairs": honest_repairs, "all_agree_at_end": agree,
                "met": repairs[drifted] >= 1 and honest_repairs == 0 and agree}
    finally:
        for sim in sims:
            sim.close()


def _digest(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(rows: list[dict[str, Any]], drift: dict[str, Any] | None) -> dict[str, Any]:
    clean = {(r["protocol"], r["defences"]): r for r in rows if r["attack"] == "none"}
    attacked = [r for r in rows if r["attack"] != "none"]
    misses: dict[str, list[str]] = defaultdict(list)
    for r in attacked:
        tag = f"{r['protocol']}/{r['attack']}/{r['attackers']}"
        if r["defences"] != "off":
            if r["eval_loss"] is None or r.get("loss_vs_clean") is None or r["loss_vs_clean"] > 1 + DEFENDED_LOSS:
                misses["defended_loss"].append(f"{tag}: {r.get('loss_vs_clean')}")
            same = r.get("loss_vs_clean_same_defences")
            if r["eval_loss"] is None or same is None or same > 1 + DEFENDED_LOSS:
                misses["defended_loss_vs_defended_clean"].append(f"{tag}: {same}")
            poisons = attacks.make(r["attack"]).poisons
            if poisons:
                banned = {b["rank"]: b for b in r["banned_attackers"]}
                late = [rank for rank in r["attacker_ranks"]
                        if rank not in banned or banned[rank]["rounds"] > BAN_WITHIN_ROUNDS]
                if late:
                    misses["banned_within"].append(
                        f"{tag}: " + ", ".join(f"rank {k} " + (f"after {banned[k]['rounds']} rounds" if k in banned
                                                               else "not banned") for k in late))
        elif r["attack"] in MUST_HARM and not (r["diverged"] or (r.get("loss_vs_clean") or 0) >= 1 + UNDEFENDED_HARM):
            misses["undefended_harm"].append(f"{tag}: {r.get('loss_vs_clean')}")
        if r["honest_banned"]:
            misses["honest_banned"].append(f"{tag}/{r['defences']}: {r['honest_banned_kinds']}")
    costs = {}
    for protocol in sorted({r["protocol"] for r in rows}):
        for mode in sorted({r["defences"] for r in rows}):
            off, on = clean.get((protocol, "off")), clean.get((protocol, mode))
            if mode != "off" and off and on:
                costs[protocol, mode] = _ratio(on["eval_loss"], off["eval_loss"])
                if costs[protocol, mode] is None or costs[protocol, mode] > 1 + DEFENCES_COST:
                    misses["defences_cost"].append(f"{protocol}/{mode}: {costs[protocol, mode]}")
    for r in rows:
        if r["attack"] == "none" and r["honest_banned"]:
            misses["honest_banned"].append(f"{r['protocol']}/none/{r['defences']}: {r['honest_banned_kinds']}")
    checked = {"defended_loss": any(r["defences"] != "off" for r in attacked),
               "defended_loss_vs_defended_clean": any(r["defences"] != "off" for r in attacked),
               "undefended_harm": any(r["defences"] == "off" and r["attack"] in MUST_HARM for r in attacked),
               "banned_within": any(r["defences"] != "off" for r in attacked),
               "honest_banned": bool(rows), "defences_cost": bool(costs)}
    row = {"bench": "targets", **{f"{name}_met": (not misses.get(name)) if ran else None
                                  for name, ran in checked.items()},
           "misses": dict(misses)}
    if drift is not None:
        row["drift_met"] = drift["met"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs, for a smoke test")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated attacks (default all: {', '.join(attacks.ATTACKS)}, and drift); "
                        "'none' runs only the no-attacker runs, 'drift' the drift row")
    parser.add_argument("--protocol", default=",".join(PROTOCOLS), help="comma-separated protocols")
    parser.add_argument("--attackers", default="1,2", help="comma-separated attacker counts (1, 2)")
    parser.add_argument("--defences", default="off,on",
                        help="comma-separated: off, on, clip, checked, checked:RATE, verified")
    parser.add_argument("--steps", type=int, default=None, help="allreduce steps (rounds)")
    parser.add_argument("--diloco-steps", type=int, default=None, help="streaming-diloco steps")
    parser.add_argument("--drift-steps", type=int, default=None)
    parser.add_argument("--placement", choices=("adjacent", "spread"), default="adjacent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--straggler", type=float, default=1.0,
                        help="the speed of one honest peer against the others' (0.33: 3x slower); 1: none")
    parser.add_argument("--allreduce-optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="allreduce's optimizer: sgd (momentum 0.9, lr 0.3; default) or adamw (lr 3e-3)")
    parser.add_argument("--no-clean", action="store_true",
                        help="skip the no-attacker runs (loss_vs_clean is then null)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    names = args.only.split(",") if args.only else [*attacks.ATTACKS, "drift"]
    unknown = set(names) - set(attacks.ATTACKS) - {"none", "drift"}
    if unknown:
        parser.error(f"--only: unknown attack {', '.join(sorted(unknown))}")
    protocols = args.protocol.split(",")
    if set(protocols) - set(PROTOCOLS):
        parser.error(f"--protocol: one of {', '.join(PROTOCOLS)}")
    try:
        counts = [int(n) for n in args.attackers.split(",")]
    except ValueError:
        parser.error("--attackers takes 1, 2 or 1,2")
    if not set(counts) <= {1, 2}:
        parser.error("--attackers takes 1, 2 or 1,2")
    if not 0.0 < args.straggler <= 1.0:
        parser.error(f"--straggler must be in (0, 1], got {args.straggler}")
    modes = args.defences.split(",")
    try:
        for mode in modes:
            defences_of(mode)
    except (KeyError, ValueError):
        parser.error(f"--defences takes a comma-separated list of {', '.join(DEFENCES)}")

    if args.allreduce_optimizer == "adamw":
        ALLREDUCE.update(ALLREDUCE_ADAMW)
        ALLREDUCE.pop("momentum", None)
    rows: list[dict[str, Any]] = []
    for protocol in protocols:
        steps = args.steps if protocol == "allreduce" else args.diloco_steps
        clean: dict[str, dict[str, Any]] = {}
        if not args.no_clean:
            for mode in dict.fromkeys(["off", *modes]):  # loss_vs_clean divides by the plain run
                row = run_swarm(protocol, None, 0, mode, steps, seed=args.seed, straggler=args.straggler)
                clean[mode] = row
                row["loss_vs_clean"] = _ratio(row["eval_loss"], clean["off"]["eval_loss"])
                emit(row)
                rows.append(row)
            for mode in clean:
                if mode == "off":
                    continue
                off, on = clean["off"], clean[mode]
                emit({"bench": "cost", "protocol": protocol, "defences": mode,
                      "eval_loss_ratio": _ratio(on["eval_loss"], off["eval_loss"]),
                      "bytes_ratio": _ratio(on["bytes_per_peer"], off["bytes_per_peer"]),
                      "time_per_round_ratio": _ratio(on["s_per_round"], off["s_per_round"]),
                      "met": (_ratio(on["eval_loss"], off["eval_loss"]) or math.inf) <= 1 + DEFENCES_COST})
        for name in names:
            if name in ("none", "drift"):
                continue
            if name == "quorum_leader" and protocol != "streaming-diloco":
                continue  # a quorum is DiLoCo's
            if name == "slander" and protocol != "allreduce" and not args.only:
                continue  # it does not depend on the protocol: once is enough by default
            for count in counts:
                for mode in modes:
                    try:
                        row = run_swarm(protocol, name, count, mode, steps, args.placement, args.seed,
                                        args.straggler)
                    except Exception as exc:  # one run that could not finish is a row, not the end of the bench
                        row = {"bench": "run", "protocol": protocol, "attack": name, "attackers": count,
                               "defences": mode, "error": f"{type(exc).__name__}: {exc}", "eval_loss": None,
                               "diverged": False, "banned_attackers": [], "attacker_ranks": [], "honest_banned": 0,
                               "honest_banned_kinds": {}}
                    base = clean.get("off", {}).get("eval_loss")
                    row["loss_vs_clean"] = _ratio(row["eval_loss"], base)
                    # the attack's own harm, the defences' cost taken out
                    row["loss_vs_clean_same_defences"] = _ratio(row["eval_loss"], clean.get(mode, {}).get("eval_loss"))
                    emit(row)
                    rows.append(row)
    drift = None
    if "drift" in names:
        drift = drift_row(args.drift_steps, args.seed)
        emit(drift)
    emit(targets(rows, drift))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
