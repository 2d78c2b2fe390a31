"""Train a small GPT on text that ships with Python, across a simulated swarm, one unit at a time.

The corpus is the running interpreter's standard library source (nothing is downloaded),
tokenized byte by byte into a token file under a temporary folder. Four peers train with
DiLoCo; the swarm's ledger hands each of them different units of the epoch every step.

    python examples/train_on_text.py [DATA] [STEPS]

DATA is any folder of text files, a .txt/.jsonl/.csv/.parquet file or a Hugging Face data set
name (default: stdlib). The same run from the command line:

    starling simulate --data stdlib --seq-len 64 --protocol diloco --sync-every 10 --peers 4 --steps 60
"""
from __future__ import annotations

import json
import sys
import tempfile

from starling.runtime import SimConfig, Simulation

DATA = sys.argv[1] if len(sys.argv) > 1 else "stdlib"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 60

with tempfile.TemporaryDirectory() as cache:
    config = SimConfig(peers=4, steps=STEPS, protocol="diloco", task="gpt", transport="inproc",
                       options={"sync_every": 10, "lr": 0.003},
                       task_options={"data": DATA, "seq_len": "64", "batch_size": "8", "cache_dir": cache})
    result = Simulation(config).run()
    summary = result.summary
    print(json.dumps({key: summary[key] for key in ("task", "peers", "steps", "train_loss", "eval_loss",
                                                    "bytes_sent_per_peer", "wall_s")}))
