"""benchmarks/diloco_levers.py: the socket-free DiLoCo model runs, and reduces to plain training."""
from __future__ import annotations

import math

import pytest
from conftest import load_benchmark


def load_script():
    return load_benchmark("diloco_levers")


@pytest.mark.parametrize("fragments", [1, 2])
def test_one_peer_with_a_unit_outer_step_is_plain_training(fragments):
    """Outer lr 1, no momentum, alpha 0: each outer step lands on the lone replica's own
    parameters, so the replica trains exactly as one data-parallel peer does. The outer
    copy matches too when the run ends on a sync of every fragment (F = 1 here; with F = 2
    fragment 0 last synced 2 steps before the end)."""
    row = load_script().main(["--steps", "12", "--peers", "1", "--sync-every", "4", "--fragments", str(fragments),
                              "--outer-lr", "1", "--outer-momentum", "0", "--alpha", "0", "--batch-size", "2"])
    assert row["diloco_eval_loss_local"] == pytest.approx(row["dp_eval_loss"], abs=1e-4)
    if fragments == 1:
        assert row["diloco_eval_loss"] == pytest.approx(row["dp_eval_loss"], abs=1e-4)
    else:
        assert row["diloco_eval_loss"] != pytest.approx(row["dp_eval_loss"], abs=1e-4)


def test_shuffled_shards_momentum_and_a_narrower_model_give_a_finite_row():
    script = load_script()
    row = script.main(["--steps", "8", "--peers", "2", "--sync-every", "4", "--fragments", "2",
                       "--shards", "shuffled", "--batch-size", "2", "--only", "diloco", "--n-embd", "32"])
    assert math.isfinite(row["diloco_eval_loss"]) and "dp_eval_loss" not in row and "loss_gap" not in row
    assert row["shards"] == "shuffled" and row["seconds"] >= 0
    default = sum(p.numel() for p in script.CharLMTask().make_model().parameters())
    assert row["n_embd"] == 32 and 0 < row["parameters"] < default / 2


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--fragments", "8", "--sync-every", "4"],
                                  ["--alpha", "1.5"], ["--only", "gossip"], ["--shards", "iid"],
                                  ["--n-embd", "0"], ["--n-embd", "30"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        load_script().parse_args(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
