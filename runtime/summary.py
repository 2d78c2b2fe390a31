"""What a simulated run reports: each peer's result, the run's headline numbers, and the
files `--out` writes."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starling.node import Node
from starling.runtime.simconfig import SIM_PROBES_PER_S, SimConfig, SimError

# What spsa's summary calls near one byte per projected gradient (docs/benchmarks.md, SPSA).
SPSA_TARGET_BYTES = 2.0


@dataclass
class PeerResult:
    rank: int
    peer_id: str
    status: str = "running"  # finished | killed | left | failed
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None
    bytes_sent: int = 0  # protocol topics (not starting with "$")
    bytes_sent_total: int = 0  # including membership traffic
    bytes_received: int = 0
    joined_at_step: int = 0
    train_end: float = 0.0  # time.time() when its last step finished
    links: dict[str, float] = field(default_factory=dict)
    protocol_info: dict[str, Any] = field(default_factory=dict)  # the protocol's describe() at the end, as JSON data
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sent_by_topic(node: Node, since: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes `node` sent, by topic; less what it had sent at `since` (an earlier result of this)."""
    out: dict[str, int] = {}
    for per_topic in node.stats.snapshot()["bytes_sent"].values():
        for topic, n in per_topic.items():
            out[topic] = out.get(topic, 0) + n
    if since:
        out = {topic: n - since.get(topic, 0) for topic, n in out.items() if n > since.get(topic, 0)}
    return out


