"""`starling node start --checkpoint-dir ... --resume ...`: a two-process swarm killed with
SIGKILL restarts from its checkpoints, agrees on the step to continue from, and trains on."""
from __future__ import annotations

import signal
import subprocess

import pytest
from cli_zygote import cli_popen
from conftest import wait_until
from test_node_training import FAST, Lines, starling

from starling.node.identity import Identity
from starling.runtime import CheckpointStore


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(600)  # four Python processes that import torch, on a loaded 2-core box
def test_a_killed_swarm_resumes_from_the_step_both_peers_hold(tmp_path):
    keys = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.key"
        Identity.generate().save(path)
        keys.append(path)
    dirs = [tmp_path / "ckpt-a", tmp_path / "ckpt-b"]
    train = ["--protocol", "diloco", "--task", "quadratic", "--lr", "0.05", "--opt", "sync_every=2",
             "--round-timeout-s", "5", "--log-every", "1", "--checkpoint-every", "4"]
    procs: list[subprocess.Popen] = []
    try:
        first = cli_popen(starling("node", "start", *FAST, "--key", str(keys[0]), *train,
                                   "--checkpoint-dir", str(dirs[0])),
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(first)
        out_a = Lines(first)
        address = out_a.address()
        second = cli_popen(starling("node", "start", *FAST, "--key", str(keys[1]), "--join", address,
                                    "--checkpoint-dir", str(dirs[1]), "--checkpoint-every", "4",
                                    "--log-every", "1"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(second)
        out_b = Lines(second)
        out_b.address()
        joined_at = out_b.until(lambda r: r.get("event") == "training")["step"]
        out_b.until(lambda r: r.get("peers") == 2)

        def held() -> list[set[int]]:
            return [{c.step for c in CheckpointStore(d).list()} for d in dirs]

        assert wait_until(lambda: any(s > joined_at for s in set.intersection(*held())), timeout_s=120)
        _kill(procs)
        common = max(set.intersection(*held()))
        assert common > joined_at and common % 4 == 0

        procs.clear()
        # Restart: protocol and task come from the checkpoint; both wait for each other.
        first = cli_popen(starling("node", "start", *FAST, "--key", str(keys[0]), "--resume", str(dirs[0]),
                                   "--resume-quorum", "2", "--log-every", "1", "--steps", str(common + 6),
                                   "--checkpoint-every", "4"),
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(first)
        out_a = Lines(first)
        address = out_a.address()
        second = cli_popen(starling("node", "start", *FAST, "--key", str(keys[1]), "--join", address,
                                    "--resume", str(dirs[1]), "--resume-quorum", "2", "--log-every", "1",
                                    "--steps", str(common + 6), "--checkpoint-every", "4"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(second)
        out_b = Lines(second)
        out_b.address()
        started = [out.until(lambda r: r.get("event") == "training") for out in (out_a, out_b)]
        assert [s["protocol"] for s in started] == ["diloco", "diloco"]
        assert [s["step"] for s in started] == [common, common]  # both from the step both hold
        stopped = [out.until(lambda r: r.get("event") == "stopped") for out in (out_a, out_b)]
        assert [s["step"] for s in stopped] == [common + 6] * 2
        assert all(s["eval_loss"] == s["eval_loss"] for s in stopped)  # numbers, not NaN
        assert all(proc.wait(60) == 0 for proc in procs)
        assert max(c.step for c in CheckpointStore(dirs[0]).list()) == common + 4
    finally:
        _kill(procs)
