"""`node start --data-scope local`: every member trains its own `--data`, which the swarm's config
never names; members must agree on the task, the sequence length and the tokenizer's content."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from starling.node.client import query

FAST = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "6"]
TINY = ["--seq-len", "16", "--task-opt", "n_layer=1", "--task-opt", "n_embd=16", "--task-opt", "n_head=2",
        "--task-opt", "batch_size=2", "--log-every", "2"]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "tree", "wind"]


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", *args]


def corpus(folder: Path, documents: int, first_word: int, seed: int) -> Path:
    """A folder of text whose words come from one half of WORDS: two members' corpora differ."""
    rng = random.Random(seed)
    folder.mkdir()
    for d in range(documents):
        text = " ".join(WORDS[(first_word + rng.randrange(5)) % len(WORDS)] for _ in range(300))
        (folder / f"doc{d}.txt").write_text(text + "\n")
    return folder


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def bpe(path: Path, text: str) -> None:
    """A trained byte-level BPE tokenizer (another content than the default bytes tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer=trainer)
    tokenizer.save(str(path))


def own_batches(folder: Path, cache: Path) -> int:
    from starling.tasks import get_task

    task = get_task("gpt", data=str(folder), seq_len=16, n_layer=1, n_embd=16, n_head=2, batch_size=2,
                    cache_dir=str(cache))
    return task.shard_batches(0, 1, 0)


@pytest.mark.slow
@pytest.mark.timeout(600)  # three Python processes that import torch, on a loaded 2-core box
def test_members_train_their_own_private_data_and_another_tokenizer_is_refused(tmp_path):
    a, b = corpus(tmp_path / "a", 6, 0, 1), corpus(tmp_path / "b", 11, 5, 2)
    cache = tmp_path / "cache"
    mine = ["--data-scope", "local", "--task-opt", f"cache_dir={cache}", *TINY]
    first = subprocess.Popen(starling("node", "start", *FAST, *mine, "--protocol", "diloco", "--opt", "sync_every=2",
                                      "--data", str(a), "--min-peers", "2",
                                      "--log-every", "0"),  # trains until stopped, printing no progress
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    joiner = None
    try:
        line = first.stdout.readline()
        assert "join with:" in line, line
        address = line.rsplit("join with:", 1)[1].strip()
        status = query(address, timeout_s=10.0)
        config = status["config"]
        # the swarm's config names no member's data, only what must agree
        assert config["data_scope"] == "local" and "data" not in config["task_options"]
        assert str(a) not in json.dumps(config) and len(config["tokenizer"]) == 64

        joiner = subprocess.run(starling("node", "start", *FAST, *mine, "--data", str(b), "--join", address,
                                         "--steps", "6"),
                                capture_output=True, text=True, timeout=300)
        assert joiner.returncode == 0, joiner.stderr[-2000:]
        training, *_, stopped = records(joiner.stdout)
        assert training["event"] == "training" and training["shard"] == "0/1" and stopped["event"] == "stopped"
        # each member's epoch is its own data's: the joiner's status counted its own batches
        theirs = query(address, timeout_s=10.0)["info"]["data"]
        assert theirs["scope"] == "local" and theirs["epoch_batches"] == own_batches(a, cache)
        assert own_batches(a, cache) != own_batches(b, cache)

        # a third member whose tokenizer differs in content is refused at hello, in one line
        other = tmp_path / "tok"
        other.mkdir()
        bpe(other / "tokenizer.json", " ".join(WORDS * 20))
        refused = subprocess.run(starling("node", "start", *FAST, *mine, "--data", str(b), "--tokenizer",
                                          str(other / "tokenizer.json"), "--join", address, "--steps", "2"),
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0
        error = [line for line in refused.stderr.splitlines() if "error" in line]
        assert len(error) == 1 and "tokenizer: swarm has" in error[0], refused.stderr[-2000:]
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_local_data_scope_needs_data_and_a_bad_scope_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from starling.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["node", "start", "--plaintext", "--protocol", "diloco", "--data-scope", "local"])
    assert result.exit_code != 0 and "--data-scope local trains this member's own data: give --data" in result.output
    result = runner.invoke(app, ["node", "start", "--plaintext", "--protocol", "diloco", "--data-scope", "mine"])
    assert result.exit_code != 0 and "--data-scope 'mine': expected one of swarm, local" in result.output
