"""`starling --version`: the package version, the wire versions this build speaks, its capabilities."""
from __future__ import annotations

from typer.testing import CliRunner

from starling.cli.main import app
from starling.node.version import CAPABILITIES, PACKAGE_VERSION, WIRE_RANGE, wire_text


def test_version_prints_the_package_version_and_the_wire_range_in_one_line():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"starling {PACKAGE_VERSION} ({wire_text(WIRE_RANGE)};")
    assert all(name in lines[0] for name in CAPABILITIES)


def test_the_package_version_is_semantic():
    import re

    assert re.fullmatch(r"\d+\.\d+\.\d+", PACKAGE_VERSION)
