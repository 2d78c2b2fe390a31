"""The most senior member of a swarm training on units of data, SIGKILLed and restarted as the
docs say (the same `--key`, `--resume` its checkpoint folder, `--join` a live peer): its data
ledger is the swarm's again by its next round, not its own stale one for the rest of the epoch.
Three real `node start` processes; each progress line carries the ledger's digest
(`--log-digest`)."""
from __future__ import annotations

import os
import random
import sys

import pytest
from cli_zygote import cli_popen, cli_run
from conftest import load_benchmark, wait_until

WORDS = "one model trained by three peers over slow links while the senior one restarts".split()
COMMON = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "3", "--log-every", "1", "--log-digest",
          "--log-level", "info", "--checkpoint-every", "1"]


def _corpus(folder: str) -> None:
    rng = random.Random(0)
    os.makedirs(folder)
    for d in range(8):
        with open(os.path.join(folder, f"doc{d}.txt"), "w") as f:
            f.write(" ".join(rng.choice(WORDS) for _ in range(400)) + "\n")


def _by_step(proc, since: int = 0) -> dict[int, str]:
    return {r["step"]: r["ledger"] for r in proc.records[since:] if r.get("ledger")}


@pytest.mark.slow
@pytest.mark.timeout(420)  # four Python processes that import torch, on a loaded 2-core box
def test_a_restarted_senior_peer_holds_the_swarms_ledger_by_its_next_round(tmp_path, monkeypatch):
    procs = load_benchmark("nodeprocs")
    monkeypatch.setattr(procs, "popen", cli_popen)  # each node forked from the test zygote
    work = str(tmp_path)
    data = os.path.join(work, "corpus")
    _corpus(data)
    keys = [os.path.join(work, f"key{n}") for n in range(3)]
    for key in keys:
        cli_run([sys.executable, "-m", "starling.cli.main", "keygen", "--out", key], check=True,
                capture_output=True)

    def launch(n: int, extra: list[str], tag: str = ""):
        return procs.NodeProcess([*COMMON, "--key", keys[n], "--checkpoint-dir", os.path.join(work, f"ckpt{n}"),
                                  *extra], os.path.join(work, f"{n}{tag}.log"))

    try:
        senior = launch(0, ["--protocol", "allreduce", "--data", data, "--seq-len", "32", "--min-peers", "3",
                            "--round-timeout-s", "5", "--lr", "0.001"])
        address = senior.wait_for_address()
        others = [launch(n, ["--join", address, "--min-peers", "3"]) for n in (1, 2)]
        assert wait_until(lambda: all(len(_by_step(p)) >= 4 for p in (senior, *others)), timeout_s=240), \
            [p.log_tail() for p in (senior, *others)]
        senior.kill()
        before = max(_by_step(others[0]))
        assert wait_until(lambda: max(_by_step(others[0])) >= before + 2, timeout_s=60), others[0].log_tail()
        back = launch(0, ["--resume", os.path.join(work, "ckpt0"), "--join", others[0].wait_for_address()], "-back")
        assert wait_until(lambda: len(_by_step(back)) >= 4, timeout_s=180), back.log_tail(20)
        mine = _by_step(back)
        first = min(mine)
        theirs = _by_step(others[0])
        compared = [s for s in sorted(mine) if s > first and s in theirs]  # from its next round on
        assert len(compared) >= 2, (mine, theirs)
        assert all(mine[s] == theirs[s] for s in compared), {s: (mine[s], theirs[s]) for s in compared}
    finally:
        procs.kill_all()
