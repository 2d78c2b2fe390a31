"""The `starling` command in-process (typer's runner): keygen and clear one-line errors."""
from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

from starling.cli.main import app
from starling.node.identity import Identity

runner = CliRunner()


def test_keygen_writes_a_private_key_and_prints_the_peer_id(tmp_path):
    out = tmp_path / "id.key"
    result = runner.invoke(app, ["keygen", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert result.output.strip() == Identity.load(out).peer_id


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "id.key"
    runner.invoke(app, ["keygen", "--out", str(out)])
    first = Identity.load(out).peer_id
    result = runner.invoke(app, ["keygen", "--out", str(out)])
    assert result.exit_code != 0 and "--force" in result.output
    assert Identity.load(out).peer_id == first
    assert runner.invoke(app, ["keygen", "--out", str(out), "--force"]).exit_code == 0
    assert Identity.load(out).peer_id != first


@pytest.mark.parametrize("args, needle", [
    (["node", "start", "--join", "bogus"], "scheme"),
    (["node", "start", "--listen", "tcp://127.0.0.1:99999"], "port"),
    (["node", "start", "--listen", "tcp://0.0.0.0:0", "--plaintext"], "non-loopback"),
    (["node", "start", "--key", "/nonexistent/key"], "/nonexistent/key"),
    (["node", "status", "tcp://127.0.0.1:1", "--timeout-s", "0.3"], "no answer"),
    (["node", "status", "udp://x:1"], "scheme"),
    (["node", "status", "tcp://127.0.0.1:1", "--timeout-s", "nan"], "--timeout-s must be a positive, finite"),
    (["node", "status", "tcp://127.0.0.1:1", "--timeout-s", "-1"], "--timeout-s must be a positive, finite"),
    (["node", "start", "--resume-timeout-s", "inf"], "--resume-timeout-s must be"),
    (["node", "start", "--state-fetch-timeout-s", "0"], "--state-fetch-timeout-s must be"),
    (["node", "start", "--join", "tcp://0.0.0.0:5"], "every interface"),
    (["node", "start", "--probe-interval-s", "abc"], "Invalid value for '--probe-interval-s'"),
    (["node", "start", "--probe-interval-s", "0"], "probe_interval_s must be a positive number"),
    (["node", "start", "--lr", "abc"], "Invalid value for '--lr'"),
    (["simulate", "--steps", "many"], "Invalid value for '--steps'"),
    (["no-such-command"], "No such command"),
])
def test_errors_are_one_clear_line_and_nonzero(args, needle):
    """Usage errors too (bad values, unknown commands): one line, not a usage box."""
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:") and needle in lines[0], result.output


def test_world_readable_key_is_refused(tmp_path):
    out = tmp_path / "id.key"
    runner.invoke(app, ["keygen", "--out", str(out)])
    os.chmod(out, 0o644)
    result = runner.invoke(app, ["node", "start", "--key", str(out)])
    assert result.exit_code != 0 and "starling: error:" in result.output


def test_a_binary_allowlist_is_one_clear_line_naming_the_file(tmp_path):
    keys = tmp_path / "keys.bin"
    keys.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    result = runner.invoke(app, ["node", "start", "--authorized-keys", str(keys)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and str(keys) in lines[0] and "is not text" in lines[0], result.output


@pytest.mark.parametrize("command", [[], ["keygen"], ["node"], ["node", "start"], ["node", "status"], ["simulate"],
                                     ["protocols"], ["plot"]])
def test_help_is_in_the_usual_click_form_with_an_example(command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "<int>" not in result.output and "<str>" not in result.output
    if command and command != ["node"]:
        assert "Example: starling" in result.output
    if command == ["simulate"]:
        assert "INTEGER" in result.output and "FLOAT" in result.output and "TEXT" in result.output
