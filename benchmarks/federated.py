"""A federated run from the command line against the same partition in the simulator.

    python benchmarks/federated.py [--peers 8] [--alpha 0.5] [--steps 120] [--sync-every 12]
                                   [--seed 0] [--documents 120]

A corpus (documents of the Python standard library's source, which needs no download) is cut
over `--peers` members by document with a Dirichlet(`--alpha`) draw, Flower's
DirichletPartitioner, exactly as `simulate --partition dirichlet:ALPHA` cuts it; each member's
part is written to a folder of its own. Then:

- ``simulator``: `Simulation` of `--peers` peers training the corpus under that partition
  (streaming-diloco, the gpt task), which is a swarm of each member's own data (its part);
- ``cli``: `--peers` `starling node start --data-scope local` processes, each with `--data` its
  own folder, the same protocol, options, model, seed and steps; the first fixes the swarm, the
  others join it. Each writes its final state to a checkpoint.

Both are evaluated on the union's held-out text (the corpus's last units, which no member
trains): the simulator's peers through the shared task, the command line's member 0 by loading
its final checkpoint into a trainer over the whole corpus. Prints one JSON row; target: the
command line's eval loss within 5% of the simulator's (``ratio`` <= 1.05), the line's members'
own data never in the swarm's config.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.05
MODEL = {"seq_len": 32, "n_layer": 1, "n_head": 2, "n_embd": 32, "batch_size": 4, "eval_batches": 8}


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def write_corpus(root: Path, documents: int) -> Path:
    """`documents` source files of the standard library (sorted, the same on every run), as text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if 4_000 <= p.stat().st_size <= 40_000)[:documents]
    root.mkdir(parents=True)
    for i, path in enumerate(files):
        (root / f"{i:04d}-{path.stem}.txt").write_text(path.read_text(errors="replace"))
    return root


def task_options(data: Path, cache: Path, **more: Any) -> dict[str, Any]:
    return {"data": str(data), "cache_dir": str(cache), **MODEL, **more}


def cut(corpus: Path, cache: Path, peers: int, alpha: float, seed: int, out: Path) -> list[Path]:
    """Each member's part of `corpus` under the Dirichlet partition, as a folder of its own: the
    text of every training unit the partition gives it (a unit a document of its folder)."""
    from starling.tasks import get_task

    task = get_task("gpt", **task_options(corpus, cache, partition=f"dirichlet:{alpha}"))
    tokens, span = task.store.tokens, MODEL["batch_size"] * MODEL["seq_len"]
    eos = task.tokenizer.eos_id
    folders = []
    for rank in range(peers):
        folder = out / f"member-{rank}"
        folder.mkdir(parents=True)
        for unit in task.partition_units(rank, peers, seed).tolist():
            ids = [int(t) for t in tokens[unit * span:(unit + 1) * span] if int(t) != eos]
            (folder / f"unit-{unit:06d}.txt").write_text(task.tokenizer.decode(ids))
        folders.append(folder)
    return folders


def run_simulator(corpus: Path, cache: Path, peers: int, alpha: float, steps: int, sync_every: int,
                  seed: int) -> dict[str, Any]:
    from starling.runtime import SimConfig, Simulation

    config = SimConfig(peers=peers, protocol="streaming-diloco", task="gpt", steps=steps, seed=seed,
                       options={"sync_every": sync_every},
                       task_options=task_options(corpus, cache, partition=f"dirichlet:{alpha}"))
    began = time.monotonic()
    result = Simulation(config).run()
    summary = result.summary
    return {"eval_loss": summary["eval_loss"], "wall_s": round(time.monotonic() - began, 1)}


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", "node", "start", "--plaintext", *args]


