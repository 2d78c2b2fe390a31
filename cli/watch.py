"""`starling node watch ADDR`: a live table of one node and every peer it knows.

Every `--interval-s` it asks the node for its status (`$status`, the request `node status`
makes) and redraws: each peer's status, its step, loss and last sync (from the beat
meta that training peers publish, so one node shows them all), the bytes per second
between the watched node and that peer (from the difference of two answers), and what the
watched node holds against it (`flagged`: the parts of it that the node refused, screened,
clipped or disputed, or BANNED). The watched node's own row shows its totals. A node that
does not answer stays on screen, marked so, and is asked again. Ctrl-C (or SIGTERM) ends it
with exit status 0.

The answer comes from whoever listens at ADDR, so it is read as untrusted: every value is
checked for its type, and every text is shortened and stripped of control characters
before it reaches the terminal.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
import zmq
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from starling.cli.shared import EXPECTED_ERRORS, check_seconds, fail
from starling.node.address import parse_address
from starling.node.identity import Identity

STATUS_STYLE = {"self": "bold", "alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
FLAGGED = ("refused", "screened", "clipped", "disputed")  # the trust counts summed in the `flagged` column
_ORDER = {"alive": 0, "suspect": 1, "dead": 2, "left": 3}


class Malformed(ValueError):
    """The node's answer is not shaped like a status."""