def json_data(value: Any) -> Any:
    """`value` as plain JSON data: a non-finite float becomes "inf", "-inf" or "nan" (as in
    privacy reports), and anything JSON has no type for becomes its str()."""
    if isinstance(value, Mapping):
        return {str(k): json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_data(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass
class SimResult:
    config: SimConfig
    peers: list[PeerResult]
    summary: dict[str, Any]

    def write(self, out_dir: str | Path) -> None:
        """Under `out_dir`: peer-RANK.jsonl (one JSON object per step), peers.json (each
        peer's final numbers) and summary.json."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("peer-*.jsonl"):
            stale.unlink()
        for peer in self.peers:
            with open(out / f"peer-{peer.rank}.jsonl", "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in peer.records)
        finals = [{k: v for k, v in peer.to_json().items() if k != "records"} for peer in self.peers]
        (out / "peers.json").write_text(json.dumps(finals, indent=1) + "\n")
        (out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")


def summarize(config: SimConfig, peers: list[PeerResult], t0: float) -> dict[str, Any]:
    """The run's headline numbers (see the CLI's --json)."""
    failed = [p for p in peers if p.status == "failed"]
    if failed:
        raise SimError(f"peer {failed[0].rank} failed: {failed[0].error}")
    finished = [p for p in peers if p.status == "finished"]
    if not finished:
        raise SimError("no peer finished the run")
    tails = []
    for p in finished:
        losses = [r["loss"] for r in p.records if r.get("sampled", True)]  # steps it trained
        tail = losses[-max(1, len(losses) // 10):]
        if tail:
            tails.append(sum(tail) / len(tail))
    evals = [p.eval_loss for p in finished if p.eval_loss is not None]
    links = {k: sum(p.links.get(k, 0) for p in peers) for k in ("dropped", "admitted", "delay_s")}
    return {
        **config.describe(),
        "train_loss": sum(tails) / len(tails) if tails else None,
        "eval_loss": sum(evals) / len(evals) if evals else None,
        "eval_loss_peer0": next((p.eval_loss for p in finished if p.rank == 0), None),
        "bytes_sent_per_peer": sum(p.bytes_sent for p in peers) / len(peers),
        "bytes_sent_per_peer_total": sum(p.bytes_sent_total for p in peers) / len(peers),
        "wall_s": max(p.train_end for p in peers) - t0,
        "final_peers": len(finished),
        "peer_status": {str(p.rank): p.status for p in peers},
        "messages_dropped": int(links["dropped"]),
        "link_delay_s_per_peer": links["delay_s"] / len(peers),
        # each peer's training thread: the share of its steps' wall time spent computing
        "busy_share": {str(p.rank): busy_share(p.records) for p in peers},
        # the protocol's own account of the run (sketch-dp: sketch size and privacy spent), from the
        # lowest-ranked peer that finished
        "protocol_info": min(finished, key=lambda p: p.rank).protocol_info,
        **spsa_bytes(peers, min(finished, key=lambda p: p.rank).protocol_info),
        **participation(peers),
    }


def participation(peers: list[PeerResult]) -> dict[str, Any]:
    """With client sampling: the share of the peers training at each step that were drawn for it,
    its mean, least and most, and per step (the same for every step of one round). Empty without."""
    if not any(r.get("sampled") is False for p in peers for r in p.records):
        return {}
    drawn: dict[int, list[bool]] = {}
    for p in peers:
        for r in p.records:
            drawn.setdefault(int(r["step"]), []).append(r.get("sampled", True) is not False)
    shares = [sum(v) / len(v) for _, v in sorted(drawn.items())]
    return {"participation": {"mean": sum(shares) / len(shares), "min": min(shares), "max": max(shares),
                              "clients_per_step": [sum(v) for _, v in sorted(drawn.items())][:1000]}}


def busy_share(records: Iterable[Mapping[str, Any]]) -> float | None:
    """How busy a peer's training thread was: the sum of its steps' compute over the sum of
    their wall time (each step record's `compute_s` and `step_wall_s`), so that a long step
    weighs by its length; the rest of the wall time was spent waiting on the network. An
    emulated slow peer's sleep (`peer_speed`) falls between steps and is in neither. None: no
    step took any time."""
    compute = wall = 0.0
    for record in records:
        compute += record["compute_s"]
        wall += record["step_wall_s"]
    return compute / wall if wall > 0.0 else None


def liveness_note(summary: Mapping[str, Any]) -> str | None:
    """One line for a run summary whose probe period the simulator stretched to what the box
    carries (None otherwise)."""
    base, period = summary.get("probe_interval_scaled_from_s"), summary.get("probe_interval_s")
    if base is None or period is None:
        return None
    return (f"probe period {period:g} s, not {base:g} s: stretched so that this box's {summary.get('peers')} peers "
            f"probe about {SIM_PROBES_PER_S} times a second in all (deaths take that much longer to be seen; "
            "SimConfig.liveness sets it)")


BUSY_LISTED = 16  # a run of more peers sums their busy shares up in its line


def busy_note(summary: Mapping[str, Any]) -> str | None:
    """One line for a run summary: each peer's busy share, with its speed where peers differ
    (None: no peer took a step)."""
    shares = {int(rank): share for rank, share in (summary.get("busy_share") or {}).items() if share is not None}
    if not shares:
        return None
    speeds = list(summary.get("peer_speed") or ())
    differ = len(set(speeds)) > 1

    def peer(rank: int) -> str:
        speed = f" (speed {speeds[rank]:g})" if differ and rank < len(speeds) else ""
        return f"{rank} {shares[rank]:.1%}{speed}"

    if len(shares) <= BUSY_LISTED:
        return "busy (compute over step wall time), by peer: " + ", ".join(peer(rank) for rank in sorted(shares))
    order = sorted(shares, key=lambda rank: (shares[rank], rank))  # a line per thousand peers reads as noise
    median = shares[order[len(order) // 2]]
    return (f"busy (compute over step wall time), over {len(shares)} peers: least peer {peer(order[0])}, "
            f"median {median:.1%}, most peer {peer(order[-1])} (summary.json's busy_share has each)")


def spsa_bytes(peers: list[PeerResult], info: Mapping[str, Any]) -> dict[str, Any]:
    """For `spsa` only: what the nodes sent on its topics per projected gradient delivered, and
    the `samples` that would bring that near SPSA_TARGET_BYTES (None if it is there already).

    One projected gradient delivered is one peer's code applied by another peer: each peer
    counts, in every record it applied, the others' codes (contributors - 1, times `samples`).
    Sent bytes are every peer's protocol topics as its node counted them (headers and record
    keys included), so the figure is what the "one byte" costs above the socket. Each step's
    codes travel in one message per peer, so a fixed cost per message is spread over `samples`."""
    if info.get("name") != "spsa":
        return {}
    samples = int((info.get("config") or {}).get("samples", 1))
    delivered = samples * sum(max(0, int(r.get("peers") or 1) - 1) for p in peers for r in p.records)
    per_gradient = sum(p.bytes_sent for p in peers) / delivered if delivered else None
    suggested = None
    if per_gradient is not None and per_gradient > SPSA_TARGET_BYTES:
        fixed = (per_gradient - 1.0) * samples  # bytes above the codes, per message's worth of samples
        suggested = 1 << max(0, math.ceil(math.log2(fixed / (SPSA_TARGET_BYTES - 1.0))))
    return {"projected_gradients_delivered": delivered, "bytes_per_projected_gradient": per_gradient,
            "suggested_samples": suggested}


def spsa_bytes_note(summary: Mapping[str, Any]) -> str | None:
    """One line for a run summary: spsa's bytes per projected gradient and, when that is well
    above one byte, the `--samples` that brings it near SPSA_TARGET_BYTES (None: not spsa)."""
    per_gradient = summary.get("bytes_per_projected_gradient")
    if per_gradient is None:
        return None
    samples = int(((summary.get("protocol_info") or {}).get("config") or {}).get("samples", 1))
    line = f"spsa sent {per_gradient:.2f} B per projected gradient (samples={samples})"
    better = summary.get("suggested_samples")
    if not better:
        return line
    expected = 1.0 + (per_gradient - 1.0) * samples / better
    return (f"{line}: one message per peer per step, whose headers dominate; --samples {better} sends "
            f"about {expected:.1f} B, for {better / samples:g}x the forward passes per step")
