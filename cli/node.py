"""`starling node start` and `starling node status`: run one peer of a swarm, or ask one."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, List, Optional

import typer

from starling.cli.shared import (
    EXPECTED_ERRORS,
    autocast_option,
    check_seconds,
    data_option,
    device_option,
    dtype_option,
    fail,
    json_text,
    prepare_units,
    protocol_options,
    seq_len_option,
    setup_logging,
    state_device_option,
    tokenizer_option,
    with_data,
)
from starling.common import parse_options
from starling.data.sources import DataError
from starling.node.identity import Identity
from starling.node.swim import Liveness
from starling.node.transport import TransportConfig
from starling.node.wire import RejectReason

log = logging.getLogger(__name__)


def node_start(
    ctx: typer.Context,
    listen: List[str] = typer.Option(
        ["tcp://127.0.0.1:0"], "--listen", help="Endpoint to bind (repeatable); port 0 picks a free one."),
    advertise: Optional[List[str]] = typer.Option(
        None, "--advertise", help="Address peers should dial instead of the bound one (NAT, port forwarding)."),
    join: Optional[List[str]] = typer.Option(
        None, "--join", help="Join address of a swarm member, tcp://HOST:PORT#KEY (repeatable: tried in turn; HOST "
                             "may be a DNS name or an [IPv6] literal)."),
    join_deadline_s: float = typer.Option(
        120.0, "--join-deadline-s",
        help="Keep trying the --join addresses (and the members a busy one names), in rounds with backoff, "
             "until this has passed."),
    no_listen: bool = typer.Option(
        False, "--no-listen", help="Client mode: bind nothing; peers reach this node over the connections it opens "
                                   "(automatic when the peer it joins through cannot dial it back)."),
    relay: bool = typer.Option(
        True, "--relay/--no-relay", help="Once reachable, forward sealed messages between clients behind NAT."),
    key: Optional[Path] = typer.Option(None, "--key", help="Identity key file (default: a fresh throwaway identity)."),
    authorized_keys: Optional[Path] = typer.Option(
        None, "--authorized-keys", help="Allowlist of peer keys; others cannot connect."),
    plaintext: bool = typer.Option(False, "--plaintext", help="No encryption (simulations on one box only)."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow --plaintext on non-loopback addresses."),
    probe_interval_s: float = typer.Option(
        1.0, "--probe-interval-s", "--heartbeat-s",
        help="Failure detection (SWIM): probe one member this often."),
    ack_timeout_s: float = typer.Option(
        0.5, "--ack-timeout-s", "--suspect-after-s",
        help="A probe unanswered this long is tried through --indirect-probes other members; unanswered there "
             "too, the member is suspect."),
    suspicion_s: float = typer.Option(
        3.0, "--suspicion-s", "--dead-after-s",
        help="A suspect member that does not refute is dead after at least this long (longer in a large swarm, "
             "shorter as more members confirm it)."),
    probe_timeout_s: float = typer.Option(
        1.0, "--probe-timeout-s",
        help="A peer whose connection drops is probed; silent this long after, it is dead."),
    watch_connections: bool = typer.Option(
        True, "--watch-connections/--no-watch-connections",
        help="Notice a crashed peer from its dropped connection (in about --probe-timeout-s) instead of only "
             "from unanswered probes (--suspicion-s)."),
    indirect_probes: int = typer.Option(
        3, "--indirect-probes", "--heartbeat-fanout", min=0,
        help="Members asked to probe a member that did not answer this node."),
    protocol: Optional[str] = typer.Option(
        None, "--protocol", help="Train with this protocol (a joiner may omit it: it learns it from the swarm)."),
    task: Optional[str] = typer.Option(
        None, "--task", help="Built-in task or module:callable (default charlm; a joiner learns it)."),
    steps: Optional[int] = typer.Option(
        None, "--steps", help="Stop training at this swarm step (default: run until stopped)."),
    compressor: Optional[str] = typer.Option(None, "--compressor", help="Compressor spec (a protocol option)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (a protocol option)."),
    opt: Optional[List[str]] = typer.Option(None, "--opt", help="Protocol option NAME=VALUE (repeatable)."),
    task_opt: Optional[List[str]] = typer.Option(None, "--task-opt", help="Task option NAME=VALUE (repeatable)."),
    data: Optional[str] = data_option(),
    tokenizer: Optional[str] = tokenizer_option(),
    data_scope: str = typer.Option(
        "swarm", "--data-scope", metavar="swarm|local",
        help="swarm: the swarm trains one corpus, the first node's --data, handed out in units by its ledger. "
             "local: every member trains its own --data (private to it: the swarm's config names none) in epochs "
             "of its own, weighed by what it trained; the members must agree on the task, --seq-len and the "
             "tokenizer (compared by content). Give it on every member."),
    seq_len: Optional[int] = seq_len_option(),
    seed: int = typer.Option(0, "--seed", help="Swarm seed (data order, shared randomness)."),
    shard: Optional[str] = typer.Option(
        None, "--shard", help="This peer's data shard RANK/WORLD (default: picked from the peer id out of 16)."),
    log_every: int = typer.Option(10, "--log-every", help="Print a JSON progress line every N steps."),
    log_digest: bool = typer.Option(
        False, "--log-digest",
        help="Each progress line carries 'synced': a digest of the state every member holds alike (allreduce's "
             "parameters, DiLoCo's outer parameters), and with units of data 'ledger', the data ledger's digest, to "
             "check from outside that the members agree. Hashes the model once a line."),
    min_peers: int = typer.Option(
        1, "--min-peers", min=1,
        help="Train only once this many peers (self included) are up: a swarm whose peers start together "
             "then trains together from its first node's state."),
    min_peers_timeout_s: float = typer.Option(
        300.0, "--min-peers-timeout-s", help="With --min-peers: how long to wait for them."),
    checkpoint_dir: Optional[Path] = typer.Option(
        None, "--checkpoint-dir", help="Write checkpoints of the training state here (default: the --resume dir)."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1, help="Steps between checkpoints."),
    checkpoint_keep: int = typer.Option(3, "--checkpoint-keep", min=1, help="How many checkpoints stay on disk."),
    resume: Optional[Path] = typer.Option(
        None, "--resume",
        help="Restart from the newest checkpoint in this dir (and keep checkpointing there); "
             "the swarm's protocol and task come from it."),
    resume_quorum: int = typer.Option(
        1, "--resume-quorum", min=1,
        help="With --resume: wait for this many peers (self included) and continue from the newest "
             "step that many hold."),
    resume_timeout_s: float = typer.Option(
        300.0, "--resume-timeout-s", help="With --resume: how long to wait for that quorum."),
    state_fetch_timeout_s: float = typer.Option(
        120.0, "--state-fetch-timeout-s",
        help="A joiner's patience for the swarm's state: a busy or failing peer sends it to the others, then "
             "it tries them all again with backoff until this has passed."),
    device: Optional[str] = device_option("this peer's"),
    dtype: Optional[str] = dtype_option(),
    autocast: Optional[str] = autocast_option(),
    state_device: Optional[str] = state_device_option(),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", min=0, max=65535,
        help="Serve Prometheus metrics on this port (0: pick a free one and print it)."),
    metrics_host: str = typer.Option(
        "127.0.0.1", "--metrics-host", help="With --metrics-port: the address to serve on."),
    tensorboard: Optional[Path] = typer.Option(
        None, "--tensorboard",
        help="Also write the progress lines' numbers as TensorBoard scalars to this directory "
             "(needs pip install 'starling\\[tensorboard]')."),
    nproc_per_replica: int = typer.Option(
        1, "--nproc-per-replica", min=1, metavar="N",
        help="This peer is a replica of N ranks (processes spawned here; under torchrun, torchrun's ranks): DDP "
             "(gloo on the CPU, NCCL on GPUs) inside, the protocol between replicas. Every replica of a swarm has "
             "as many ranks as its first."),
    shard_sync: bool = typer.Option(
        False, "--shard-sync",
        help="With --nproc-per-replica N (or under torchrun): FSDP2 inside the replica, and every rank syncs its own "
             "shard of the model with the same rank of the other replicas, each rank a node of its own (an explicit "
             "--listen port is rank 0's; rank k listens on it + k). Without it rank 0 syncs the whole model."),
    replica_timeout_s: float = typer.Option(
        300.0, "--replica-timeout-s",
        help="The replica's torch.distributed timeout: how long a rank waits for the others (a dead rank is "
             "usually seen at once from its closed connection)."),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Start a node and run until SIGINT/SIGTERM, then leave the swarm gracefully.

    With --protocol (or when joining a swarm that trains), the node also trains: the first
    node fixes the protocol, its hyper-parameters and the task; joiners learn them, fetch
    the swarm's state and continue at its round. With --checkpoint-dir the training state
    goes to disk every --checkpoint-every steps; --resume restarts from it."""
    from starling.node.node import JoinError, Node, NodeConfig, NodeFault
    from starling.node.transfer import TransferError
    from starling.protocols.base import ProtocolError
    from starling.runtime import (
        CheckpointConfig,
        CheckpointError,
        NodeLaunch,
        PeerRun,
        TrainSpecError,
        prepare_to_train,
    )
    from starling.runtime.metrics import MetricsError, MetricsServer, TensorBoardLog
    from starling.runtime.placement import Placement
    from starling.runtime.replica_launch import check_replica_size, launch_replica
    from starling.runtime.replication import ReplicaError
    from starling.runtime.restart import RestartError
    from starling.tasks import TaskSpecError

    setup_logging(log_level)
    # Until the node is up, SIGTERM exits the way an error does (cleanups and atexit run: a
    # replica's spawned ranks and its rendezvous folder); then it asks for a graceful leave.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    train_errors = (TrainSpecError, ProtocolError, TaskSpecError, TransferError, CheckpointError, RestartError,
                    NodeFault, ReplicaError, DataError)
    try:
        check_seconds("--replica-timeout-s", replica_timeout_s)
        task, task_options = with_data(task, parse_options(task_opt or [], "task option"), data, tokenizer, seq_len)
        prepare_units(task, task_options)
        launch = NodeLaunch(protocol, task, protocol_options(opt, ctx.args, compressor=compressor,
                                                             lr=None if lr is None else str(lr)),
                            task_options, seed, steps, joining=bool(join),
                            resume_from=resume, replica_ranks=nproc_per_replica, data_scope=data_scope)
        if nproc_per_replica > 1 and join and "WORLD_SIZE" not in os.environ:  # about to spawn its ranks
            check_replica_size(join, nproc_per_replica, key)
        replica = launch_replica(nproc_per_replica, shard_sync=shard_sync, timeout_s=replica_timeout_s, device=device)
        if replica.follows:  # a rank under DDP: its rank 0 says what to train
            replica.follow()
            return
    except (ReplicaError, RuntimeError, JoinError, *EXPECTED_ERRORS) as exc:
        fail(str(exc))
    metrics: Optional[MetricsServer] = None
    board: Optional[TensorBoardLog] = None
    try:
        checkpoints = None
        if checkpoint_dir is not None or resume is not None:
            checkpoints = CheckpointConfig(str(checkpoint_dir or resume), checkpoint_every, checkpoint_keep)
        launch = launch.resolve().replicated(replica.replication)
        listen = replica.listen(listen)
        rank_world = _parse_shard(shard)
        check_seconds("--resume-timeout-s", resume_timeout_s)
        check_seconds("--min-peers-timeout-s", min_peers_timeout_s)
        check_seconds("--state-fetch-timeout-s", state_fetch_timeout_s)
        check_seconds("--join-deadline-s", join_deadline_s)
        peer_run = PeerRun(launch, shard=rank_world, log_every=log_every, log_digest=log_digest, min_peers=min_peers,
                           min_peers_timeout_s=min_peers_timeout_s, checkpoint=checkpoints,
                           resume_quorum=resume_quorum, resume_timeout_s=resume_timeout_s,
                           state_fetch_timeout_s=state_fetch_timeout_s,
                           placement=Placement.parse(device, dtype, autocast, state_device))
        replica.init()
        try:
            liveness = Liveness(probe_interval_s=probe_interval_s, ack_timeout_s=ack_timeout_s,
                                suspicion_base_s=suspicion_s, indirect_probes=indirect_probes,
                                probe_timeout_s=probe_timeout_s)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        config = NodeConfig(liveness=liveness,
                            transport=TransportConfig(monitor_connections=watch_connections),
                            offer_relay=relay, join_deadline_s=join_deadline_s)
        if no_listen and not join:
            raise ValueError("--no-listen needs --join: a node that listens nowhere can only join a swarm")
        if launch.may_train:  # others count it in from its hello
            prepare_to_train()
        node = Node(config=config)
        if tensorboard is not None:  # before the node starts: a bad directory or a missing extra fails first
            board = TensorBoardLog(tensorboard)
        if metrics_port is not None:
            metrics = MetricsServer(node, metrics_host, metrics_port)
        node.start(
            None if no_listen else listen, replica.seeds(join or []), key=key, advertise=advertise,
            authorized_keys=authorized_keys,
            security="plaintext" if plaintext else None, insecure=insecure, swarm_config=launch.swarm_config(),
        )
        replica.node_started(node, joined=bool(join))
    except (JoinError, MetricsError, *train_errors, *EXPECTED_ERRORS) as exc:
        _close_observers(metrics, board)
        fail(str(exc))  # the followers, daemons, go with this process
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not replica.replication.speaks:  # rank 0 speaks for the replica on stdout
        log.info("replica rank %d: node %s listening at %s", replica.group.rank, node.peer_id, node.address)
    elif node.reachable:
        typer.echo(f"starling node {node.peer_id} listening; join with: {node.address}", err=False)
    else:
        typer.echo(f"starling node {node.peer_id} joined as a client (nobody can dial it; reached through the "
                   "connections it opened, and relays)", err=False)
    if metrics is not None:
        typer.echo(f"starling metrics on {metrics.url}")
    sys.stdout.flush()
    try:
        peer_run.run(node, stop, _print_record, metrics=metrics, board=board, replication=replica.replication)
    except (*train_errors, TimeoutError) as exc:
        node.close()
        _close_observers(metrics, board)
        fail(str(exc))
    log.info("leaving the swarm")
    node.leave()
    _close_observers(metrics, board)
    replica.close()  # the ranks spawned here stopped where this rank did
    if shard_sync:
        # gloo's threads can abort the interpreter's teardown after FSDP2 (std::terminate):
        # everything is said and closed, so exit as multiprocessing's children do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _close_observers(metrics: Any, board: Any) -> None:
    for observer in (board, metrics):
        if observer is not None:
            observer.close()