def node_watch(
    address: str = typer.Argument(..., help="Join address of the node to watch."),
    interval_s: float = typer.Option(1.0, "--interval-s", help="Seconds between two looks at the node."),
    key: Optional[Path] = typer.Option(None, "--key", help="Identity to authenticate with (for allowlisted swarms)."),
    timeout_s: float = typer.Option(5.0, "--timeout-s", help="How long one look waits for the node's answer."),
) -> None:
    """Watch a running node: its peers, their status, step, loss, bytes/s in and out and last sync,
    redrawn every --interval-s until Ctrl-C."""
    from starling.node.client import ClientError, submit_query

    try:
        check_seconds("--interval-s", interval_s)
        check_seconds("--timeout-s", timeout_s)
        parse_address(address)
        identity = Identity.load(key) if key else Identity.generate()  # one identity for every look
    except EXPECTED_ERRORS as exc:
        fail(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    view = WatchView(address, interval_s)
    with Live(view.render(), console=Console(), auto_refresh=False) as live:
        while not stop.is_set():
            asked = time.monotonic()
            answer = submit_query(address, identity=identity, timeout_s=timeout_s)
            while not answer.done() and not stop.wait(0.05):
                if time.monotonic() - view.drawn_at >= interval_s:  # ages move on while the node is silent
                    live.update(view.render(), refresh=True)
            if stop.is_set():
                answer.cancel()
                break
            try:
                view.answered(answer.result(), time.monotonic())
            except (ClientError, Malformed, zmq.ZMQError, OSError) as exc:  # shown; the next look may do better
                view.failed(str(exc))
            live.update(view.render(), refresh=True)
            stop.wait(max(0.0, interval_s - (time.monotonic() - asked)))


def clean(value: Any, limit: int = 48) -> str:
    """Remote text made safe to print: at most `limit` characters, none of them control
    characters (an escape sequence would drive the terminal)."""
    text = str(value)
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def number(value: Any) -> float | None:
    """A finite number from an untrusted answer, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def per_peer(table: Any) -> dict[str, int]:
    """Bytes per peer, summed over topics, from a stats table {peer: {topic: bytes}}."""
    if not isinstance(table, dict):
        raise Malformed("stats bytes are not a map")
    out = {}
    for peer, topics in table.items():
        if not isinstance(topics, dict):
            raise Malformed("stats bytes of a peer are not a map")
        out[str(peer)] = int(sum(n for n in topics.values() if number(n) is not None))
    return out


@dataclass
class Row:
    peer: str
    status: str
    meta: dict[str, Any]
    seen_s: float | None  # seconds since the watched node last heard from it
    flagged: int = 0  # its parts that the watched node refused, screened, clipped or disputed
    banned: bool = False


@dataclass
class Sample:
    at: float  # the watcher's monotonic clock when the answer came
    sent: dict[str, int]
    received: dict[str, int]


def parse_status(status: Any) -> tuple[Row, list[Row], Sample]:
    """The rows and byte counters of a `$status` answer; Malformed if it is not one."""
    if not isinstance(status, dict) or not isinstance(status.get("peers"), list):
        raise Malformed("the answer is not a status (no peer list)")
    stats = status.get("stats")
    if not isinstance(stats, dict):
        raise Malformed("the answer has no stats")
    own_meta = status.get("meta") if isinstance(status.get("meta"), dict) else {}
    me = Row(clean(status.get("id", "?")), "self", own_meta, None)
    rows = []
    for p in status["peers"]:
        if not isinstance(p, dict):
            raise Malformed("a peer entry is not a map")
        meta = p.get("meta") if isinstance(p.get("meta"), dict) else {}
        rows.append(Row(str(p.get("id", "?")), str(p.get("status", "?")), meta, number(p.get("last_seen_s"))))
    flagged, banned = held_against(status.get("trust"))
    for row in rows:
        row.flagged, row.banned = flagged.get(row.peer, 0), row.peer in banned
    rows.sort(key=lambda r: (_ORDER.get(r.status, 9), r.peer))
    return me, rows, Sample(0.0, per_peer(stats.get("bytes_sent")), per_peer(stats.get("bytes_received")))


def held_against(trust: Any) -> tuple[dict[str, int], set[str]]:
    """From a status's `trust` (absent from older nodes): each peer's FLAGGED counts summed,
    and the banned peers."""
    if trust is None:
        return {}, set()
    if not isinstance(trust, dict) or not isinstance(trust.get("counts", {}), dict) \
            or not isinstance(trust.get("banned", {}), dict):
        raise Malformed("the trust entry is not a map of counts and bans")
    flagged = {}
    for peer, kinds in trust.get("counts", {}).items():
        if not isinstance(kinds, dict):
            raise Malformed("the trust counts of a peer are not a map")
        flagged[str(peer)] = int(sum(n for kind, n in kinds.items() if kind in FLAGGED and number(n) is not None))
    return flagged, {str(peer) for peer in trust.get("banned", {})}


def rate(now: Sample, before: Sample | None, table: str, peer: str | None) -> float | None:
    """Bytes per second of one peer (None: of all peers) between two answers."""
    if before is None or now.at <= before.at:
        return None
    a, b = getattr(before, table), getattr(now, table)
    then, current = (sum(a.values()), sum(b.values())) if peer is None else (a.get(peer, 0), b.get(peer, 0))
    return max(0, current - then) / (now.at - before.at)


def human_rate(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B/s", "kB/s", "MB/s"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B/s" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB/s"


@dataclass
class WatchView:
    """What `node watch` shows: the last answer, the one before it (for rates), and whether
    the node is answering."""

    address: str
    interval_s: float
    me: Row | None = None
    rows: list[Row] = field(default_factory=list)
    sample: Sample | None = None
    previous: Sample | None = None
    answered_at: float | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    drawn_at: float = -math.inf

    def answered(self, status: Any, now: float) -> None:
        try:
            me, rows, sample = parse_status(status)
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise Malformed(f"malformed status from {self.address}: {exc}") from None
        sample.at = now
        self.me, self.rows, self.previous, self.sample = me, rows, self.sample, sample
        self.answered_at, self.error = now, None

    def failed(self, error: str) -> None:
        self.error = error

    def render(self) -> Table:
        now, wall = time.monotonic(), time.time()
        self.drawn_at = now
        table = Table(title=Text(f"starling node watch {clean(self.address, 120)}"), caption=self._caption(now),
                      caption_justify="left")
        for name, justify in (("peer", "left"), ("status", "left"), ("step", "right"), ("loss", "right"),
                              ("in/s", "right"), ("out/s", "right"), ("last sync", "right"), ("seen", "right"),
                              ("flagged", "right")):
            table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        if self.me is None or self.sample is None:
            return table
        for row in [self.me, *self.rows]:
            peer = None if row is self.me else row.peer
            cells = [clean(row.peer, 20), clean(row.status, 10), _step(row.meta.get("step")),
                     _loss(row.meta.get("loss")), human_rate(rate(self.sample, self.previous, "received", peer)),
                     human_rate(rate(self.sample, self.previous, "sent", peer)), _ago(row.meta.get("synced"), wall),
                     "-" if row.seen_s is None else f"{row.seen_s:.1f} s", _flagged(row)]
            texts = [Text(c) for c in cells]
            if row.banned:
                texts[-1].stylize("bold red")
            table.add_row(*texts, style="dim" if self.error else STATUS_STYLE.get(row.status, ""))
        return table

    def _caption(self, now: float) -> Text:
        if self.error is not None:  # the table below is the last answer's
            since = now - (self.answered_at if self.answered_at is not None else self.started_at)
            return Text(f"no answer for {since:.0f} s: {clean(self.error, 160)}; still asking, Ctrl-C ends",
                        style="red")
        if self.answered_at is None:
            return Text("asking...")
        return Text(f"answered {now - self.answered_at:.1f} s ago, asked every {self.interval_s:g} s; in/s, out/s: "
                    "with this node (its own row: in all); flagged: its parts this node refused, screened, clipped or "
                    "disputed; Ctrl-C ends")


def _flagged(row: Row) -> str:
    if row.banned:
        return "BANNED"
    return str(row.flagged) if row.flagged else "-"


def _step(value: Any) -> str:
    n = number(value)
    return "-" if n is None else f"{n:.0f}"


def _loss(value: Any) -> str:
    n = number(value)
    return "-" if n is None else f"{n:.4g}"


def _ago(unix_s: Any, wall: float) -> str:
    n = number(unix_s)
    return "-" if n is None else f"{max(0.0, wall - n):.1f} s ago"
