"""A streamed corpus (`--data stream:FOLDER`) survives a kill-all restart: two real `node start`
processes train a folder of .jsonl shards, both are SIGKILLed mid-epoch after a checkpoint, and
both restart with `--resume` and their own `--key`. Training continues at the unit position the
checkpoint's ledger saved: the first units trained are those it had next (or in flight), none it
had counted is trained again in that epoch, and the epoch ends with every unit trained once,
apart from what the ledger's rule sends back to the pool (a unit whose work did not count).
Each progress line (`--log-every 1`) names the unit its step trained, as [epoch, index]."""
from __future__ import annotations

import copy
import json
import os
import random
from collections import Counter

import pytest
from cli_zygote import cli_popen
from conftest import load_benchmark, wait_until

from starling.data.assignment import UnitLedger, epoch_order
from starling.node.identity import Identity
from starling.runtime import CheckpointStore
from starling.runtime.data_position import DATA_STATE

WORDS = "the swarm reads its corpus a unit at a time from shard files and trains it once an epoch".split()
SHARDS, SHARD_BYTES, UNIT_BYTES = 4, 12288, 128  # about 390 units: an epoch of about 190 rounds
EVERY = 4  # --checkpoint-every
TINY = ["--seq-len", "16", "--task-opt", "n_layer=1", "--task-opt", "n_embd=16", "--task-opt", "n_head=2",
        "--task-opt", "batch_size=2", "--task-opt", f"unit_bytes={UNIT_BYTES}"]
COMMON = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "6", "--log-every", "1",
          "--checkpoint-every", str(EVERY), "--checkpoint-keep", "50"]


def _corpus(folder: str) -> None:
    """SHARDS .jsonl shards of about SHARD_BYTES each, documents of 5 to 60 words."""
    rng = random.Random(0)
    os.makedirs(folder)
    for shard in range(SHARDS):
        lines, size = [], 0
        while size < SHARD_BYTES:
            line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}) + "\n"
            lines.append(line)
            size += len(line.encode())
        with open(os.path.join(folder, f"part-{shard:03d}.jsonl"), "w") as f:
            f.write("".join(lines))


