"""examples/hf_causal_lm.py as CI runs it: a transformers GPT-2 with tied embeddings, trained by
three `starling node start` processes with Streaming DiLoCo, ends with the same outer parameters
on every peer and the embedding still tied; and the example's checks fail when either is not so."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_zygote import cli_run

from starling.runtime import CheckpointStore

# The `hf` extra (also in `test`, so CI has it): skip only where someone installed neither.
pytest.importorskip("transformers")
# One run of the example (three node processes) serves every test here: on one xdist worker
pytestmark = pytest.mark.xdist_group("hf_example")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"
_spec = importlib.util.spec_from_file_location("hf_causal_lm", EXAMPLE)
hf_causal_lm = sys.modules["hf_causal_lm"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_causal_lm)  # its checks, called on tampered checkpoints below

STEPS = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run of the example as a script, shared by the tests below."""
    workdir = tmp_path_factory.mktemp("hf") / "run"
    # Three processes that import torch and transformers on a loaded 2-core box: the example's own
    # timeout fails the run cleanly (it kills its nodes); this one is the hang detector.
    proc = cli_run([sys.executable, str(EXAMPLE), "--steps", str(STEPS),
                           "--workdir", str(workdir), "--timeout-s", "400"],
                          capture_output=True, text=True, timeout=500)
    return proc, workdir


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_node_processes_train_a_tied_gpt2_to_the_same_outer_parameters(run):
    proc, _ = run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and "failures" not in summary
    assert summary["peers"] == 3 and summary["steps"] == STEPS
    assert len(set(summary["eval_loss"])) == 1
    assert summary["eval_loss"][0] < 3.5  # it learned: the untrained model's is 4.44, 40 steps bring it to about 2.8


def _copy_with(workdir: Path, dst: Path, peer: int, edit) -> list[Path]:
    """The run's last checkpoints copied to `dst`, with `edit(state)` applied to `peer`'s; the
    copies' dirs. (A copy: each test tampers with its own.)"""
    dirs = []
    for i in range(3):
        checkpoint, state = CheckpointStore(workdir / f"ckpt-{i}").load_latest()
        if i == peer:
            edit(state["protocol"])
        dirs.append(dst / f"ckpt-{i}")
        CheckpointStore(dirs[-1]).write(checkpoint.step, state, checkpoint.meta)
    return dirs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_sees_outer_parameters_that_differ(tmp_path, run):
    proc, workdir = run
    assert proc.returncode == 0
    assert hf_causal_lm.check_checkpoints([workdir / f"ckpt-{i}" for i in range(3)], STEPS) == []

    def nudge_one_value(state):
        state["outer"][1][7] = torch.nextafter(state["outer"][1][7], torch.tensor(1e9))  # one ulp

    dirs = _copy_with(workdir, tmp_path, 2, nudge_one_value)
    assert hf_causal_lm.check_checkpoints(dirs, STEPS) == ["node-2's outer parameters differ from node-0's"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_sees_an_untied_embedding(tmp_path, run):
    proc, workdir = run
    assert proc.returncode == 0
    name = hf_causal_lm.OUTPUT_EMBEDDING

    def untie(state):
        state["model"][name] = state["model"][name] + 1e-3

    failures = hf_causal_lm.check_checkpoints(_copy_with(workdir, tmp_path, 0, untie), STEPS)
    assert len(failures) == 1 and f"node-0's local {name} differs" in failures[0], failures


def test_the_example_sees_peers_that_evaluate_different_models():
    def peer(eval_loss: float, tied: float = 1.0, peers: int = 3) -> list[dict]:
        return [{"step": 4, "loss": 4.0, "peers": peers},
                {"event": "stopped", "step": STEPS, "eval_loss": eval_loss, "embeddings_tied": tied}]

    assert hf_causal_lm.check_printed([peer(2.5)] * 3, STEPS) == []
    assert "different models" in hf_causal_lm.check_printed([peer(2.5), peer(2.5), peer(2.6)], STEPS)[0]
    assert "untied" in hf_causal_lm.check_printed([peer(2.5), peer(2.5, tied=0.0), peer(2.5)], STEPS)[0]
    assert "synced with all 3" in hf_causal_lm.check_printed([peer(2.5), peer(2.5, peers=2), peer(2.5)], STEPS)[0]
