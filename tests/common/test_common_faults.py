"""Fault points: what STARLING_FAULT names is parsed strictly, and a point fires once, in its
round, as a real signal to the process (checked in a child process)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from starling.common.faults import ENV, Fault, fault_point, parse_faults


def test_a_fault_names_its_point_round_and_action():
    assert parse_faults("reduce.owner.closing@4:stop, train.step") == (
        Fault("reduce.owner.closing", 4, "stop"), Fault("train.step", None, "kill"))
    assert str(Fault("train.step", 3, "kill")) == "train.step@3:kill"


@pytest.mark.parametrize("text, needle", [
    ("reduce.owner.closng@4", "unknown fault point"),
    ("train.step@x", "must be an integer"),
    ("train.step@2:explode", "unknown action"),
])
def test_a_bad_fault_is_one_clear_error(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_faults(text)


def test_a_point_the_code_names_wrong_is_a_bug():
    with pytest.raises(ValueError, match="unknown fault point"):
        fault_point("no.such.point", 1)


def test_a_point_fires_once_in_its_round_as_a_real_sigkill():
    script = ("from starling.common.faults import fault_point\n"
              "for r in range(5):\n"
              "    fault_point('train.step', r)\n"
              "    print(r, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, ENV: "train.step@3:kill"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1", "2"]
    unarmed = subprocess.run([sys.executable, "-c", script], env={k: v for k, v in os.environ.items() if k != ENV},
                             capture_output=True, text=True, timeout=60)
    assert unarmed.returncode == 0 and unarmed.stdout.split() == ["0", "1", "2", "3", "4"]
