"""What a simulated swarm runs: its configuration, checked before any node starts, and the
small helpers every simulated peer uses (endpoints, seeded keys, bounded waits)."""
from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from starling.common import option_name
from starling.node.identity import Identity
from starling.node.swim import Liveness
from starling.node.transport import dealer_ceiling
from starling.protocols.base import MAX_OWNERS, ProtocolError
from starling.runtime.churn import ChurnEvent, check_churn
from starling.runtime.links import LinkModel
from starling.runtime.placement import Placement
from starling.runtime.trainer import (
    RUN_LENGTH_OPTION,
    plans_run_length,
    protocol_config,
    resolve_protocol,
    with_run_length,
)
from starling.tasks import get_task

TRANSPORTS = ("inproc", "ipc", "tcp")
# What a simulated run trains when it names nothing else: `SimConfig()` is the run `starling
# simulate` makes with no options, from Python and from the command line alike. Streaming DiLoCo,
# compared with an all-reduce baseline on the same tokens, in about a minute on 2 cores.
DEFAULT_SIM_PROTOCOL = "streaming-diloco"
DEFAULT_SIM_TASK = "charlm"
DEFAULT_SIM_STEPS = 200
# A run with a duration and no steps trains until the time is up: this only bounds its loop.
UNCAPPED_STEPS = 10**9
# ... with a sync every 40 steps: 5 outer rounds in 200 steps (the protocol's own default,
# H = 100, is for runs of thousands of steps). For the default protocol, unless the run names
# the option.
DEFAULT_SIM_OPTIONS: Mapping[str, Any] = {"sync_every": 40}
# AdamW learning rates tuned per task (benchmarks/diloco.py's sweep for charlm: 3e-3 for
# allreduce and for DiLoCo's inner loop). A run with AdamW that names no lr uses it, and its
# baseline trains with the run's optimizer and lr: the comparison is the fair one.
TUNED_ADAMW_LR: Mapping[str, float] = {"charlm": 3e-3}
# Quick enough that a crashed peer is noticed within a short run, slow enough for a loaded box.
# A probe's answer may take a second on a box that runs many peers (its loop is busy with all of
# them), and a suspicion 5 s at least: a loaded box stalls a process for seconds.
# Sockets of a simulated node's cap kept from a round's owners, for membership probes and the
# requests that go on during a round (a sampled peer's polls, a joiner's state).
SOCKETS_SPARED = 3
SIM_LIVENESS = Liveness(probe_interval_s=0.5, ack_timeout_s=1.0, suspicion_base_s=5.0)
# Each peer probes one other per period and its updates ride on probes and answers, so a
# peer's membership work per period is constant (node/swim.py) and a box of n simulated peers
# handles about 4n messages a period on its network threads. A simulator sized to the swarm keeps
# that near this many probes a second by lengthening the period (and the suspicion timeouts
# with it): 1024 peers probe every 8 s, 4096 every 32 s. (A probe costs a simulated box about
# 1-2 ms of CPU, both ends together, most of it opening a socket to a peer past the socket cap;
# its answer, indirect probes and gossip come on top. At 512 a second, 1024 peers forming a swarm
# on 2 cores kept their workers' loops seconds behind, and the false suspicions that followed
# held the swarm short of formed for 10 minutes. At 256, a formed swarm of 1024 kept both cores
# busy (1.96), and its nodes took 139 s to start; at 128, 1.38 cores and 33 s, with joins and
# deaths spread by bursts of gossip (node/dissemination.py), not by the period.)
SIM_PROBES_PER_S = 128
# Table pulls while a swarm forms: a member's next pull comes soon after one that brought news,
# at most this many a second on the box (`Liveness.forming_pull_s`, never past the probe period).
# Unlike a probe, a pull carries what the member has to learn anyway: 1024 nodes pulling once a
# period (8 s) took 64-88 s to form, each pull a round of an epidemic that needs about ten.
SIM_PULLS_PER_S = 1024
# Peers a simulated node counts bytes for apart (`NodeConfig.stats_peers`): a simulation
# reports totals by topic, and a node's per-peer counters cost about 0.4 MB once it has sent to
# and heard from 1024 peers: 0.9 GB for a box of 2048.
SIM_STATS_PEERS = 0
# A round of a sharded reducer (allreduce, DiLoCo's outer sync, sketch-dp) sends each member's
# parts to every owner of a shard: members x owners requests and as many answers, a few ms of
# CPU each on a simulated box. A simulator sized to the swarm keeps a round near this many parts
# by giving it fewer owners (but at least SIM_MIN_OWNERS): 256 peers all-reducing a 1000-value
# model on 2 cores took 158 s for 5 steps with 48 owners a round and 44 s with 8.
SIM_PARTS_PER_ROUND = 2048
SIM_MIN_OWNERS = 4