def run_cli(folders: list[Path], cache: Path, work: Path, steps: int, sync_every: int, seed: int,
            timeout_s: float) -> dict[str, Any]:
    model = [arg for name, value in MODEL.items() for arg in ("--task-opt", f"{name}={value}")]
    common = ["--data-scope", "local", "--task-opt", f"cache_dir={cache}", *model, "--steps", str(steps),
              "--checkpoint-every", str(steps), "--log-every", "0"]
    began = time.monotonic()
    first = subprocess.Popen(starling("--protocol", "streaming-diloco", "--opt", f"sync_every={sync_every}",
                                      "--seed", str(seed), "--min-peers", str(len(folders)), "--data",
                                      str(folders[0]), "--checkpoint-dir", str(work / "ckpt-0"), *common),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs = [first]
    try:
        line = first.stdout.readline()  # type: ignore[union-attr]
        if "join with:" not in line:
            raise RuntimeError(f"the first member did not start: {line!r}")
        address = line.rsplit("join with:", 1)[1].strip()
        from starling.node.client import query

        config = query(address, timeout_s=10.0)["config"]
        private = not any(str(f) in json.dumps(config) for f in folders)
        for rank, folder in enumerate(folders[1:], start=1):
            procs.append(subprocess.Popen(starling("--join", address, "--data", str(folder), "--checkpoint-dir",
                                                   str(work / f"ckpt-{rank}"), *common),
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stopped = [json.loads(line) for out in outs for line in out.splitlines() if '"stopped"' in line]
    return {"members": len(stopped), "own_eval_loss": [s.get("eval_loss") for s in stopped],
            "config_names_no_data": private, "wall_s": round(time.monotonic() - began, 1)}


def evaluate_checkpoint(directory: Path, corpus: Path, cache: Path) -> float:
    """Member `directory`'s final state, evaluated on the union's held-out text."""
    from starling.node import Node
    from starling.runtime import CheckpointConfig, CheckpointStore, Trainer, TrainSpec
    from starling.tasks import get_task

    found = CheckpointStore(directory).list()
    if not found:
        raise RuntimeError(f"no checkpoint in {directory}")
    spec = TrainSpec.from_swarm_config(found[0].meta["swarm"]).with_own_data(
        {"data": str(corpus), "cache_dir": str(cache)})
    node = Node().start("tcp://127.0.0.1:0", [], security="plaintext", swarm_config=spec.to_swarm_config())
    try:
        trainer = Trainer(node, spec, 0, 1, task=get_task("gpt", **task_options(corpus, cache)), serve_state=False,
                          checkpoint=CheckpointConfig(str(directory), every=1 << 30))
        trainer.create_protocol()
        trainer.resume()
        return trainer.evaluate()["eval_loss"]
    finally:
        node.close()


def run(peers: int = 8, alpha: float = 0.5, steps: int = 120, sync_every: int = 12, seed: int = 0,
        documents: int = 120, timeout_s: float = 900.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="starling-federated-") as tmp:
        work = Path(tmp)
        cache = work / "cache"
        corpus = write_corpus(work / "corpus", documents)
        folders = cut(corpus, cache, peers, alpha, seed, work / "members")
        sim = run_simulator(corpus, cache, peers, alpha, steps, sync_every, seed)
        cli = run_cli(folders, cache, work, steps, sync_every, seed, timeout_s)
        cli_eval = evaluate_checkpoint(work / "ckpt-0", corpus, cache)
    ratio = cli_eval / sim["eval_loss"]
    row = {"row": "federated_cli_vs_simulator", "peers": peers, "partition": f"dirichlet:{alpha}", "steps": steps,
           "sync_every": sync_every, "protocol": "streaming-diloco", "sim_eval_loss": round(sim["eval_loss"], 4),
           "cli_eval_loss": round(cli_eval, 4), "ratio": round(ratio, 4), "target": TARGET_RATIO,
           "met": ratio <= TARGET_RATIO and cli["members"] == peers and cli["config_names_no_data"],
           "cli_members_stopped": cli["members"], "config_names_no_data": cli["config_names_no_data"],
           "cli_own_eval_loss": cli["own_eval_loss"], "sim_wall_s": sim["wall_s"], "cli_wall_s": cli["wall_s"],
           "cpus": os.cpu_count()}
    emit(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=120)
    args = parser.parse_args()
    run(args.peers, args.alpha, args.steps, args.sync_every, args.seed, args.documents)


if __name__ == "__main__":
    main()