def _parse_shard(shard: Optional[str]) -> Optional[tuple[int, int]]:
    if shard is None:
        return None
    rank, sep, world = shard.partition("/")
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(f"--shard must be RANK/WORLD, got {shard!r}") from None
    if not sep or w < 1 or not 0 <= r < w:
        raise ValueError(f"--shard must be RANK/WORLD with 0 <= RANK < WORLD, got {shard!r}")
    return r, w


def _print_record(record: dict[str, Any]) -> None:
    """A record of the peer's run as one line of JSON on stdout. The stopped line carries the
    evaluation and the protocol's own account, any value: json_text writes as text what JSON
    cannot hold."""
    typer.echo(json_text(record) if record.get("event") == "stopped" else json.dumps(record))
    sys.stdout.flush()


def node_status(
    address: str = typer.Argument(..., help="Join address of the node to ask."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    key: Optional[Path] = typer.Option(None, "--key", help="Identity to authenticate with (for allowlisted swarms)."),
    timeout_s: float = typer.Option(5.0, "--timeout-s"),
) -> None:
    """Ask a running node for its peer table and stats."""
    from starling.node.client import ClientError, query

    try:
        check_seconds("--timeout-s", timeout_s)
        identity = Identity.load(key) if key else None
        status = query(address, identity=identity, timeout_s=timeout_s)
    except (ClientError, *EXPECTED_ERRORS) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json_text(status))
        return
    try:
        lines = _status_lines(status)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # an answer not shaped like a status
        fail(f"malformed status from {address} ({type(exc).__name__}: {exc}); --json prints it as it came")
    for line in lines:
        typer.echo(line)