def sim_liveness(peers_in_process: int, swarm: int) -> Liveness:
    """SIM_LIVENESS, with a longer probe period once the swarm's peers on this box would probe
    more than SIM_PROBES_PER_S times a second (a crash still goes to suspicion within a few
    periods, and a dropped connection is seen at once whatever the period)."""
    base = SIM_LIVENESS
    interval = swarm / SIM_PROBES_PER_S
    # urgent gossip at most every 0.2 s and about once a period, so the box's gossip stays within
    # its probes' budget too: a thousand peers cannot send 15,000 messages a second while a burst
    # of joins keeps the urgent queues full
    gossip = max(base.gossip_interval_s, interval)
    if interval <= base.probe_interval_s:
        return replace(base, gossip_interval_s=gossip)
    # A peer's own new meta (its progress) is news that its source gossips at once, so it comes
    # at most once every so many periods, as SIM_LIVENESS's does: at 2 s whatever the period, 512
    # peers' progress keeps every peer gossiping every period and saturates the box's loops.
    return replace(base, probe_interval_s=interval, ack_timeout_s=max(base.ack_timeout_s, interval / 2),
                   forming_pull_s=min(interval, max(1.0, swarm / SIM_PULLS_PER_S)),
                   suspicion_base_s=max(base.suspicion_base_s, 3 * interval), probe_timeout_s=max(1.0, interval),
                   gossip_interval_s=gossip,
                   meta_interval_s=base.meta_interval_s * interval / base.probe_interval_s)


