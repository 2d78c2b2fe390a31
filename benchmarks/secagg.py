"""Federated mode: secure aggregation's arithmetic, and sampled clients on non-IID data.

    python benchmarks/secagg.py [--only arithmetic|sampling] [--clients 1000] [--fraction 0.1]

Arithmetic (`arithmetic` rows, a 32-bit ring and an 8-bit one holding 4-bit values). One round
of `collectives/secagg.py` for 16 members over a
vector the size of `charlm` (110,464 values), SecAgg+'s graph (12 neighbours, threshold 7),
2 members dropped after dealing their shares: each member's dealing and masking, the owner's
unmasking, against an int4 encode and decode of the same vector in the same run (the codec a
DiLoCo part travels in today), and the bytes of a masked part against the int4 and float32
parts. The secure sum must equal the plain sum of the survivors' integer parts.

Sampling (`sampling` rows). `--clients` simulated peers (2 processes) train `diloco` (H 5, 20
steps) on the `teacher` task partitioned `dirichlet:0.5`, with `--fraction` of them drawn per
round, against the same swarm with every peer in every round: whether the run completes, the
participation the summary reports, eval loss and wall time of each.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import numpy as np
import torch

from starling.collectives.secagg import IntegerCodec, MaskingMember, Unmasker, graph_degree, record_verifier
from starling.compressors import from_spec
from starling.node.identity import Identity
from starling.runtime import SimConfig, Simulation

CHARLM_VALUES = 110_464


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


RINGS = {32: IntegerCodec(), 8: IntegerCodec(scale=2.0, clip=3.5, bits=8)}  # 8 bits: 4-bit values, <= 18 members


def arithmetic(bits: int, members: int = 16, size: int = CHARLM_VALUES, dropped: int = 2) -> None:
    rng = random.Random(0)
    degree = graph_degree(members)
    threshold = degree // 2 + 1
    ids = {f"m{i:02d}": Identity.generate() for i in range(members)}
    verify = record_verifier({m: ident.verify_key for m, ident in ids.items()})
    round_id = b"bench"
    g = torch.Generator().manual_seed(0)
    codec = RINGS[bits]
    xs = {m: torch.randn(size, generator=g) * (0.01 if bits == 32 else 1.0) for m in ids}
    began = time.perf_counter()
    clients = {m: MaskingMember(m, tuple(ids), round_id, threshold, degree, ident.sign,
                                random_bytes=lambda k: rng.randbytes(k)) for m, ident in ids.items()}
    deals = {m: c.deal() for m, c in clients.items()}
    for shares in deals.values():
        for share in shares:
            clients[share.holder].hold(share, verify)
    deal_s = (time.perf_counter() - began) / members
    adverts = {m: c.advert for m, c in clients.items()}
    sending = list(ids)[dropped:]
    masked, mask_times = {}, []
    for m in sending:
        began = time.perf_counter()
        masked[m] = clients[m].mask(codec.encode(xs[m]), adverts, verify)
        mask_times.append(time.perf_counter() - began)
    owner = Unmasker(tuple(ids), round_id, threshold, degree, size, bits=bits)
    began = time.perf_counter()
    for m in sending:
        owner.receive(m, masked[m])
    revealed = [s for m in owner.survivors() for s in clients[m].reveal(owner.survivors())]
    total = owner.unmask(adverts, revealed, verify)
    unmask_s = time.perf_counter() - began
    plain = np.zeros(size, dtype=codec.dtype)
    for m in sending:
        plain = (plain + codec.encode(xs[m])).astype(codec.dtype)
    int4 = from_spec("int4")
    began = time.perf_counter()
    for m in sending:
        packet = int4.encode(xs[m])
        int4.decode(packet)
    int4_s = (time.perf_counter() - began) / len(sending)
    int4_bytes = packet.nbytes
    mask_s = sorted(mask_times)[len(mask_times) // 2]
    emit({"row": "arithmetic", "ring_bits": bits, "scale": codec.scale, "clip": codec.clip, "members": members,
          "values": size, "neighbours": degree, "threshold": threshold,
          "dropped": dropped, "exact": bool(np.array_equal(total, plain)),
          "deal_ms_per_member": round(deal_s * 1e3, 2), "mask_ms_per_member": round(mask_s * 1e3, 2),
          "unmask_ms_owner": round(unmask_s * 1e3, 2), "int4_encode_decode_ms": round(int4_s * 1e3, 2),
          "mask_over_int4": round(mask_s / int4_s, 2),
          "masked_part_bytes": int(masked[sending[0]].nbytes), "int4_part_bytes": int4_bytes,
          "float32_part_bytes": size * 4, "masked_over_int4_bytes": round(masked[sending[0]].nbytes / int4_bytes, 2),
          "max_error_of_sum": codec.max_error(len(sending)), "capacity_members": codec.capacity()})


def sampling(clients: int, fraction: float, steps: int = 20) -> None:
    common = {"peers": clients, "protocol": "diloco", "steps": steps, "task": "teacher", "transport": "tcp",
              "processes": 2, "task_options": {"partition": "dirichlet:0.5", "batch_size": 16}}
    rows = {}
    for label, options in (("sampled", {"sync_every": 5, "sample_fraction": fraction}), ("full", {"sync_every": 5})):
        began = time.perf_counter()
        try:
            summary = Simulation(SimConfig(**common, options=options)).run().summary
        except Exception as exc:  # a run that cannot finish here is a row that says so
            emit({"row": "sampling", "run": label, "clients": clients, "completed": False,
                  "error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": round(time.perf_counter() - began)})
            continue
        rows[label] = summary
        emit({"row": "sampling", "run": label, "clients": clients, "fraction": fraction if label == "sampled" else 1.0,
              "completed": summary["final_peers"] == clients,
              "participation": {k: v for k, v in summary.get("participation", {}).items() if k != "clients_per_step"},
              "clients_per_round": sorted(set(summary.get("participation", {}).get("clients_per_step", [clients]))),
              "eval_loss": summary["eval_loss"], "bytes_sent_per_peer": summary["bytes_sent_per_peer"],
              "wall_s": round(summary["wall_s"], 1), "seconds": round(time.perf_counter() - began)})
    if len(rows) == 2:
        emit({"row": "sampling", "compare": "sampled/full", "clients": clients,
              "eval_loss_ratio": round(rows["sampled"]["eval_loss"] / rows["full"]["eval_loss"], 4),
              "bytes_ratio": round(rows["sampled"]["bytes_sent_per_peer"] / rows["full"]["bytes_sent_per_peer"], 4)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("arithmetic", "sampling"))
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.1)
    args = parser.parse_args()
    if args.only in (None, "arithmetic"):
        for bits in RINGS:
            arithmetic(bits)
    if args.only in (None, "sampling"):
        sampling(args.clients, args.fraction)


if __name__ == "__main__":
    main()
