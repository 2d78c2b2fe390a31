"""A Hugging Face causal LM trained by three `starling node start` processes with Streaming DiLoCo.

The model is a `transformers` GPT-2 built from a tiny config (2 layers, 64 wide, input and
output embeddings tied), nothing downloaded: its vocabulary and text are the built-in `charlm`
task's (printable ASCII, the Python standard library's own source).

A model that `transformers` loads from a folder or a hub name needs no module of your own: the
built-in task `--task hf:NAME` trains it on `--data` (see the command line guide). This file
shows how to write your own task around a Hugging Face model, for what the built-in one does not
do: here, the `charlm` task's characters and held-out windows, and a check that the tied
embedding stays tied. It is two things:

- a task module: `task()` returns a `starling.tasks.Task`, so any swarm can train the model
  with `--task hf_causal_lm:task` once this folder is on the Python path (every peer imports
  it: the joiners learn the task's name from the swarm and build the model themselves);

      PYTHONPATH=examples starling node start --protocol streaming-diloco --task hf_causal_lm:task

- a script that runs such a swarm on loopback, waits for it to finish, and checks it:

      pip install -e ".[hf]"            # transformers
      python examples/hf_causal_lm.py   # prints one JSON summary; exit status 1 if a check failed

The script starts the first node with the protocol and the task, and two more that join it.
Each is given `--min-peers 3`: no peer trains alone while the others are still importing
torch, and the joiners start from the first node's state. All three stop at `--steps`, after
a sync (no round in flight), and write a checkpoint there. The script then checks what the CLI lets
it see: the same eval loss on every peer, bit-identical outer parameters in the three final
checkpoints, and the tied embedding still tied (in the model each peer evaluates, in its local
model, and counted once in the vector the swarm averages).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from starling.common.devices import to_model_device
from starling.tasks import CharLMConfig, CharLMTask, Task, config_from_options, evaluating, make_generator
from starling.tasks.charlm import VOCAB_SIZE

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (B, T) and next-character targets (B, T)
INPUT_EMBEDDING, OUTPUT_EMBEDDING = "transformer.wte.weight", "lm_head.weight"  # GPT-2's names for the tied pair


# ---------------------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class HFCausalLMConfig:
    seed: int = 0  # initial weights
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    seq_len: int = 32  # training window, also the model's n_positions
    batch_size: int = 8
    corpus_chars: int = 200_000
    eval_batches: int = 4


class HFCausalLMTask(Task):
    """GPT-2 from `transformers` on the `charlm` task's characters; data and held-out windows
    are charlm's, so the two tasks' losses compare."""

    name = "hf-gpt2-charlm"
    config_class = HFCausalLMConfig

    def __init__(self, config: HFCausalLMConfig | None = None) -> None:
        self.config = config or HFCausalLMConfig()
        c = self.config
        self.text = CharLMTask(CharLMConfig(seed=c.seed, corpus_chars=c.corpus_chars, seq_len=c.seq_len,
                                            batch_size=c.batch_size, eval_batches=c.eval_batches))

    def make_model(self) -> nn.Module:
        # Imported here, not at the top: a node imports this module before it prints its join
        # address, and transformers takes seconds to import.
        from transformers import GPT2Config, GPT2LMHeadModel

        c = self.config
        config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=c.seq_len, n_embd=c.n_embd, n_layer=c.n_layer,
                            n_head=c.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=True, use_cache=False, bos_token_id=None, eos_token_id=None)
        model = GPT2LMHeadModel(config)
        reset_parameters(model, c.n_layer, make_generator("hf-gpt2-charlm.model", c.seed))
        return model

    def batches(self, rank: int, world: int, seed: int) -> Iterator[Batch]:
        return self.text.batches(rank, world, seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        inputs, targets = self.text.eval_set()
        with evaluating(model):
            losses = [self.loss(model, to_model_device((x, y), model)).item() for x, y in zip(inputs, targets)]
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight  # type: ignore[operator]
        return {"eval_loss": sum(losses) / len(losses), "embeddings_tied": float(tied)}


def reset_parameters(model: nn.Module, n_layer: int, generator: torch.Generator) -> None:
    """GPT-2's initialisation, drawn from `generator` only: transformers draws from torch's global
    RNG, and every peer must build the same weights (the simulator builds many in one process)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter is named once
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std, generator=generator)