class SimError(Exception):
    """The simulation could not run or a peer failed."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated run: its swarm, what it trains, its links and churn, and where it runs.

    Checked on construction (a bad field raises ValueError naming it); `check_config` also
    resolves the protocol, its options and the task. `baseline()` gives the run to compare
    it with. The defaults are the simulator's, filled in on construction: `SimConfig()` is
    the run `starling simulate` makes with no options (4 peers of streaming-diloco syncing
    every 40 steps, 200 steps of charlm, AdamW at its tuned lr).

        run = SimConfig(peers=8, steps=100)
        result, base = Simulation(run).run(), Simulation(run.baseline()).run()
    """

    peers: int = 4
    protocol: str = DEFAULT_SIM_PROTOCOL  # a registered name, or "module:name" to import a plugin first
    task: str = DEFAULT_SIM_TASK
    # None: DEFAULT_SIM_STEPS, or with duration_s, UNCAPPED_STEPS (peers train until the time is up)
    steps: int | None = None
    compressor: str | None = None  # passed to the protocol as its `compressor` option
    transport: str | None = None  # None: inproc, or tcp with processes or ray
    # 0: every peer is a thread of this process; P >= 1: the peers are dealt round-robin to P
    # worker processes (needs tcp or ipc). True means one process per peer.
    processes: int = 0
    # A Ray cluster to run the worker processes on as Ray actors, spread over its nodes (see
    # runtime/sim_ray.py): an address ("HOST:PORT"), "auto" (the cluster `ray start` made on this
    # machine, or RAY_ADDRESS) or "local" (a new one on this machine). Needs tcp; processes 0
    # then means one worker per node of the cluster.
    ray: str | None = None
    link: LinkModel = field(default_factory=LinkModel)
    churn: tuple[ChurnEvent, ...] = ()
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)  # protocol hyper-parameters
    task_options: Mapping[str, Any] = field(default_factory=dict)
    eval_every: int = 0  # peer 0 evaluates every this many steps (0: only at the end)
    liveness: Liveness | None = None  # None: sim_liveness(), sized to the swarm (see sized_for_swarm)
    # For the swarm to form (with processes: the longest a start-up stage may go without news,
    # so a big swarm that keeps forming is not cut off), and for a joiner to fetch state.
    ready_timeout_s: float = 60.0
    # A send to a crashed peer holds that peer's socket (and, behind it, this node's heartbeats)
    # until it times out; keep that below the suspect timeout so one crash does not look like two.
    send_timeout_s: float = 1.0
    join_timeout_s: float = 5.0  # a joiner greets every peer it learns of, even one that just crashed
    # A peer's join tries again with backoff (and through members a busy seed names) until this
    # has passed: on a loaded box one hello left unanswered for join_timeout_s ended whole runs.
    join_deadline_s: float = 120.0
    # Checkpoints: every peer writes its own under checkpoint_dir/peer-RANK every checkpoint_every
    # steps; with `resume` every peer first loads its newest (the swarm restarts where it stopped).
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = False
    # Where every peer trains (see runtime/placement.py): None keeps the model as the task builds it.
    device: str | None = None
    dtype: str | None = None
    autocast: str | None = None
    state_device: str | None = None
    # Open DEALERs per simulated node (see runtime/capacity.py): None picks the largest cap up
    # to a real node's 64 that fits the process's descriptors; a run that cannot fit is refused.
    max_dealers: int | None = None
    # Emulated heterogeneity: one relative compute speed per initial peer (joiners run
    # at the fastest). A peer of speed v sleeps (max speed / v - 1) times each step's measured
    # compute time on its training thread, so "1,1,1,0.33" makes the last peer about 3x slower.
    peer_speed: tuple[float, ...] = ()
    # A wall-clock budget: every peer stops training this many seconds after the start (steps
    # stay an upper bound), leaves the swarm, and evaluates. 0: run the steps.
    duration_s: float = 0.0
    # Ranks per replica: above 1, every peer is a replica of this many gloo ranks in
    # their own processes (runtime/replica_sim.py), its rank 0 the swarm's peer.
    nproc_per_replica: int = 1
    replica_timeout_s: float = 60.0  # the replica's torch.distributed timeout
    # With replicas of many ranks: every rank trains under FSDP2 and syncs its own shard with the
    # same rank of the other replicas (runtime/shard_sync.py); False: rank 0 syncs the whole model.
    shard_sync: bool = False

    def __post_init__(self) -> None:
        if self.transport is None:
            object.__setattr__(self, "transport", "tcp" if self.processes or self.ray is not None else "inproc")
        if self.steps is None:
            object.__setattr__(self, "steps", self._default_steps())
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if isinstance(self.processes, bool):  # bool is an int: check it first
            object.__setattr__(self, "processes", self.peers if self.processes else 0)
        if not isinstance(self.processes, int) or not 0 <= self.processes <= self.peers:
            raise ValueError(f"processes must be a whole number from 0 (threads in this process) to peers "
                             f"({self.peers}), got {self.processes!r}")
        if self.processes and self.transport == "inproc":
            raise ValueError("processes need the tcp or ipc transport (inproc works within one process)")
        if self.ray is not None:
            if not isinstance(self.ray, str) or not self.ray.strip():
                raise ValueError(f"ray must be a Ray cluster's address, 'auto' or 'local', got {self.ray!r}")
            if self.transport != "tcp":
                raise ValueError(f"ray workers reach each other across machines over tcp; transport "
                                 f"{self.transport!r} stays on one machine (use tcp)")
        if self.max_dealers is not None and self.max_dealers < 1:
            raise ValueError(f"max_dealers must be >= 1, got {self.max_dealers}")
        if self.peer_speed:
            object.__setattr__(self, "peer_speed", tuple(float(v) for v in self.peer_speed))
            if len(self.peer_speed) != self.peers:
                raise ValueError(f"peer speeds name {len(self.peer_speed)} peers, but there are {self.peers} "
                                 "(give one speed per peer, e.g. 1,1,1,0.33)")
            bad = [v for v in self.peer_speed if not (0.0 < v < float("inf"))]
            if bad:
                raise ValueError(f"peer speeds must be finite numbers > 0, got {bad[0]:g}")
        if not 0.0 <= self.duration_s < float("inf"):
            raise ValueError(f"duration_s must be a finite number >= 0 (0: run the steps), got {self.duration_s}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        check_churn(self.churn, self.peers, self.steps)
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir to resume from")
        if self.checkpoint_dir and (self.processes or self.ray is not None):
            raise ValueError("checkpoints are written by in-process peers only (drop --processes and --ray)")
        if self.nproc_per_replica < 1:
            raise ValueError(f"nproc_per_replica must be >= 1, got {self.nproc_per_replica}")
        if self.nproc_per_replica > 1:
            refused = [name for name, given in (("processes", self.processes), ("ray", self.ray),
                                                ("checkpoint_dir", self.checkpoint_dir),
                                                ("peer_speed", self.peer_speed)) if given]
            if refused:
                raise ValueError(f"replicas of many ranks run in their own processes; drop {', '.join(refused)}")
            if self.transport == "ipc":
                raise ValueError("replicas of many ranks reach each other over tcp on loopback (drop --transport ipc)")
            object.__setattr__(self, "transport", "tcp")  # the default inproc cannot cross their processes
        elif self.shard_sync:
            raise ValueError("shard_sync splits a replica's model over its ranks: "
                             "give it --nproc-per-replica 2 or more")
        self.placement()  # raises DeviceError (a ValueError) for a device or dtype this machine lacks
        defaults = self._default_options()
        if defaults:
            object.__setattr__(self, "options", {**self.options, **defaults})

    def _default_steps(self) -> int:
        """DEFAULT_SIM_STEPS, or with a duration as many as fit in it. A protocol that plans over
        the run's length (sketch-dp's privacy budget) needs the length said."""
        if not self.duration_s:
            return DEFAULT_SIM_STEPS
        try:
            plans = plans_run_length(self.protocol)
        except ProtocolError:  # an unknown protocol: check_config names it
            plans = False
        if plans and not any(option_name(name) == RUN_LENGTH_OPTION for name in self.options):
            raise ValueError(f"--duration with --protocol {self.protocol} needs --steps (or --opt "
                             f"{RUN_LENGTH_OPTION}=N): it plans over the run's length")
        return UNCAPPED_STEPS

    def _default_options(self) -> dict[str, Any]:
        """The simulator's options this run does not name: DEFAULT_SIM_OPTIONS for the default
        protocol, and the task's tuned lr for a run that trains with AdamW and names no lr."""
        named = {option_name(name) for name in self.options}
        added: dict[str, Any] = {}
        if self.protocol == DEFAULT_SIM_PROTOCOL:
            added.update({name: value for name, value in DEFAULT_SIM_OPTIONS.items() if name not in named})
        if "lr" not in named and self.task in TUNED_ADAMW_LR:
            try:
                optimizer = _optimizer_of(protocol_config(self.protocol, {**self.protocol_options(), **added}))
            except ProtocolError:  # a bad protocol or option: check_config names it
                optimizer = None
            if optimizer == "adamw":
                added["lr"] = TUNED_ADAMW_LR[self.task]
        return added

    def slowdown(self, rank: int) -> float:
        """How many times slower than the fastest peer `rank` computes (1: full speed)."""
        if not self.peer_speed or rank >= len(self.peer_speed):
            return 1.0
        return max(self.peer_speed) / self.peer_speed[rank]

    def placement(self) -> Placement:
        return Placement.parse(self.device, self.dtype, self.autocast, self.state_device)

    def peers_per_process(self) -> int:
        """The most peers one process holds: all of them, or their share of P workers (joiners
        go to the least loaded one)."""
        return -(-self.world // self.processes) if self.processes else self.world

    def sized_for_swarm(self) -> SimConfig:
        """This config with what depends on the swarm's size filled in: the liveness (unless
        given) and a ready timeout that leaves the swarm time to form (ten intervals, and
        0.1 s a peer for the joins)."""
        liveness = self.liveness or sim_liveness(self.peers_per_process(), self.world)
        ready = max(self.ready_timeout_s, 10 * liveness.probe_interval_s + 0.1 * self.world)
        return replace(self, liveness=liveness, ready_timeout_s=ready)

    def probe_period_scaled(self) -> bool:
        """Whether this (sized) config's probe period is the simulator's, stretched past
        SIM_LIVENESS's so that the box probes about SIM_PROBES_PER_S times a second."""
        return (self.liveness is not None and self.liveness.probe_interval_s > SIM_LIVENESS.probe_interval_s
                and self.liveness == sim_liveness(self.peers_per_process(), self.world))

    @property
    def world(self) -> int:
        """Every peer that will ever run (initial peers plus joiners)."""
        return self.peers + sum(e.count for e in self.churn if e.kind == "join")

    def protocol_options(self) -> dict[str, Any]:
        """The options every peer's protocol is built from: `options`, the run's length for a
        protocol that plans over it, and `compressor`."""
        options = with_run_length(self.protocol, self.options, self.steps)
        if self.compressor is not None:
            options["compressor"] = self.compressor
        if self.max_dealers is not None and not any(option_name(k) == "max_owners" for k in options):
            # a round's parts each hold a socket until their owner's group closes: no more owners
            # than the sockets every simulated node may hold, less room for membership traffic;
            # and no more than keep a round's parts near what the box carries (SIM_PARTS_PER_ROUND)
            if "max_owners" in {f.name for f in fields(resolve_protocol(self.protocol).config_class)}:
                carried = max(SIM_MIN_OWNERS, SIM_PARTS_PER_ROUND // max(1, self.world))
                options["max_owners"] = max(1, min(MAX_OWNERS, dealer_ceiling(self.max_dealers) - SOCKETS_SPARED,
                                                   carried))
        return options

    def protocol_config(self) -> Any:
        """The protocol's config dataclass as every peer of this run builds it (defaults
        filled in, text read as its field's type); ProtocolError names a bad option."""
        return protocol_config(self.protocol, self.protocol_options())

    def optimizer(self) -> str | None:
        """The optimizer the peers train with (DiLoCo's inner one), or None for a protocol
        that names none."""
        return _optimizer_of(self.protocol_config())

    def baseline(self, protocol: str = "allreduce") -> SimConfig:
        """The run to compare this one with: `protocol` on the same swarm, task, steps, links,
        churn, seed and placement, so that only the protocol differs.

        The baseline keeps the options it knows (lr, timeouts), not this run's compressor, and
        trains with this run's optimizer (DiLoCo's inner one) and lr, defaults included: the
        fair comparison. A baseline that cannot take its inner steps alone (allreduce) runs
        single-process peers where this run has replicas of many ranks; its checkpoints go to a
        ``baseline`` folder beside this run's. Raises ProtocolError for an unknown protocol or
        a bad option of this run.
        """
        cls = resolve_protocol(protocol)
        known = {f.name for f in fields(cls.config_class)} - {"compressor"}
        options = {option_name(k): v for k, v in self.options.items() if option_name(k) in known}
        run = self.protocol_config()
        optimizer = _optimizer_of(run)
        if "optimizer" in known and optimizer is not None:
            options.setdefault("optimizer", optimizer)
        if "lr" in known and getattr(run, "lr", None) is not None:
            options.setdefault("lr", run.lr)
        replicas = self.nproc_per_replica if getattr(cls, "local_inner_steps", False) else 1
        checkpoints = str(Path(self.checkpoint_dir) / "baseline") if self.checkpoint_dir else None
        return replace(self, protocol=protocol, compressor=None, options=options, nproc_per_replica=replicas,
                       shard_sync=self.shard_sync and replicas > 1, checkpoint_dir=checkpoints)

    def stop_at(self, rank: int) -> tuple[str, int] | None:
        """("kill" | "leave", step) if the churn spec stops peer `rank`."""
        for event in self.churn:
            if event.rank == rank and event.kind in ("kill", "leave"):
                return event.kind, event.step
        return None

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "peers": self.peers, "steps": self.steps, "task": self.task,
                "compressor": self.compressor, "transport": self.transport, "processes": self.processes,
                **({"ray": self.ray} if self.ray is not None else {}),
                "link": self.link.describe(), "churn": ",".join(map(str, self.churn)), "seed": self.seed,
                "options": {k: v for k, v in self.options.items()}, "task_options": dict(self.task_options),
                "max_dealers": self.max_dealers,
                **({"peer_speed": list(self.peer_speed)} if self.peer_speed else {}),
                **({"duration_s": self.duration_s} if self.duration_s else {}),
                **({"nproc_per_replica": self.nproc_per_replica} if self.nproc_per_replica > 1 else {}),
                **({"shard_sync": True} if self.shard_sync else {}),
                "probe_interval_s": None if self.liveness is None else round(self.liveness.probe_interval_s, 3),
                **({"probe_interval_scaled_from_s": SIM_LIVENESS.probe_interval_s}
                   if self.probe_period_scaled() else {}),
                **({"checkpoint_dir": self.checkpoint_dir, "resume": self.resume} if self.checkpoint_dir else {}),
                **({"placement": self.placement().describe()} if self.placement() != Placement() else {})}


def _optimizer_of(protocol_config: Any) -> str | None:
    return getattr(protocol_config, "inner_optimizer", None) or getattr(protocol_config, "optimizer", None)


def check_config(config: SimConfig) -> None:
    """Resolve the protocol, its options and the task now, so bad input fails before any node starts."""
    if config.ray is not None and importlib.util.find_spec("ray") is None:
        raise SimError("ray is not installed: pip install 'starling[ray]' (here and on every node of the cluster)")
    cls = resolve_protocol(config.protocol)
    config.protocol_config()
    task = get_task(config.task, **config.task_options)
    shards = config.world * config.nproc_per_replica  # every rank of every replica has its own
    task.batches(shards - 1, shards, config.seed)  # checks the shard size for this world
    if config.nproc_per_replica > 1 and not getattr(cls, "local_inner_steps", False):
        raise SimError(f"protocol {config.protocol!r} does not take its inner steps alone, so a replica of many "
                       "ranks cannot run it; use diloco or streaming-diloco")



def endpoint_for(transport: str, rank: int, ipc_dir: str, run_id: str, host: str = "127.0.0.1") -> str:
    """Where simulated peer `rank` listens; over tcp, a free port on `host` (this machine's
    loopback, or the address other machines reach a Ray node on)."""
    if transport == "tcp":
        return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    if transport == "ipc":
        return f"ipc://{ipc_dir}/{rank}.sock"
    return f"inproc://starling-sim-{run_id}-{rank}"


def seeded_identity(seed: int, rank: int) -> Identity:
    """Rank `rank`'s keys in a simulation seeded `seed`: the same in every run (never for a
    real swarm, see `Identity.from_seed`)."""
    return Identity.from_seed(f"starling.sim:{seed}:{rank}")


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SimError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)

