"""A hostile member for the multi-process tests: `starling node start` as it is, in a process
whose protocols are attacked by one attack of benchmarks/attacks.py (the CLI has no attacker
mode; the attack patches the protocol this process builds).

    python tests/attacker_node.py ATTACK node start --join ADDRESS ...
"""
from __future__ import annotations

import sys

from conftest import load_benchmark  # this script's folder is first on sys.path

from starling.cli.main import main

if __name__ == "__main__":
    load_benchmark("attacks").on_every_protocol(sys.argv[1])
    sys.argv = ["starling", *sys.argv[2:]]
    main()