def _status_lines(status: Any) -> list[str]:
    lines = [f"node {status['id']}  {status['address']}  ({status['security']})"]
    for p in status["peers"]:
        lines.append(f"  {p['id']}  {p['status']:<8} seen {p['last_seen_s']:.1f}s ago  {' '.join(p['addresses'])}")
    replica = (status.get("info") or {}).get("replica")
    if replica:
        verdict = "agree" if replica["agree"] else "DIFFER"
        lines.append(f"  replica of {replica['ranks']} ranks, at step {replica['step']} their models {verdict}: "
                     + " ".join(str(d) for d in replica["digests"]))
    stats = status["stats"]
    lines.append(f"  sent {sum(sum(t.values()) for t in stats['bytes_sent'].values())} B, "
                 f"received {sum(sum(t.values()) for t in stats['bytes_received'].values())} B, "
                 f"rejected {sum(stats['rejected'].values())}")
    lines.extend(_trust_lines(status.get("trust") or {}, stats["rejected"].get(RejectReason.BANNED.value, 0)))
    return lines


def _trust_lines(trust: dict[str, Any], dropped: int) -> list[str]:
    """What the node holds against other peers (`node.trust`): nothing when it holds nothing."""
    banned, counts, accused = trust.get("banned") or {}, trust.get("counts") or {}, trust.get("accused") or {}
    if not (banned or counts or accused):
        return []
    lines = ["  trust" + (f" ({dropped} messages from banned peers dropped)" if dropped else "")]
    for peer, ban in sorted(banned.items()):
        how = "verifiable" if ban["verifiable"] else "witnessed"
        witnesses = " ".join(ban["witnesses"])
        lines.append(f"    banned   {peer}  {ban['kind']} evidence of round {ban['round']} ({how}), by {witnesses}")
    for peer, kinds in sorted(counts.items()):
        lines.append(f"    counts   {peer}  " + "  ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())))
    for peer, witnesses in sorted(accused.items()):
        lines.append(f"    accused  {peer}  by {' '.join(witnesses)}")
    return lines
