"""The previous release against this one, each a real `node start`: an old seed with a new
joiner, and a new seed with an old joiner.

The previous release is built from this repository (its tag, or the commit `.ci/previous-release`
names where a clone has no tags) into a virtual environment of its own that reuses the
dependencies the tests run with (no download, no second torch) and cannot see this checkout's
starling. Where the two speak a wire version in common they must join and train a few steps
together; where they do not, the joiner must exit non-zero with one line naming both sides'
versions and which to upgrade, and the seed must keep running without it in its table.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from starling.node.client import query
from starling.node.version import PACKAGE_VERSION, WIRE_RANGE, wire_text

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = ROOT / ".ci" / "previous-release"
TRAIN = ["--protocol", "allreduce", "--task", "quadratic", "--lr", "0.05", "--round-timeout-s", "5", "--log-every", "1",
         "--steps", "3", "--min-peers", "2"]


@dataclass(frozen=True)
class Build:
    """A starling install: the interpreter that runs it, and what it says of itself."""

    python: str
    package: str
    wire: tuple[int, int]
    env: dict[str, str]

    def starling(self, *args: str) -> list[str]:
        return [self.python, "-m", "starling.cli.main", *args]

    def meets(self, other: Build) -> bool:
        return max(self.wire[0], other.wire[0]) <= min(self.wire[1], other.wire[1])


def _run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _previous_release() -> str:
    """The git ref of the previous release: its tag where this clone has it, else its commit."""
    tag, commit = next(line.split() for line in PREVIOUS.read_text().splitlines()
                       if line.strip() and not line.startswith("#"))
    for ref in (tag, commit):
        if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                          capture_output=True).returncode == 0:
            return ref
    pytest.fail(f"this clone has neither tag {tag} nor commit {commit} of the previous release "
                "(.ci/previous-release): fetch them (git fetch --tags, or a deeper clone)")


def _env_without_this_checkout() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> Build:
    """The previous release in a venv of its own. Its site-packages comes first; after it, the
    test interpreter's site directories as plain paths (a .pth line), so their own .pth files
    (this checkout's editable install among them) are never run."""
    work = tmp_path_factory.mktemp("previous-release")
    src, venv = work / "src", work / "venv"
    src.mkdir()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", "--format=tar", _previous_release()],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, check=True, timeout=120)
    assert archive.wait(60) == 0
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = str(venv / "bin" / "python")
    env = _env_without_this_checkout()
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=env).strip())
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (purelib / "_test_interpreter_site.pth").write_text("".join(f"{p}\n" for p in ours))
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--no-compile",
         "--disable-pip-version-check", str(src), cwd=work, env=env)
    where = _run(python, "-c", "import starling.node, starling.cli.main; print(starling.node.__file__); "
                 "print(starling.cli.main.__file__)", cwd=work, env=env).split()
    assert all(Path(w).is_relative_to(venv) for w in where), f"the old venv imports another starling: {where}"
    said = _run(python, "-c", "import importlib.metadata as m\ntry:\n from starling.node.version import WIRE_RANGE\n"
                "except ImportError:\n WIRE_RANGE = (1, 1)  # release 0.1.x named no versions\n"
                "print(m.version('starling'), *WIRE_RANGE)", cwd=work, env=env).split()
    return Build(python, said[0], (int(said[1]), int(said[2])), env)


@pytest.fixture(scope="module")
def new() -> Build:
    return Build(sys.executable, PACKAGE_VERSION, WIRE_RANGE, dict(os.environ))


class Peer:
    """One `node start` process of a build; every line it prints is kept, in order."""

    def __init__(self, build: Build, cwd: Path, *args: str) -> None:
        # No liveness flags: their names changed between the releases; the defaults serve both.
        self.proc = subprocess.Popen(build.starling("node", "start", "--plaintext", *args), cwd=cwd, env=build.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # the end of its output
            self.changed.notify_all()

    def line(self, pred, timeout_s: float = 300) -> str:
        """The first line it printed that satisfies `pred`, once it has printed it."""
        with self.changed:
            found = self.changed.wait_for(lambda: any(pred(x) for x in self.lines) or self.lines[-1:] == [""],
                                          timeout_s)
            match = next((x for x in self.lines if pred(x)), None)
        assert found and match is not None, f"no such line from {self.proc.args}:\n" + "\n".join(self.lines)
        return match

    def address(self) -> str:
        return self.line(lambda x: "join with:" in x).rsplit("join with:", 1)[1].strip()

    def record(self, pred) -> dict:
        return json.loads(self.line(lambda x: x.startswith("{") and pred(json.loads(x))))

    def finish(self, timeout_s: float = 300) -> tuple[int, list[str]]:
        """Its exit status and every line it printed."""
        code = self.proc.wait(timeout_s)
        self.reader.join(30)
        return code, self.lines[:-1]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(600)  # four Python processes that import torch, and a pip install, on a loaded 2-core box
def test_the_previous_release_and_this_one_join_and_train_or_refuse_each_other_in_one_line(old, new, tmp_path):
    pairs = [(old, new), (new, old)]  # (seed, joiner)
    compatible = old.meets(new)
    seeds = [Peer(seed, tmp_path, *(TRAIN if compatible else [])) for seed, _ in pairs]
    joiners: list[Peer] = []
    try:
        addresses = [s.address() for s in seeds]
        joiners = [Peer(joiner, tmp_path, "--join", address, "--log-every", "1", *(["--steps", "3"] if compatible else []))
                   for (_, joiner), address in zip(pairs, addresses)]
        for (seed_build, joiner_build), seed, joiner, address in zip(pairs, seeds, joiners, addresses):
            who = f"{joiner_build.package} joining {seed_build.package}"
            if compatible:
                record = joiner.record(lambda r: r.get("peers") == 2)
                assert record["step"] >= 1, who
                assert joiner.finish(300)[0] == 0 and seed.finish(300)[0] == 0, who
                continue
            code, lines = joiner.finish()
            errors = [line for line in lines if line.startswith("starling: error:")]
            assert code != 0 and len(errors) == 1, (who, lines)
            line = errors[0]
            older = "seed" if seed_build is old else "joiner"
            assert f"starling {new.package} ({wire_text(new.wire)})" in line, (who, line)
            assert f"starling {'.'.join(old.package.split('.')[:2])}." in line and wire_text(old.wire) in line, line
            assert line.endswith(f"upgrade the {older}"), line
            assert seed.proc.poll() is None, f"{who}: the seed stopped"
            status = query(address, timeout_s=30)
            assert status["peers"] == [], (who, json.dumps(status["peers"]))
            assert sum(status["stats"]["rejected"].values()) >= 1, who  # refused and counted
    finally:
        for peer in joiners + seeds:
            peer.stop()
