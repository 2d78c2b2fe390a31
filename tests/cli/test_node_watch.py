"""`starling node watch ADDR`: a live table of a running node, drawn in a pseudo-terminal
(python's `pty`, so CI needs nothing extra); it shows the peers' heartbeat meta, keeps asking
a node that stopped answering, and ends on SIGINT with exit status 0 and no traceback."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import signal
import struct
import sys
import termios
import threading
import time

import pytest
from cli_zygote import cli_popen
from conftest import TEST_LIVENESS, hold_against, wait_until
from rich.console import Console
from typer.testing import CliRunner

from starling.cli.main import app
from starling.cli.watch import Malformed, WatchView, clean
from starling.node.node import Node, NodeConfig


class Terminal:
    """A process on a pseudo-terminal of 160x40, its output read on a thread."""

    def __init__(self, args: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
        env.pop("NO_COLOR", None)
        self.proc = cli_popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.master, self.chunks, self.lock = master, [], threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the other side closed
                return
            if not data:
                return
            with self.lock:
                self.chunks.append(data)

    @property
    def text(self) -> str:
        with self.lock:
            return b"".join(self.chunks).decode("utf-8", "replace")

    def shows(self, *needles: str, timeout_s: float = 120) -> bool:
        """Whether the screen's output came to hold all of `needles` within `timeout_s`."""
        def holds() -> bool:
            text = self.text  # decoded once per look: the screen's output grows by a redraw per interval
            return all(n in text for n in needles)
        return wait_until(holds, timeout_s=timeout_s, interval_s=0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.reader.join(10)
        os.close(self.master)


def _node(join: list[str] | None = None) -> Node:
    return Node(config=NodeConfig(liveness=TEST_LIVENESS)).start("tcp://127.0.0.1:0", join or [])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_watch_draws_the_peers_in_a_terminal_keeps_asking_a_silent_node_and_ends_on_sigint():
    watched = _node()
    peer = _node([watched.address])
    watched.set_meta(step=41, loss=0.125, synced=time.time())
    peer.set_meta(step=40, loss=0.5, synced=time.time())  # reaches the watched node in a heartbeat
    term = Terminal([sys.executable, "-m", "starling.cli.main", "node", "watch", watched.address,
                     "--interval-s", "0.2", "--timeout-s", "1"])
    try:
        assert term.shows(watched.peer_id, "self", "41", "0.125", peer.peer_id, "alive", "40", "0.5", "s ago",
                          "in/s", "out/s", "flagged"), term.text
        assert term.shows(" B/s"), term.text  # heartbeats between them, over two answers: a rate
        watched.close()
        assert term.shows("no answer for", "still asking"), term.text
        assert term.proc.poll() is None  # still running, still asking
        term.proc.send_signal(signal.SIGINT)
        assert term.proc.wait(60) == 0, term.text
        assert "Traceback" not in term.text
    finally:
        term.close()
        peer.close()
        watched.close()


runner = CliRunner()


@pytest.mark.parametrize("args, needle", [
    (["node", "watch", "not-an-address"], "address"),
    (["node", "watch", "tcp://127.0.0.1:7000", "--interval-s", "0"], "--interval-s"),
])
def test_bad_arguments_are_one_error_line(args, needle):
    result = runner.invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("starling: error:"), result.output
    assert needle in lines[0]


def _draw(view: WatchView) -> str:
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(view.render())
    return out.getvalue()


def test_an_answer_is_untrusted_text_never_terminal_control():
    evil = "\x1b]0;\x07\x1b[2J[b]x"  # a title, a bell, clear the screen, and rich markup
    view = WatchView("tcp://127.0.0.1:1", 1.0)
    status = {"id": evil, "peers": [{"id": evil, "status": evil, "meta": {"step": evil, "loss": float("nan")},
                                     "last_seen_s": "soon"}],
              "stats": {"bytes_sent": {evil: {"t": 10}}, "bytes_received": {}}, "meta": {"step": 3}}
    view.answered(status, 1.0)
    view.answered(status, 2.0)
    drawn = _draw(view)
    assert "\x1b" not in drawn and "\x07" not in drawn
    assert "?]0;??[2J[b]x" in drawn  # shown as text, not read as markup
    assert clean("a" * 100, 10) == "a" * 9 + "…"


def test_a_peer_row_shows_what_the_node_holds_against_it_and_a_ban(make_node):
    watched = make_node("tcp")
    banned, accused = make_node("tcp", join=[watched.address]), make_node("tcp", join=[watched.address])
    assert wait_until(lambda: {banned.peer_id, accused.peer_id} <= set(watched.live_peers()))
    hold_against(watched, banned.identity, accused.identity)
    watched.run(_note(watched, accused.peer_id, {"screened": 1, "clipped": 4, "disputed": 1, "not_finite": 9}))
    view = WatchView("tcp://127.0.0.1:1", 1.0)
    view.answered(watched.status(), 1.0)
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in _draw(view).splitlines()
            if line.count("│") > 2}
    # refused 2, screened 1, clipped 4, disputed 1; not_finite and accused.late_part are not in the sum
    assert rows == {watched.peer_id: "-", banned.peer_id: "BANNED", accused.peer_id: "8"}


async def _note(node, peer: str, kinds: dict[str, int]) -> None:
    for kind, n in kinds.items():
        node.trust.note(peer, kind, n)


@pytest.mark.parametrize("status", [None, [], {"peers": "x"}, {"peers": [], "stats": {"bytes_sent": []}},
                                    {"peers": [1], "stats": {"bytes_sent": {}, "bytes_received": {}}},
                                    {"peers": [], "stats": {"bytes_sent": {}, "bytes_received": {}}, "trust": []},
                                    {"peers": [], "stats": {"bytes_sent": {}, "bytes_received": {}},
                                     "trust": {"counts": {"p": 3}}}])
def test_a_malformed_answer_is_named_and_the_last_good_one_stays(status):
    view = WatchView("tcp://127.0.0.1:1", 1.0)
    view.answered({"id": "me", "peers": [], "stats": {"bytes_sent": {}, "bytes_received": {}}}, 1.0)
    with pytest.raises(Malformed):
        view.answered(status, 2.0)
    assert view.me is not None and view.me.peer == "me"