def task(**options: Any) -> HFCausalLMTask:
    """The factory `--task hf_causal_lm:task` names; `--task-opt NAME=VALUE` are its options."""
    return HFCausalLMTask(config_from_options(HFCausalLMConfig, options))


# ---------------------------------------------------------------------------------------- the swarm

HERE = Path(__file__).resolve().parent
PEERS = 3
LIVENESS = ["--probe-interval-s", "0.2", "--suspicion-s", "15"]


class NodeProcess:
    """One `starling node start` process; a thread reads its stdout (a full pipe would stall it)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-m", "starling.cli.main", "node", "start", *args],
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        self.address: queue.Queue[str] = queue.Queue()
        self.records: list[dict[str, Any]] = []  # the JSON lines it printed
        self.training_at: float | None = None  # when it printed that it starts training
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "join with:" in line:
                self.address.put(line.rsplit("join with:", 1)[1].strip())
            elif line.startswith("{"):
                self.records.append(json.loads(line))
                if self.records[-1].get("event") == "training":
                    self.training_at = time.monotonic()
        self.address.put("")  # the process is gone: nobody waits for an address that will not come

    def join_address(self, timeout_s: float) -> str:
        """The address it prints once it listens; "" if it exited or stayed silent that long."""
        try:
            return self.address.get(timeout=timeout_s)
        except queue.Empty:
            return ""

    def finish(self, deadline: float) -> int | None:
        """Exit status, or None if it was still running at `deadline` (then it is killed)."""
        try:
            rc = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self.reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def run_swarm(workdir: Path, steps: int, sync_every: int, fragments: int, timeout_s: float) -> dict[str, Any]:
    """Start the swarm, wait for every peer to stop at `steps`, and check what it left behind."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    # One intra-op thread per peer: three peers of a tiny model share a small box, and torch's
    # default (a thread per core in every process) has them fight over the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    deadline = time.monotonic() + timeout_s
    ckpt = [workdir / f"ckpt-{i}" for i in range(PEERS)]

    def args(i: int) -> list[str]:
        return ["--listen", "tcp://127.0.0.1:0", "--plaintext", *LIVENESS, "--steps", str(steps),
                "--shard", f"{i}/{PEERS}", "--log-every", str(sync_every // fragments),
                "--min-peers", str(PEERS), "--min-peers-timeout-s", str(timeout_s),
                "--checkpoint-dir", str(ckpt[i]), "--checkpoint-every", str(steps)]

    first_only = ["--protocol", "streaming-diloco", "--task", "hf_causal_lm:task", "--lr", "3e-3",
                  "--sync-every", str(sync_every), "--fragments", str(fragments), "--overlap-steps", "1"]
    began = time.monotonic()
    nodes = [NodeProcess("node-0", args(0) + first_only, env, workdir / "node-0.log")]
    try:
        address = nodes[0].join_address(timeout_s)
        if address:
            nodes += [NodeProcess(f"node-{i}", [*args(i), "--join", address], env, workdir / f"node-{i}.log")
                      for i in range(1, PEERS)]
        codes = [node.finish(deadline) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    ended = time.monotonic()
    failures = [f"{n.name} exited with {rc}:\n{n.log_tail()}" if rc is not None else f"{n.name} timed out"
                for n, rc in zip(nodes, codes) if rc != 0]
    if len(nodes) < PEERS:
        failures.append(f"node-0 printed no join address:\n{nodes[0].log_tail()}")
    summary: dict[str, Any] = {"peers": PEERS, "steps": steps, "wall_s": round(ended - began, 1)}
    if all(n.training_at is not None for n in nodes):  # start-up (imports, join, barrier), then training
        summary["startup_s"] = round(max(n.training_at for n in nodes) - began, 1)  # type: ignore[type-var]
    if failures:
        return {**summary, "ok": False, "failures": failures}
    return check(summary, nodes, ckpt, steps)


def check(summary: dict[str, Any], nodes: list[NodeProcess], ckpt: list[Path], steps: int) -> dict[str, Any]:
    """The checks, on what the nodes printed and on their last checkpoints."""
    failures = check_printed([n.records for n in nodes], steps)
    failures += check_checkpoints(ckpt, steps)
    stopped = [next((r for r in n.records if r.get("event") == "stopped"), {}) for n in nodes]
    progress = [[r for r in n.records if "loss" in r] for n in nodes]
    summary.update(
        ok=not failures, eval_loss=[s.get("eval_loss") for s in stopped],
        train_loss={"first": [p[0]["loss"] for p in progress if p], "last": [p[-1]["loss"] for p in progress if p]},
        bytes_sent=[p[-1]["bytes_sent"] if p else 0 for p in progress],
    )
    if failures:
        summary["failures"] = failures
    return summary


def check_printed(records: list[list[dict[str, Any]]], steps: int) -> list[str]:
    """What is wrong with the JSON lines each peer printed: every peer stopped at `steps`,
    synced with all the others at least once, and evaluated the same model, tied."""
    failures = []
    stopped = [next((r for r in rs if r.get("event") == "stopped"), {}) for rs in records]
    if [s.get("step") for s in stopped] != [steps] * len(records):
        failures.append(f"not every peer stopped at step {steps}: {[s.get('step') for s in stopped]}")
    eval_losses = [s.get("eval_loss") for s in stopped]
    if len(set(eval_losses)) != 1:
        failures.append(f"the peers evaluate different models: eval losses {eval_losses}")
    if any(s.get("embeddings_tied") != 1.0 for s in stopped):
        failures.append(f"a peer's eval model has untied embeddings: {[s.get('embeddings_tied') for s in stopped]}")
    synced_with = [max((r["peers"] for r in rs if "peers" in r), default=0) for rs in records]
    if min(synced_with) < len(records):
        failures.append(f"not every peer synced with all {len(records)}: at most {synced_with}")
    return failures


def check_checkpoints(dirs: list[Path], steps: int) -> list[str]:
    """What is wrong with the peers' checkpoints of `steps`: their outer parameters (and the
    rounds they merged) must be bit-identical; in each, the local model's output embedding must
    equal its input embedding, and the vector the swarm averages must hold that tensor once."""
    from starling.runtime import CheckpointStore

    states = []
    for d in dirs:
        found = CheckpointStore(d).load_latest()
        states.append(found[1]["protocol"] if found is not None and found[0].step == steps else None)
    if any(s is None for s in states):
        return [f"not every peer wrote a checkpoint of step {steps}: {[s is not None for s in states]}"]
    failures = []
    first = states[0]
    for i, s in enumerate(states[1:], 1):
        if s["versions"] != first["versions"] or len(s["outer"]) != len(first["outer"]) \
                or not all(torch.equal(a, b) for a, b in zip(s["outer"], first["outer"])):
            failures.append(f"node-{i}'s outer parameters differ from node-0's")
    for i, s in enumerate(states):
        model = s["model"]
        if not torch.equal(model[INPUT_EMBEDDING], model[OUTPUT_EMBEDDING]):
            failures.append(f"node-{i}'s local {OUTPUT_EMBEDDING} differs from its {INPUT_EMBEDDING}: untied")
        distinct = sum(t.numel() for name, t in model.items() if name != OUTPUT_EMBEDDING)
        averaged = sum(o.numel() for o in s["outer"])
        if averaged != distinct:
            failures.append(f"node-{i} averages {averaged} values, not its model's {distinct} distinct ones")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="swarm step every peer stops at")
    parser.add_argument("--sync-every", type=int, default=8, help="H: steps between two syncs of a fragment")
    parser.add_argument("--fragments", type=int, default=2, help="F: fragments, synced H/F steps apart")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up (and fail) after this long")
    parser.add_argument("--workdir", type=Path, help="keep logs and checkpoints here (default: a temporary dir)")
    a = parser.parse_args(argv)
    if a.workdir is not None and a.workdir.exists() and any(a.workdir.iterdir()):
        parser.error(f"--workdir {a.workdir} is not empty: its old checkpoints would be checked as this run's")
    stride = a.sync_every // a.fragments
    if a.sync_every % a.fragments or stride < 2 or a.steps % stride:
        parser.error("--sync-every must be a multiple of --fragments, at least 2 steps apart, and --steps a "
                     "multiple of that stride: the run then ends after a sync, with no round in flight")
    if a.workdir is not None:
        a.workdir.mkdir(parents=True, exist_ok=True)
        summary = run_swarm(a.workdir, a.steps, a.sync_every, a.fragments, a.timeout_s)
    else:
        with tempfile.TemporaryDirectory(prefix="starling-hf-") as tmp:
            summary = run_swarm(Path(tmp), a.steps, a.sync_every, a.fragments, a.timeout_s)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