def _trained(proc, after: int = 0, until: int | None = None) -> list[tuple[int, int, int, bool]]:
    """(step, epoch, unit, counted) of each progress line of `proc` past step `after` (to `until`)
    that trained a unit of the ledger's."""
    return [(r["step"], *r["unit"], r["counted"]) for r in list(proc.records)
            if r.get("unit") and r["step"] > after and (until is None or r["step"] <= until)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # four Python processes that import torch, on a loaded 2-core box
def test_a_killed_swarm_resumes_a_streamed_corpus_at_the_unit_its_checkpoint_saved(tmp_path, monkeypatch):
    procs = load_benchmark("nodeprocs")
    monkeypatch.setattr(procs, "popen", cli_popen)  # each node forked from the test zygote
    work = str(tmp_path)
    data = os.path.join(work, "corpus")
    _corpus(data)
    keys = [os.path.join(work, f"key{n}") for n in range(2)]
    for key in keys:
        Identity.generate().save(key)
    dirs = [os.path.join(work, f"ckpt{n}") for n in range(2)]

    def launch(n: int, extra: list[str], tag: str):
        return procs.NodeProcess([*COMMON, "--key", keys[n], *extra], os.path.join(work, f"{n}-{tag}.log"))

    try:
        # ------------------------------------------------------------ first run, killed mid-epoch
        first = launch(0, ["--protocol", "allreduce", "--lr", "0.003", "--round-timeout-s", "10", "--min-peers", "2",
                           "--data", f"stream:{data}", *TINY, "--checkpoint-dir", dirs[0]], "first")
        address = first.wait_for_address()
        second = launch(1, ["--join", address, "--checkpoint-dir", dirs[1]], "first")
        pair = (first, second)

        def held() -> set[int]:
            return set.intersection(*({c.step for c in CheckpointStore(d).list()} for d in dirs))

        # a checkpoint both hold after two of them, then SIGKILL both at once
        _until(pair, lambda: any(s >= 2 * EVERY for s in held()), timeout_s=300)
        for proc in pair:
            proc.kill()
        for proc in pair:
            assert proc.wait(30) is not None
        common = max(held())
        assert common % EVERY == 0
        before = [_trained(proc) for proc in pair]
        # killed mid-epoch: no step before the kill trained a unit of the next epoch
        assert {epoch for trained in before for _, epoch, _, _ in trained} == {0}, before

        # the checkpoint's ledger (the same at both peers): where the swarm stood in its data
        states = [CheckpointStore(d).load_latest(at_most=common)[1][DATA_STATE] for d in dirs]
        assert states[0] == states[1]
        saved = UnitLedger(states[0]["units"], states[0]["seed"])
        saved.load_state_dict(states[0])
        assert saved.epoch == 0 and 0 < saved.cursor < saved.units and saved.round == common - 1
        order = [int(i) for i in epoch_order(saved.units, saved.seed, 0)]
        in_flight = {u.index for held_ in saved.in_flight.values() for u in held_}
        pool = {u.index for u in saved.pool}
        counted = set(order[:saved.cursor]) - pool - in_flight  # settled before the checkpoint
        assert len(counted) == saved.done
        nxt = copy.deepcopy(saved)  # what it hands out next, both members back
        nxt_units = {u.index for held_ in nxt.advance(common, saved.order).values() for u in held_}
        # the progress lines agree: the units counted by then were trained, those in flight by step `common`
        assert {unit for trained in before for step, _, unit, _ in trained if step <= common} >= counted | in_flight
        assert {i for trained in before for step, _, i, _ in trained if step == common} == in_flight

        # ------------------------------------------------------------ restart: the same keys, --resume
        resume = ["--resume-quorum", "2"]
        first = launch(0, ["--resume", dirs[0], *resume], "back")
        address = first.wait_for_address()
        second = launch(1, ["--join", address, "--resume", dirs[1], *resume], "back")
        pair = (first, second)
        # an event bounds the run: both trained units of the next epoch, so the first is over
        _until(pair, lambda: all(any(e >= 1 for _, e, _, _ in _trained(p)) for p in pair)
               and all(max((r["step"] for r in p.records), default=0) >= _last_of_epoch(pair) + 3 for p in pair),
               timeout_s=420)
        for proc in pair:
            proc.terminate()
        assert [proc.wait(120) for proc in pair] == [0, 0], [p.log_tail() for p in pair]
        assert [p.training["step"] for p in pair] == [common, common]  # both from the checkpoint they both hold

        after = [_trained(proc, after=common) for proc in pair]
        # the first step after the restart trains the units the checkpoint's ledger had next
        # (or, had a member been missed in that round, the ones it had in flight, back from the pool)
        firsts = [trained[0] for trained in after]
        assert all(step == common + 1 and epoch == 0 for step, epoch, _, _ in firsts), firsts
        first_units = {unit for _, _, unit, _ in firsts}
        assert first_units <= nxt_units | in_flight, (firsts, nxt_units, in_flight)
        assert first_units == nxt_units or bool(first_units & in_flight), (firsts, nxt_units)
        epoch0 = [(unit, ok) for trained in after for _, epoch, unit, ok in trained if epoch == 0]
        # none counted before the checkpoint is trained again in the epoch
        assert not counted & {unit for unit, _ in epoch0}, sorted(counted & {unit for unit, _ in epoch0})
        # every unit once: a unit trained twice is one the ledger's rule sent back to the pool
        # (a step whose work did not count, or a unit in flight when the swarm went down)
        twice = {unit: n for unit, n in Counter(unit for unit, ok in epoch0 if ok).items() if n > 1}
        returned = {unit for unit, ok in epoch0 if not ok} | in_flight
        assert set(twice) <= returned, twice
        # and the epoch completes: every unit was trained, before the checkpoint or after it
        assert counted | in_flight | {unit for unit, ok in epoch0 if ok} == set(range(saved.units))
    finally:
        procs.kill_all()


def _until(pair, cond, timeout_s: float) -> None:
    """Wait for `cond`, or for a peer to exit (a failure: its log's tail says why)."""
    wait_until(lambda: cond() or not all(p.alive() for p in pair), timeout_s=timeout_s)
    assert cond(), [p.log_tail(8) for p in pair]


def _last_of_epoch(pair) -> int:
    """The last step at which either peer trained a unit of epoch 0 (0 before any)."""
    return max((step for proc in pair for step, epoch, _, _ in _trained(proc) if epoch == 0), default=0)
