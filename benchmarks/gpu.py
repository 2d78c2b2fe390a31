"""Starling on a real accelerator, in one call: the device, every codec's speed and results
there, pinned staging, and simulated swarms training on it.

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--only SECTION,...] [--elements N]
                             [--check-elements N] [--steps N] [--codec-budget-s S]
                             [--gpt-steps N] [--gpt-tokenizer FILE] [--write-tokenizer FOLDER]
                             [--sparse-steps N]

Prints one JSON row per measurement, then a summary row; every row names its ``section``:

- ``device``: torch and CUDA versions, the device's name, memory and compute capability.
- ``codecs``: every registered codec (one or more specs each) on a 64M-value tensor, float32
  and bfloat16 input: encode and decode time on the device (CUDA events), each over the time
  of a device-to-device copy of the same tensor (``encode_over_copy``: 2.0 means twice as long
  as the copy), and the device's extra memory at its peak while encoding. Then a check of
  decode(encode(x)) against the CPU running the same codec on the same values (the first
  ``--check-elements`` of them): a lossless codec gives x back exactly on both, a lossy one
  errs no more on the device than on the CPU (``ERROR_SLACK``). Slow reference sketches run on
  a capped slice; the row says how many values it saw.
- ``staging``: a large encoded packet through pinned host staging (collectives/staging.py):
  the first copy (pinned buffers allocated), a reused one, a plain pageable copy; bytes intact.
- ``simulate``: `starling simulate --device DEVICE` through the Python API: 4 peers in one
  process, the default charlm task, allreduce and streaming-diloco in float32, bfloat16
  parameters and bfloat16 autocast, each against the same swarm that never syncs (diloco
  with a sync period past the run). On an accelerator the reducers send their encoded parts
  through pinned staging by themselves. ``step_s`` is the median step time of every peer after
  the warm-up steps; ``step_over_no_sync`` its ratio to the no-sync run's in the same
  precision; ``compute_fraction`` the share of the steps' wall time spent computing. Eval
  losses must be finite, and equal on every peer where the protocol promises one model.
- ``state_device``: streaming-diloco with its outer state in pinned host memory
  (``--state-device cpu``) against the same run with it on the device: both run, and their
  losses match (``bit_identical`` says whether exactly). On an accelerator the same run on
  the CPU is reported beside them, for reference.
- ``gpt``: the ``gpt`` task at GPT-2 small's shape (12 layers, 768 wide, 12 heads, a 50,257-id
  byte-level BPE that `tokenizers` trains here on the stdlib tree: 124M parameters), trained
  on the stdlib source, 4 peers
  on one device in bf16 autocast, ``allreduce`` against ``streaming-diloco`` (int4 exchange),
  the same units of the same tokens: eval loss, bytes per peer and step time of each, and
  the ratios.
- ``shards``: `--shard-sync`'s FSDP2 path on the device, one rank (the only group one GPU can
  hold; NCCL on CUDA): Starling's step against a plain FSDP2 step of the same model, and a
  collective evaluation.
- ``sparse``: SparseLoCo-style pseudo-gradients (``benchmarks/diloco.py``'s sparse spec and
  outer loop) on a 10.6M-parameter ``charlm`` for ``--sparse-steps`` (2000) steps of 4 peers,
  against ``allreduce`` and int4 ``streaming-diloco`` at the same tokens: eval losses, bytes,
  bits per parameter per sync, and the sparse targets of ``benchmarks/diloco.py``.

A section, or one measurement in it, that fails prints a row with ``error`` (type and message)
and the end of its traceback, and the run goes on. ``--quick`` shrinks every size (a tiny
model, a few steps) so that ``--device cpu --quick`` runs the same code in a test. The exit
status is 1 when any row holds an error or ``"ok": false``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from starling.collectives.staging import HostStaging, to_device
from starling.compressors import Packet, decode, from_spec, registered_codecs
from starling.compressors.fused import Fused
from starling.node.swim import Liveness
from starling.runtime import SimConfig, SimResult, Simulation
from starling.runtime.summary import busy_share
from starling.tasks import get_task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diloco  # (benchmarks/diloco.py: the sparse run's codec, outer loop and targets)
from step_compare import alternate, plain_step  # benchmarks/step_compare.py

SPARSE_RUNS = ("allreduce", "int4", "sparse")
SECTIONS = ("device", "codecs", "staging", "simulate", "state_device", "gpt", "sparse", "shards")
SEED = 1  # every codec's seed: stochastic rounding, random-k and the sketches draw the same on each device
TRACEBACK_CHARS = 1500
# A lossy codec's relative L2 error on the device may exceed the CPU's on the same values by this
# fraction (top-k ties and the order of float sums may differ there; the error may not grow). The
# seeded draws are bit for bit the same on both devices.
ERROR_SLACK = 0.05
# Two runs of one swarm "match" within this relative difference in loss when not bit for bit
# (a GPU's reductions may order sums differently from run to run).
MATCH_RTOL = 1e-3
# A lenient failure detector: no peer dies here, and a busy box must not declare one dead.
BENCH_LIVENESS = Liveness(probe_interval_s=0.5, suspicion_base_s=60.0)

# (spec, at most this many values or None for all, view as a matrix): every registered codec at
# least once (a row flags any that is missing). The dense sketches cost O(n * size): capped as in
# benchmarks/compressors.py.
CODECS: list[tuple[str, int | None, bool]] = [
    ("none", None, False),
    ("fp16", None, False),
    ("bf16", None, False),
    ("fp8:e4m3", None, False),
    ("fp8:e5m2", None, False),
    ("int8", None, False),
    ("int8:stochastic=true", None, False),
    ("int4", None, False),
    ("int4:stochastic=true", None, False),
    ("fp4", None, False),
    ("fp4:e3m0", None, False),
    ("sign", None, False),
    ("q2", None, False),
    ("topk:0.001", None, False),
    ("topk:0.01+int8", None, False),
    ("chunktopk:64/4096+q2", None, False),
    ("randomk:0.01", None, False),
    ("randomk:0.01+int8", None, False),
    ("powersgd:4", None, True),
    ("powersgd:4+int8", None, True),
    ("countsketch:5x65536,heavy=1000", 1 << 20, False),
    ("gsketch:65536,kind=srht", 1 << 22, False),
    ("gsketch:256", 1 << 14, False),
]
INPUT_DTYPES = (torch.float32, torch.bfloat16)

# Where and in what precision every peer trains (SimConfig's dtype and autocast).
PRECISIONS: dict[str, dict[str, str]] = {
    "float32": {},
    "bf16": {"dtype": "bfloat16"},
    "autocast-bf16": {"autocast": "bfloat16"},
}


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: full on an accelerator, tiny with --quick."""

    elements: int = 1 << 26  # 64M values: 256 MB of float32
    check_elements: int = 1 << 22  # the CPU reference encodes this many of them
    cap_divisor: int = 1  # the capped sketches see their cap over this (a dense sketch is slow on a CPU)
    repeat: int = 5  # timed rounds (the best is kept)
    codec_budget_s: float = 90.0  # codecs not reached by then are reported as skipped
    peers: int = 4
    steps: int = 40
    warmup_steps: int = 5  # a peer's first steps (CUDA's lazy start-up) are left out of step_s
    # A swarm's peers stop training this many seconds after they start (SimConfig.duration_s), so
    # that one stuck run cannot take the others' time; its row then says it ran fewer steps. 0: none.
    run_budget_s: float = 90.0
    task_options: dict[str, Any] = field(default_factory=dict)  # the default charlm task
    streaming: dict[str, Any] = field(default_factory=lambda: {"sync_every": 8, "fragments": 2,
                                                                "overlap_steps": 1})

    # gpt: GPT-2 small's shape; the vocabulary is a BPE trained here (no download)
    gpt_vocab: int = 50_257
    gpt_options: dict[str, Any] = field(default_factory=lambda: {
        "n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 256, "batch_size": 8, "eval_batches": 8})
    gpt_steps: int = 96
    gpt_tokenizer: str = ""  # a tokenizer.json to use instead of training one
    gpt_lr: float = 6e-4
    gpt_streaming: dict[str, Any] = field(default_factory=lambda: {
        "sync_every": 24, "fragments": 4, "overlap_steps": 1, "compressor": "int4"})
    gpt_budget_s: float = 100.0  # per run
    # sparse: a 10.6M-parameter charlm for 2000+ steps
    sparse_options: dict[str, Any] = field(default_factory=lambda: {
        "n_layer": 6, "n_head": 6, "n_embd": 384, "seq_len": 128, "batch_size": 16, "corpus_chars": 4_000_000})
    sparse_steps: int = 2000
    sparse_sync_every: int = 64
    sparse_fragments: int = 4
    sparse_lr: float = 1e-3
    sparse_budget_s: float = 150.0  # per run
    sparse_runs: tuple[str, ...] = SPARSE_RUNS
    # shards: FSDP2 on the device (one rank: the only group one GPU can hold), Starling's step
    # with every rank syncing its own shard against plain FSDP2's
    shard_options: dict[str, Any] = field(default_factory=lambda: {"n_layer": 6, "n_embd": 512, "batch_size": 16})
    shard_steps: int = 30

    @classmethod
    def quick(cls) -> Plan:
        return cls(elements=1 << 16, check_elements=1 << 16, cap_divisor=16, repeat=2, steps=3, warmup_steps=1,
                   run_budget_s=60.0,
                   task_options={"n_embd": 16, "batch_size": 2, "eval_batches": 1, "corpus_chars": 20_000},
                   streaming={"sync_every": 2, "fragments": 2, "overlap_steps": 1},
                   gpt_vocab=300, gpt_options={"n_layer": 1, "n_head": 2, "n_embd": 16, "seq_len": 16,
                                               "batch_size": 2, "eval_batches": 1},
                   gpt_steps=4, gpt_streaming={"sync_every": 2, "fragments": 2, "overlap_steps": 1,
                                               "compressor": "int4"}, gpt_budget_s=60.0,
                   sparse_options={"n_layer": 1, "n_head": 2, "n_embd": 16, "batch_size": 2, "corpus_chars": 20_000},
                   sparse_steps=8, sparse_sync_every=4, sparse_fragments=2, sparse_budget_s=60.0,
                   shard_options={"n_layer": 1, "n_embd": 16, "batch_size": 2, "corpus_chars": 20_000}, shard_steps=4)


# ------------------------------------------------------------------ rows and their failures

def error_row(section: str, exc: BaseException, **what: Any) -> dict[str, Any]:
    return {"section": section, **what, "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]}


def guarded(section: str, what: dict[str, Any], make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The row `make` builds, or an error row naming `what` failed."""
    try:
        return {"section": section, **what, **make()}
    except Exception as exc:
        free_device_memory()
        return error_row(section, exc, **what)


def free_device_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ timing

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Best of `repeat` runs of `fn`, in seconds: on CUDA between two events on the stream
    (the device's own clock, any host wait inside `fn` included), elsewhere the host clock."""
    best = math.inf
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            synchronize(device)
            began = time.perf_counter()
            fn()
            synchronize(device)
            best = min(best, time.perf_counter() - began)
    return best


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Device memory `fn` needs at its peak above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# ------------------------------------------------------------------ a. the device

def device_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    row: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "device": str(device), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        row.update(name=torch.cuda.get_device_name(device), capability=".".join(map(str, (props.major, props.minor))),
                   multiprocessors=props.multi_processor_count, memory_gib=round(total / 2**30, 1),
                   free_gib=round(free / 2**30, 1), bf16_supported=torch.cuda.is_bf16_supported(),
                   cudnn=torch.backends.cudnn.version(), devices=torch.cuda.device_count())
    else:
        row.update(name=platform.processor() or platform.machine())
    yield {"section": "device", **row}


# ------------------------------------------------------------------ b. codecs

def sig(x: float, digits: int = 3) -> float:
    """`x` to a few significant digits (a ratio of 0.004 stays 0.004, not 0.0)."""
    return float(f"{x:.{digits}g}")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """The flat tensor as a near-square matrix (PowerSGD compresses matrices)."""
    rows = 1 << max(0, (math.isqrt(x.numel()) - 1).bit_length() - 1)
    return x[: x.numel() // rows * rows].view(rows, -1)


def shaped(x: torch.Tensor, cap: int | None, matrix: bool) -> torch.Tensor:
    x = x if cap is None else x[: max(1, cap)]
    return as_matrix(x) if matrix else x


def codec_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    covered = {part.partition(":")[0] for spec, _, _ in CODECS for part in spec.split("+")}
    missing = sorted(set(registered_codecs()) - covered)
    yield {"section": "codecs", "registered": list(registered_codecs()), "missing_from_bench": missing,
           "ok": not missing}
    deadline = time.monotonic() + plan.codec_budget_s
    values = torch.randn(plan.elements, generator=torch.Generator().manual_seed(0))
    for dtype in INPUT_DTYPES:
        yield from codec_rows_in(values.to(dtype), device, plan, deadline)
        free_device_memory()


def codec_rows_in(x_cpu: torch.Tensor, device: torch.device, plan: Plan, deadline: float) -> Iterator[dict[str, Any]]:
    """Every codec on `x_cpu` moved to the device, checked against the CPU on its first values."""
    x = x_cpu.to(device)
    check, check_cpu = x[: plan.check_elements], x_cpu[: plan.check_elements]
    for spec, full_cap, matrix in CODECS:
        cap = None if full_cap is None else full_cap // plan.cap_divisor
        what = {"codec": spec, "dtype": str(x.dtype).removeprefix("torch.")}
        if time.monotonic() > deadline:
            yield {"section": "codecs", **what, "skipped": f"the codecs' budget of {plan.codec_budget_s:g} s is spent"}
            continue
        yield guarded("codecs", what, lambda: {
            **measure_codec(spec, shaped(x, cap, matrix), device, plan.repeat),
            **check_codec(spec, shaped(check, cap, matrix), shaped(check_cpu, cap, matrix))})


def measure_codec(spec: str, x: torch.Tensor, device: torch.device, repeat: int) -> dict[str, Any]:
    codec = from_spec(spec)
    codec.encode(x, seed=SEED)  # the warm-up: starts any kernel's compile, which runs in a thread
    Fused.settle()
    before = Fused.report()["compiled_calls"]
    packet = codec.encode(x, seed=SEED)  # the packet whose decode is timed
    kernels = Fused.report()
    codec.decode(packet)
    target = torch.empty_like(x)
    copy_s = max(best_time(lambda: target.copy_(x), device, repeat), 1e-9)
    encode_s = best_time(lambda: codec.encode(x, seed=SEED), device, repeat)
    decode_s = best_time(lambda: codec.decode(packet), device, repeat)
    peak = peak_extra_bytes(lambda: codec.encode(x, seed=SEED), device)
    in_bytes = x.numel() * x.element_size()
    kernel: dict[str, Any] = {}
    if getattr(codec, "fused", False) and not codec.stochastic and x.numel() % codec.block == 0:
        # the one-kernel codecs: the kernel alone, without encode's checks and host work around it
        blocks = x.reshape(-1, codec.block)
        kernel_s = best_time(lambda: codec._codes_fused(blocks), device, repeat)
        kernel = {"kernel_s": sig(kernel_s), "kernel_over_copy": sig(kernel_s / copy_s)}
    return {"elements": x.numel(), "input_mb": round(in_bytes / 2**20, 3), "wire_bytes": packet.nbytes,
            "compression": sig(in_bytes / max(1, packet.nbytes)),
            "encoded_on_device": all(b.device == x.device for b in packet.buffers if b.numel()),
            "copy_s": sig(copy_s), "encode_s": sig(encode_s), "decode_s": sig(decode_s),
            "encode_over_copy": sig(encode_s / copy_s), "decode_over_copy": sig(decode_s / copy_s),
            "encode_gbps": sig(in_bytes / encode_s / 1e9), "decode_gbps": sig(in_bytes / decode_s / 1e9),
            "fused_kernel": kernels["compiled_calls"] > before, **kernel,
            **({"kernel_failures": kernels["failures"]} if kernels["failures"] else {}),
            **({} if peak is None else {"encode_peak_extra_mb": round(peak / 2**20, 1)})}


def check_codec(spec: str, x: torch.Tensor, x_cpu: torch.Tensor) -> dict[str, Any]:
    """decode(encode(x)) on the device against the CPU's on the same values."""
    on_device, on_cpu = from_spec(spec), from_spec(spec)
    packet, packet_cpu = on_device.encode(x, seed=SEED), on_cpu.encode(x_cpu, seed=SEED)
    y = on_device.decode(packet)
    y_host, y_cpu = y.cpu(), on_cpu.decode(packet_cpu)
    wire_equal = packet.header == packet_cpu.header and len(packet.buffers) == len(packet_cpu.buffers) and all(
        torch.equal(a.cpu(), b) for a, b in zip(packet.buffers, packet_cpu.buffers))
    # what a CPU peer makes of the device's packet once it crossed to the host
    crossed = from_spec(spec).decode(Packet(packet.header, tuple(b.cpu() for b in packet.buffers)))
    err, err_cpu = rel_l2(y_host, x_cpu), rel_l2(y_cpu, x_cpu)
    same_shape = y.shape == x.shape and y.dtype == x.dtype
    if on_device.lossless:
        ok = same_shape and torch.equal(y_host, x_cpu) and torch.equal(y_cpu, x_cpu)
    else:
        ok = same_shape and math.isfinite(err) and err <= err_cpu * (1 + ERROR_SLACK) + 1e-6
    scale = float(y_host.abs().max()) if y_host.numel() else 0.0
    return {"check_elements": x.numel(), "lossless": on_device.lossless, "rel_l2": sig(err, 4),
            "rel_l2_cpu": sig(err_cpu, 4), "wire_equal_cpu": wire_equal,
            "decoded_equal_cpu": torch.equal(y_host, y_cpu),
            "cross_decode_max_diff": float((crossed - y_host).abs().max() / max(scale, 1e-30)) if scale else 0.0,
            "ok": ok}


# ------------------------------------------------------------------ pinned staging

def staging_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    yield guarded("staging", {"codec": "int8"}, lambda: measure_staging(device, plan))


def measure_staging(device: torch.device, plan: Plan) -> dict[str, Any]:
    x = torch.randn(plan.elements, generator=torch.Generator().manual_seed(0)).to(device)
    packet = from_spec("int8").encode(x)  # the bytes one round of a large model's parameters stages
    del x
    staging = HostStaging()

    def stage_and_return() -> None:
        _, lent = staging.stage(packet)
        staging.ready([device])
        staging.give_back(lent)

    synchronize(device)
    began = time.perf_counter()
    staged, lent = staging.stage(packet)
    staging.ready([device])
    first_s = time.perf_counter() - began
    intact = torch.equal(decode(staged).cpu(), decode(packet).cpu())
    back = decode(to_device(staged, device))
    intact = intact and back.device.type == device.type and torch.equal(back, decode(packet))
    pinned = bool(lent) and all(b.is_pinned() for b in staged.buffers if b.numel())
    staging.give_back(lent)
    reused_s = best_time(stage_and_return, device, plan.repeat)
    pageable_s = best_time(lambda: [b.cpu() for b in packet.buffers], device, plan.repeat)
    wire = packet.nbytes
    on_accelerator = HostStaging.needed(packet.buffers[0])
    return {"device": str(device), "wire_mb": round(wire / 2**20, 2), "staged": bool(lent), "pinned": pinned,
            "pinned_mb": round(staging.allocated / 2**20, 2), "first_stage_s": sig(first_s),
            "stage_s": sig(reused_s), "stage_gbps": sig(wire / max(reused_s, 1e-9) / 1e9),
            "pageable_s": sig(pageable_s), "pageable_gbps": sig(wire / max(pageable_s, 1e-9) / 1e9),
            # on the CPU staging hands the packet back untouched; beside an accelerator it pins
            "ok": intact and (pinned if on_accelerator else staged is packet)}


# ------------------------------------------------------------------ c. simulated swarms

@dataclass(frozen=True)
class SwarmRun:
    """One simulated swarm: a label, its protocol and options, and whether every peer ends
    holding one model (eval losses equal)."""

    label: str
    protocol: str
    options: dict[str, Any]
    one_model: bool


def swarm_runs(plan: Plan) -> tuple[SwarmRun, ...]:
    never = plan.steps * 1000  # a sync period past the run: each peer trains alone
    return (SwarmRun("no-sync", "diloco", {"sync_every": never}, one_model=False),
            SwarmRun("allreduce", "allreduce", {}, one_model=True),
            SwarmRun("streaming-diloco", "streaming-diloco", dict(plan.streaming), one_model=True))


def simulate(run: SwarmRun, device: torch.device, precision: str, plan: Plan,
             state_device: str | None = None) -> tuple[SimResult, float]:
    config = SimConfig(peers=plan.peers, protocol=run.protocol, task="charlm", steps=plan.steps,
                       options=run.options, task_options=plan.task_options, liveness=BENCH_LIVENESS,
                       duration_s=plan.run_budget_s, device=str(device), state_device=state_device,
                       **PRECISIONS[precision])
    began = time.perf_counter()
    result = Simulation(config).run()
    return result, time.perf_counter() - began


def step_times(result: SimResult, warmup_steps: int) -> dict[str, Any]:
    """Median step and compute time of every peer's steps after its warm-up, and the share of
    those steps' wall time spent computing."""
    records = [r for p in result.peers for r in p.records[warmup_steps:]] or \
              [r for p in result.peers for r in p.records]
    walls = [r["step_wall_s"] for r in records]
    computes = [r["compute_s"] for r in records]
    busy = busy_share(records)
    return {"step_s": sig(statistics.median(walls)), "compute_s": sig(statistics.median(computes)),
            "compute_fraction": None if busy is None else round(busy, 3), "timed_steps": len(records)}


def describe_run(run: SwarmRun, result: SimResult, seconds: float, plan: Plan) -> dict[str, Any]:
    return {"peers": plan.peers, "one_model_promised": run.one_model,
            **describe(result, seconds, plan.steps, run.one_model, plan.warmup_steps)}


def describe(result: SimResult, seconds: float, steps: int, one_model: bool, warmup_steps: int) -> dict[str, Any]:
    """One swarm's row: steps done and their times, every peer's eval loss (and their mean),
    bytes, how the peers ended, and whether it ran as promised (`ok`)."""
    losses = [p.eval_loss for p in result.peers]
    finite = all(loss is not None and math.isfinite(loss) for loss in losses)
    agree = finite and len(set(losses)) == 1
    info = result.summary.get("protocol_info") or {}
    steps_done = min(len(p.records) for p in result.peers)
    row = {"steps": steps, "steps_done": steps_done, **step_times(result, warmup_steps),
           "eval_loss": losses, "eval_loss_mean": statistics.fmean(losses) if finite else None,
           "eval_finite": finite, "peers_agree": agree,
           "eval_spread": (max(losses) - min(losses)) if finite else None,
           "train_loss": result.summary.get("train_loss"),
           "bytes_sent_per_peer": round(result.summary["bytes_sent_per_peer"]),
           "peer_status": sorted(set(result.summary["peer_status"].values())),
           "train_s": round(result.summary["wall_s"], 3), "run_s": round(seconds, 3)}
    if "rounds" in info:
        row.update(rounds=info["rounds"], missed_rounds=info.get("missed_rounds"))
    row["ok"] = finite and (agree or not one_model) and row["peer_status"] == ["finished"] and steps_done == steps
    return row


def simulate_rows(device: torch.device, plan: Plan,
                  cache: dict[tuple[str, str], SimResult]) -> Iterator[dict[str, Any]]:
    for precision in PRECISIONS:
        no_sync_step_s: float | None = None
        for run in swarm_runs(plan):
            what = {"run": run.label, "protocol": run.protocol, "precision": precision, "device": str(device)}

            def measure() -> dict[str, Any]:
                result, seconds = simulate(run, device, precision, plan)
                cache[run.label, precision] = result
                return describe_run(run, result, seconds, plan)

            row = guarded("simulate", what, measure)
            if run.label == "no-sync" and "step_s" in row:
                no_sync_step_s = row["step_s"]
            elif no_sync_step_s and "step_s" in row:
                row["step_over_no_sync"] = sig(row["step_s"] / no_sync_step_s)
            yield row


# ------------------------------------------------------------------ d. outer state on the host

def state_device_rows(device: torch.device, plan: Plan,
                      cache: dict[tuple[str, str], SimResult]) -> Iterator[dict[str, Any]]:
    run = swarm_runs(plan)[2]
    what = {"run": run.label, "precision": "float32", "device": str(device), "state_device": "cpu"}

    def measure() -> dict[str, Any]:
        on_device = cache.get((run.label, "float32")) or simulate(run, device, "float32", plan)[0]
        on_host, seconds = simulate(run, device, "float32", plan, state_device="cpu")
        row = describe_run(run, on_host, seconds, plan)
        row.update(compare_runs(on_host, on_device))
        row["ok"] = row["ok"] and row["matches"]
        if device.type != "cpu":  # the same swarm on the CPU, for reference: other kernels, so close, not equal
            on_cpu, _ = simulate(run, torch.device("cpu"), "float32", plan)
            cpu_losses = [p.eval_loss for p in on_cpu.peers]
            row["eval_loss_cpu_run"] = cpu_losses
            row["rel_diff_vs_cpu_run"] = rel_diff(row["eval_loss"], cpu_losses)
        return row

    yield guarded("state_device", what, measure)


def rel_diff(a: list[float | None], b: list[float | None]) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs or len(a) != len(b) or len(pairs) != len(a):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def compare_runs(result: SimResult, reference: SimResult) -> dict[str, Any]:
    """Whether two runs of one swarm trained alike: every peer's eval loss and step losses."""
    evals = rel_diff([p.eval_loss for p in result.peers], [p.eval_loss for p in reference.peers])
    steps = [rel_diff([r["loss"] for r in p.records], [r["loss"] for r in q.records])
             for p, q in zip(result.peers, reference.peers)]
    worst_step = None if any(s is None for s in steps) or not steps else max(steps)
    bit_identical = evals == 0.0 and worst_step == 0.0
    return {"eval_loss_reference": [p.eval_loss for p in reference.peers], "eval_rel_diff": evals,
            "step_loss_rel_diff": worst_step, "bit_identical": bit_identical,
            "matches": evals is not None and worst_step is not None and max(evals, worst_step) <= MATCH_RTOL}


# ------------------------------------------------------------------ e. a 124M GPT on real text

def stdlib_tree(recursive: bool) -> Iterator[str]:
    """Every UTF-8 `*.py` file of the running Python's stdlib, under it or at its top (the
    top-level files alone run out of merges before 50,257 ids)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py") if recursive else root.glob("*.py")):
        try:
            yield path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # the test suite holds files in other encodings on purpose


def train_bpe(vocab_size: int, folder: str, recursive: bool = True) -> tuple[str, float]:
    """A byte-level BPE of `vocab_size` ids trained by `tokenizers` on the stdlib tree, saved
    as folder/tokenizer.json; its path and the seconds training took."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    began = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(stdlib_tree(recursive), trainer)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer.save(path)
    return path, time.perf_counter() - began


def parameters_of(task: str, options: dict[str, Any]) -> int:
    return sum(p.numel() for p in get_task(task, **options).make_model().parameters())


def run_swarm(task: str, protocol: str, options: dict[str, Any], task_options: dict[str, Any], steps: int,
              device: torch.device, budget_s: float, **where: str) -> tuple[SimResult, float]:
    config = SimConfig(peers=4, protocol=protocol, task=task, steps=steps, options=options,
                       task_options=task_options, liveness=BENCH_LIVENESS, duration_s=budget_s,
                       device=str(device), **where)
    began = time.perf_counter()
    result = Simulation(config).run()
    return result, time.perf_counter() - began


def gpt_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="starling-gpu-gpt-") as folder:
        if plan.gpt_tokenizer:  # one trained before (the same BPE; saves the device's time)
            tokenizer, train_s = plan.gpt_tokenizer, 0.0
        else:
            tokenizer, train_s = train_bpe(plan.gpt_vocab, folder, recursive=plan.gpt_vocab > 1000)
        task_options = {**plan.gpt_options, "tokenizer": tokenizer, "cache_dir": folder}
        task = get_task("gpt", **task_options)
        began = time.perf_counter()
        tokens = len(task.store)  # type: ignore[attr-defined]  # tokenizes the corpus once, for both runs
        parameters = parameters_of("gpt", task_options)
        yield {"section": "gpt", "parameters": parameters, "vocab": task.tokenizer.vocab_size,  # type: ignore[attr-defined]
               "tokenizer_train_s": round(train_s, 1), "tokenize_s": round(time.perf_counter() - began, 1),
               "tokens": tokens, **{k: v for k, v in plan.gpt_options.items()},
               "tokens_per_run": 4 * plan.gpt_steps * plan.gpt_options["batch_size"] * plan.gpt_options["seq_len"]}
        runs = (("allreduce", "allreduce", {"optimizer": "adamw", "lr": plan.gpt_lr}),
                ("streaming-diloco", "streaming-diloco", {"lr": plan.gpt_lr, **plan.gpt_streaming}))
        measured: dict[str, dict[str, Any]] = {}
        for label, protocol, options in runs:
            what = {"run": label, "protocol": protocol, "precision": "autocast-bf16", "device": str(device)}

            def measure() -> dict[str, Any]:
                result, seconds = run_swarm("gpt", protocol, options, task_options, plan.gpt_steps, device,
                                            plan.gpt_budget_s, **PRECISIONS["autocast-bf16"])
                free_device_memory()
                return {**options, **describe(result, seconds, plan.gpt_steps, True, plan.warmup_steps)}

            row = guarded("gpt", what, measure)
            measured[label] = row
            yield row
        base, mine = measured["allreduce"], measured["streaming-diloco"]
        if base.get("ok") and mine.get("ok"):
            yield {"section": "gpt", "compare": "streaming-diloco/allreduce", "parameters": parameters,
                   "eval_loss_ratio": sig(mine["eval_loss_mean"] / base["eval_loss_mean"], 4),
                   "bytes_ratio": sig(base["bytes_sent_per_peer"] / max(1, mine["bytes_sent_per_peer"])),
                   "step_ratio": sig(mine["step_s"] / base["step_s"])}


# ------------------------------------------------------------------ f. sparse pseudo-gradients at 10M+

def sparse_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    task_options = dict(plan.sparse_options)
    parameters = parameters_of("charlm", task_options)
    steps, sync_every = plan.sparse_steps, plan.sparse_sync_every
    streaming = {"lr": plan.sparse_lr, "sync_every": sync_every, "fragments": plan.sparse_fragments,
                 "overlap_steps": 2, "alpha": 0.5, "outer_lr": 0.7, "outer_momentum": 0.9, "compressor": "int4"}
    runs = [run for run in (
        ("allreduce", "allreduce", {"optimizer": "adamw", "lr": plan.sparse_lr}),
        ("int4", "streaming-diloco", streaming),
        ("sparse", "streaming-diloco", {**streaming, **diloco.SPARSE_OUTER, "compressor": diloco.SPARSE_SPEC}),
    ) if run[0] in plan.sparse_runs]
    measured: dict[str, dict[str, Any]] = {label: {} for label in SPARSE_RUNS}
    for label, protocol, options in runs:
        what = {"run": label, "protocol": protocol, "parameters": parameters, "device": str(device)}

        def measure() -> dict[str, Any]:
            result, seconds = run_swarm("charlm", protocol, options, task_options, steps, device,
                                        plan.sparse_budget_s)
            free_device_memory()
            row = {**options, **describe(result, seconds, steps, True, plan.warmup_steps)}
            if protocol != "allreduce":
                bits = 8.0 * row["bytes_sent_per_peer"] / parameters
                row["bits_per_param_per_sync"] = sig(bits / (row["steps_done"] / sync_every))
            return row

        row = guarded("sparse", what, measure)
        measured[label] = row
        yield row
    base, int4, mine = measured["allreduce"], measured["int4"], measured["sparse"]
    if not mine.get("ok"):
        return
    compare: dict[str, Any] = {"section": "sparse", "compare": "sparse/" + "/".join(
        label for label in ("allreduce", "int4") if measured[label].get("ok")), "parameters": parameters,
        "steps": steps, "bits_per_param_per_sync": mine["bits_per_param_per_sync"],
        "bits_met": mine["bits_per_param_per_sync"] <= diloco.SPARSE_BITS_TARGET}
    if int4.get("ok"):
        gap_int4 = mine["eval_loss_mean"] / int4["eval_loss_mean"] - 1.0
        compare.update(loss_gap_int4=sig(gap_int4), int4_loss_met=gap_int4 <= diloco.SPARSE_INT4_LOSS_TARGET)
    if base.get("ok"):
        gap = mine["eval_loss_mean"] / base["eval_loss_mean"] - 1.0
        ratio = base["bytes_sent_per_peer"] / max(1, mine["bytes_sent_per_peer"])
        compare.update(loss_gap_allreduce=sig(gap), bytes_ratio_allreduce=sig(ratio),
                       loss_met=gap <= diloco.LOSS_TARGET, bytes_met=ratio >= diloco.SPARSE_BYTES_TARGET)
    yield compare


def shard_rows(device: torch.device, plan: Plan) -> Iterator[dict[str, Any]]:
    """FSDP2 on the device through `--shard-sync`'s path (NCCL on CUDA, gloo on the CPU), one
    rank: the DTensor chunks, the view that aliases them, the per-step agreement, a collective
    evaluation. Starling's step (`Trainer.agree` + `Trainer.step` of diloco with no outer step in
    the run) against a plain FSDP2 step on a copy of the model, alternating; medians."""
    import tempfile

    from torch.distributed.fsdp import fully_shard

    from starling.node import Node
    from starling.protocols.optim import make_optimizer
    from starling.runtime import Trainer, TrainSpec
    from starling.runtime.placement import Placement
    from starling.runtime.replica import ReplicaGroup
    from starling.runtime.shard_sync import ShardSync, shard_units

    backend = "nccl" if device.type == "cuda" else "gloo"
    group = ReplicaGroup(0, 1, f"file://{tempfile.mkdtemp(prefix='starling-gpu-')}/rendezvous", 120.0, backend,
                         device.index or 0)
    group.init()
    node = Node().start("tcp://127.0.0.1:0", [], security="plaintext")
    try:
        options = dict(plan.shard_options)
        steps = plan.shard_steps
        trainer = Trainer(node, TrainSpec("diloco", "charlm", {"sync_every": 10 * steps}, options), 0, 1,
                          serve_state=False, placement=Placement(device=device), replication=ShardSync(group))
        trainer.create_protocol()
        task = trainer.task
        plain = task.make_model().to(device)
        for unit in shard_units(plain):
            fully_shard(unit, mesh=trainer.replication.sharded.mesh)  # type: ignore[union-attr]
        fully_shard(plain, mesh=trainer.replication.sharded.mesh)  # type: ignore[union-attr]
        optimizer = make_optimizer(list(plain.parameters()), "adamw", 1e-3, 0.0, 0.0)
        placement, mine = Placement(device=device), trainer.batches()
        batches = (placement.batch(b, plain) for b in task.batches(1, 2, 0))

        def starling_step() -> None:
            trainer.agree(True)
            trainer.step(next(mine))

        times = alternate(("fsdp2", plain_step(task, plain, optimizer, batches, set_to_none=True)),
                          ("starling", starling_step), steps, plan.warmup_steps,
                          lambda: synchronize(device))
        loss = trainer.evaluate()["eval_loss"]
        fsdp2, starling = statistics.median(times["fsdp2"]), statistics.median(times["starling"])
        yield {"section": "shards", "ok": math.isfinite(loss), "device": str(device), "backend": backend,
               "ranks": 1, **options, "parameters": parameters_of("charlm", options), "steps": steps,
               "fsdp2_step_ms": sig(fsdp2 * 1e3), "starling_step_ms": sig(starling * 1e3),
               "step_over_fsdp2": sig(starling / fsdp2), "target": 1.10, "met": starling / fsdp2 <= 1.10,
               "eval_loss": sig(loss)}
    finally:
        node.close()
        group.close()


# ------------------------------------------------------------------ the run

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and a few steps (tests, smoke runs)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--elements", type=int, help="values in the codecs' tensor (default 64M; quick 64K)")
    parser.add_argument("--check-elements", type=int, help="values the CPU reference encodes (default 4M)")
    parser.add_argument("--steps", type=int, help="steps of every simulated swarm (default 40; quick 3)")
    parser.add_argument("--codec-budget-s", type=float, help="seconds the codecs may take before the rest are skipped")
    parser.add_argument("--gpt-steps", type=int, help="steps of each gpt run (default 96; quick 4)")
    parser.add_argument("--gpt-tokenizer", help="gpt: this tokenizer.json instead of a BPE trained on the stdlib "
                        "tree (write one with --write-tokenizer)")
    parser.add_argument("--write-tokenizer", metavar="FOLDER",
                        help="train the gpt section's BPE into FOLDER/tokenizer.json, print its path and exit")
    parser.add_argument("--sparse-steps", type=int, help="steps of each sparse run (default 2000; quick 8)")
    parser.add_argument("--sparse-runs", default=",".join(SPARSE_RUNS),
                        help=f"comma-separated runs of the sparse section, of {', '.join(SPARSE_RUNS)}")
    parser.add_argument("--sparse-budget-s", type=float, help="seconds each sparse run may take (default 150)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    args.sparse_runs = tuple(r.strip() for r in args.sparse_runs.split(",") if r.strip())
    if not args.sparse_runs or any(r not in SPARSE_RUNS for r in args.sparse_runs):
        parser.error(f"--sparse-runs takes some of {', '.join(SPARSE_RUNS)}, got {','.join(args.sparse_runs)!r}")
    if args.sparse_budget_s is not None and not args.sparse_budget_s > 0:
        parser.error("--sparse-budget-s must be > 0")
    for name in ("elements", "check_elements", "steps", "gpt_steps", "sparse_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    plan = Plan.quick() if args.quick else Plan()
    given = {name: getattr(args, name) for name in ("elements", "check_elements", "steps", "codec_budget_s",
                                                    "gpt_steps", "sparse_steps", "gpt_tokenizer", "sparse_runs",
                                                    "sparse_budget_s")
             if getattr(args, name) is not None}
    plan = replace(plan, **given)
    return replace(plan, check_elements=min(plan.check_elements, plan.elements),
                   warmup_steps=min(plan.warmup_steps, plan.steps // 2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_of(args)
    if args.write_tokenizer:
        os.makedirs(args.write_tokenizer, exist_ok=True)
        print(json.dumps(dict(zip(("tokenizer", "seconds"), train_bpe(plan.gpt_vocab, args.write_tokenizer)))))
        return 0
    began = time.perf_counter()
    cache: dict[tuple[str, str], SimResult] = {}
    sections: dict[str, Callable[[torch.device, Plan], Iterator[dict[str, Any]]]] = {
        "device": device_rows, "codecs": codec_rows, "staging": staging_rows,
        "simulate": lambda d, p: simulate_rows(d, p, cache),
        "state_device": lambda d, p: state_device_rows(d, p, cache),
        "gpt": gpt_rows, "sparse": sparse_rows, "shards": shard_rows}
    failed: list[str] = []
    for name in args.sections:
        section_began = time.perf_counter()
        try:
            device = torch.device(args.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"device {args.device!r}: no CUDA device here (torch {torch.__version__})")
            for row in sections[name](device, plan):
                emit(row, failed)
        except Exception as exc:
            free_device_memory()
            emit(error_row(name, exc), failed)
        emit({"section": name, "seconds": round(time.perf_counter() - section_began, 1)}, failed)
    emit({"summary": True, "device": args.device, "quick": args.quick, "sections": args.sections,
          "failed": failed, "seconds": round(time.perf_counter() - began, 1)}, failed)
    return 1 if failed else 0


def emit(row: dict[str, Any], failed: list[str]) -> None:
    """Print the row; remember what it names if it holds an error or a failed check."""
    if "error" in row or row.get("ok") is False:
        failed.append("/".join(str(row[k]) for k in ("section", "run", "codec", "precision", "dtype") if k in row))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
