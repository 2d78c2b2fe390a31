"""A node that may train pays torch's one-time lazy imports before its hello: from then on the
others count it in their rounds and wait for its parts. The first optimizer a process builds
imports torch._dynamo, which held every round of the chaos soak (benchmarks/chaos.py) for
1.8 to 3.5 s at each join."""
from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

import starling.runtime
from starling.cli.main import app
from starling.node.node import JoinError, Node


@pytest.mark.slow
def test_prepare_to_train_imports_what_the_first_optimizer_would():
    code = ("import sys, torch, starling.runtime, starling.cli.node\n"
            "assert 'torch._dynamo' not in sys.modules  # else this test proves nothing\n"
            "starling.runtime.prepare_to_train()\n"
            "assert 'torch._dynamo' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)


@pytest.mark.parametrize("args", [["--join", "tcp://127.0.0.1:9"], ["--protocol", "allreduce", "--task", "quadratic"]])
def test_node_start_prepares_to_train_before_it_says_hello(monkeypatch, args):
    calls = []
    monkeypatch.setattr(starling.runtime, "prepare_to_train", lambda: calls.append("prepare"))

    def start(self, *a, **k):
        calls.append("hello")
        raise JoinError("stop here")

    monkeypatch.setattr(Node, "start", start)
    result = CliRunner().invoke(app, ["node", "start", "--plaintext", *args])
    assert result.exit_code == 2 and "stop here" in result.output
    assert calls == ["prepare", "hello"]


def test_a_node_that_cannot_train_does_not_prepare(monkeypatch):
    calls = []
    monkeypatch.setattr(starling.runtime, "prepare_to_train", lambda: calls.append("prepare"))
    monkeypatch.setattr(Node, "start", lambda self, *a, **k: (_ for _ in ()).throw(JoinError("stop here")))
    assert CliRunner().invoke(app, ["node", "start", "--plaintext"]).exit_code == 2
    assert calls == []
