"""`spsa`: zeroth-order training where a projected gradient is coded in one byte (samples=64: ~1.5 B sent).

MeZO (Malladi et al. 2023) on each peer, "Just One Byte" (Zelikman et al. 2023) between them:
no tensor is ever sent, every peer regenerates every direction from its seed. A step's codes
travel in one message per peer, ~34 B of headers per gradient with 8 peers spread over `samples`.

Every peer i, step t (training thread; forwards only, memory as for inference):
    digest = hash(theta)                          if t % digest_every == 0
    for s in samples:
        z = direction(seed, t, s [, key_i])       # shared: one z per (t, s) for all peers
        theta += eps z; L+ = loss; theta -= 2 eps z; L- = loss; theta += eps z   # bit-exact
        code[s] = one_byte((L+ - L-) / (2 eps))   # scale from the decoded history, no bytes
    send (t, code, digest) to the leader ("spsa.contrib"); the reply is step t's record
Leader = the lowest-id live peer among the last record's contributors (network thread):
    collect step t's codes until every expected peer has sent them, or round_timeout_s after
    the first; the record (contributor keys ascending, their codes, the majority digest) is the
    reply to everyone, and to anyone who asks later ("late": the step closed without it)
Every peer applies the record (so all hold the same bits, without sending one):
    theta -= lr / |codes| * sum_(j, s) decode(code_js) z_js     # in record order, exactly
    if the record's digest is not mine: fetch the state of a peer that has it (logged repair)
Join and catch-up: load a peer's state at step s, then replay records s, s+1, ... ("spsa.log").
Healing: peers that followed different leaders (a partition, a liveness flap) all move to the
lineage led by the lowest id seen in heartbeat metadata, taking that leader's state.

Exactness (grid arithmetic) and the one-byte code are in `arith`; records in `records`; the
options in `config`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from starling.collectives import request_patiently
from starling.node.loop import AwakeDeadline
from starling.node.node import Node
from starling.node.rpc import Refusal, Refuser, Reply, RequestTimeout, refusal
from starling.node.wire import Message
from starling.protocols.base import LossFn, Protocol, ProtocolError, StepReport, register
from starling.protocols.spsa.arith import (
    NO_DIGEST,
    Z_MAX,
    ParamSpace,
    ScaleTracker,
    codes_from_bytes,
    codes_to_bytes,
    decode_code,
    direction_seed,
    encode_g,
    peer_key,
)
from starling.protocols.spsa.bodies import (
    LOG_BATCH,
    BodyError,
    Contribution,
    Declined,
    LogAsk,
    LogRecords,
    SpsaState,
    StateAsk,
    StepClosed,
)
from starling.protocols.spsa.config import SpsaConfig
from starling.protocols.spsa.leader import LOG_TOPIC, Sequencer
from starling.protocols.spsa.records import Record, RecordLog

log = logging.getLogger(__name__)

CONTRIB_TOPIC, STATE_TOPIC = "spsa.contrib", "spsa.state"
_LOCK_POLL_S = 0.002
# A timeout is no proof of death (a loaded host stalls whole processes; the failure detector
# decides), so a live leader that timed out is asked again: a closed step is answered at once.
_TIMEOUT_RETRIES = 3
_STATE_YIELD_S = 0.2  # how long a step start waits for a state request to read the parameters


@dataclass(frozen=True)
class _Outcome:
    record: Record | None
    upto: int  # the latest step the leader has closed
    too_old: bool = False  # my step is older than the leader's log: fetch a state instead


@register
class Spsa(Protocol, name="spsa", config_class=SpsaConfig, topic_prefix="spsa."):
    config: SpsaConfig

    def __init__(self, node: Node, model: nn.Module, config: SpsaConfig) -> None:
        super().__init__(node, model, config)
        try:
            self.space = ParamSpace(model, config.param_filter, config.chunk_numel, config.eps,
                                    Z_MAX[config.distribution])
        except ValueError as exc:
            raise ProtocolError(f"spsa: {exc}") from None
        self.space.snap()
        self.me, self.key = node.peer_id, peer_key(node.peer_id)
        self.scale = ScaleTracker.start(config.g_scale)
        self.log = RecordLog(config.log_steps)
        self.counters: Counter[str] = Counter()  # late, repairs, replayed, rejected.<reason>
        self._refuse = Refuser(node.stats, "spsa", self.me, self.counters)
        # Parameters and step state: the training thread holds this while the parameters are
        # perturbed or updated; a state request reads them only in between.
        self._lock = threading.RLock()
        self._state_waiters = 0
        self._last_keys: tuple[int, ...] = ()  # contributors of the last applied step
        self._lineage = self.me  # the peer that closed the last applied step
        self._behind = False  # after a load or a repair: catch up before contributing
        # Network-thread state.
        self._keys: dict[str, int] = {self.me: self.key}
        self.sequencer = Sequencer(node, self.key, self.log, config.samples, config.round_timeout_s,
                                   lambda: {self._key_of(p) for p in {*self._live, self.me}}, self._refuse)
        self._live: set[str] = set(node.live_peers())
        self._serve({CONTRIB_TOPIC: self._on_contrib, LOG_TOPIC: self._on_log, STATE_TOPIC: self._on_state})

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        clock = self._begin_step()
        with clock.computing():  # catching up counts as compute: no exchange of this step has begun
            self._yield_to_state_requests()
            if self.step_count % self.config.digest_every == 0:
                self._follow_lowest_lineage()
            if self._behind:
                self._catch_up()
            t = self.step_count
            with self._lock:
                digest = self.space.digest() if t % self.config.digest_every == 0 else NO_DIGEST
                loss, grads = self._estimate(loss_fn, t)
            codes = codes_to_bytes([encode_g(g, self.scale.scale_log2) for g in grads])
        outcome = self.node.run(self._exchange(t, codes, digest), timeout_s=self._exchange_timeout_s())
        previous = self._last_keys
        record = outcome.record
        if record is not None:
            with clock.computing():
                self._apply_checked(record)
        if outcome.too_old or outcome.upto > t:
            self._behind = True
            self._catch_up()
        if record is None:
            return self._report(t, loss, clock)
        return self._report(t, loss, clock, synced=len(record.keys) > 1, peers=len(record.keys),
                            lost=self._names(set(previous) - set(record.keys)))

    def _estimate(self, loss_fn: LossFn, t: int) -> tuple[float, list[float]]:
        """Projected gradients along this step's directions; the parameters end bit-exact."""
        cfg, space = self.config, self.space
        modes = [(m, m.training) for m in self.model.modules()]
        if cfg.eval_forwards:
            self.model.eval()
        losses, grads = [], []
        try:
            with torch.no_grad():
                for s in range(cfg.samples):
                    seed = direction_seed(cfg.seed, t, s, None if cfg.directions == "shared" else self.key)
                    offset = 0  # in units of eps z, so that an exception still restores theta
                    try:
                        space.perturb(seed, cfg.distribution, +1)
                        offset = 1
                        plus = float(loss_fn())
                        space.perturb(seed, cfg.distribution, -2)
                        offset = -1
                        minus = float(loss_fn())
                    finally:
                        if offset:
                            space.perturb(seed, cfg.distribution, -offset)
                    grads.append((plus - minus) / (2.0 * cfg.eps))
                    losses.append(0.5 * (plus + minus))
        finally:
            for module, training in modes:
                module.training = training
        return sum(losses) / len(losses), grads

    def _apply_checked(self, record: Record) -> None:
        """Apply a record; if it shows this peer's parameters drifted, repair them."""
        with self._lock:
            if record.step != self.step_count:
                log.warning("%s: record of step %d does not follow step %d; ignored",
                            self.me, record.step, self.step_count)
                return
            drifted = self._apply(record)
        if drifted is not None:
            self._repair(record, drifted)

    def _apply(self, record: Record) -> int | None:
        """theta -= lr / |codes| sum decode(code) z in record order; returns my digest if it
        disagreed with the record's reference digest (None if it agreed or there was none)."""
        cfg, t, samples = self.config, record.step, self.config.samples
        mine = self.space.digest() if record.digest != NO_DIGEST else NO_DIGEST
        values = [decode_code(c, self.scale.scale_log2) for c in codes_from_bytes(record.codes)]
        coef = -cfg.lr / len(values)
        if cfg.directions == "shared":
            terms = [(direction_seed(cfg.seed, t, s, None), coef * sum(values[s::samples]))
                     for s in range(samples)]
        else:
            terms = [(direction_seed(cfg.seed, t, s, key), coef * values[j * samples + s])
                     for j, key in enumerate(record.keys) for s in range(samples)]
        self.space.update([term for term in terms if term[1] != 0.0], cfg.distribution)
        self.scale.update(values)
        self.log.add(record)
        self._last_keys, self._lineage = record.keys, record.leader
        self.step_count = t + 1
        self.node.set_meta(spsa_leader=record.leader, spsa_step=self.step_count)
        return mine if mine != record.digest else None

    def replay(self, records: list[Record]) -> int:
        """Apply consecutive records from the current step on (what a joiner does); returns
        how many applied. Skips none: a gap ends the replay."""
        applied = 0
        for record in records:
            if record.step != self.step_count:
                break
            self._apply_checked(record)
            applied += 1
        self.counters["replayed"] += applied
        return applied

    def _catch_up(self) -> None:
        """Replay what the log already holds, then what the leader has closed since."""
        for _ in range(1000):
            self.replay(self.log.since(self.step_count, LOG_BATCH))
            records, upto, too_old = self.node.run(self._fetch_log(self.step_count),
                                                   timeout_s=self._exchange_timeout_s())
            if too_old:
                self._fetch_state(None, f"step {self.step_count} is older than the leader's log")
                continue
            for record in records:
                self.log.add(record)
            if self.replay(records) == 0 or self.step_count > upto:
                break
        self._behind = False

    def _repair(self, record: Record, mine: int) -> None:
        self.counters["drift"] += 1
        log.warning("%s: parameters drifted before step %d (digest %016x, swarm %016x); repairing",
                    self.me, record.step, mine, record.digest)
        source = next((p for p in sorted(self._live) if self._key_of(p) == record.source), None)
        self._fetch_state(source, f"drift at step {record.step}")

    def _follow_lowest_lineage(self) -> None:
        """When a partition heals (or a liveness flap split the swarm), peers that followed
        different leaders meet again: each moves to the lineage led by the lowest id, read
        from heartbeat metadata, so the swarm converges on one record sequence."""
        last, leads = set(self._last_keys), []
        for peer in sorted(self.node.peers, key=lambda p: p.id):
            if (peer.status.value not in ("alive", "suspect") or peer.meta.get("spsa_leader") != peer.id
                    or peer.id >= self._lineage or self._key_of(peer.id) in last):
                continue
            step = peer.meta.get("spsa_step")
            held = self.log.get(step - 1) if isinstance(step, int) else None
            if held is None or held.leader != peer.id:  # a record I hold would make it my lineage
                leads.append(peer.id)
        if leads:
            log.warning("%s: lineage led by %s meets the one led by %s; following %s",
                        self.me, self._lineage, leads[0], leads[0])
            self.counters["lineage_switches"] += 1
            self._fetch_state(leads[0], f"lineage of {leads[0]}", forget_log=True)

    def _fetch_state(self, source: str | None, why: str, forget_log: bool = False) -> None:
        """Load the parameters of `source` (default: the leader) and replay from there."""
        source = source or self.node.run(self._aleader(set()))
        if source == self.me:
            log.warning("%s: no peer to repair from (%s)", self.me, why)
            return
        try:
            msg = self.node.request(source, STATE_TOPIC, StateAsk().to_wire(), timeout_s=self._exchange_timeout_s())
            state, flat = SpsaState.from_wire(msg.body), msg.payload[0] if len(msg.payload) == 1 else None
            if not isinstance(flat, torch.Tensor):
                raise BodyError(f"{len(msg.payload)} frames where one tensor of parameters was expected")
            with self._lock:
                self.space.write(flat.reshape(-1).to(torch.float32, copy=True))
                self.scale.scale_log2, self.scale.mean_abs = state.scale_log2, state.mean_abs
                self._last_keys = state.keys
                self._lineage = state.leader
                self.step_count = state.step
                if forget_log:  # my lineage's records from here on are not the swarm's
                    self.log.drop_after(self.step_count - 1)
        except Exception as exc:
            log.warning("%s: repair from %s failed (%s): %s", self.me, source, why, exc)
            return
        self.counters["repairs"] += 1
        self._behind = True
        log.warning("%s: repaired from %s (%s); now at step %d", self.me, source, why, self.step_count)

    def _yield_to_state_requests(self) -> None:
        deadline = time.monotonic() + _STATE_YIELD_S
        while self._state_waiters and time.monotonic() < deadline:
            time.sleep(_LOCK_POLL_S)

    def _exchange_timeout_s(self) -> float:
        attempt = self.config.round_timeout_s + self.config.reply_grace_s
        return AwakeDeadline.STRETCH * attempt * (len(self._live) + 2 + _TIMEOUT_RETRIES) + 5.0

    def _names(self, keys: set[int]) -> tuple[str, ...]:
        by_key = {self._key_of(p): p for p in list(self._live)}
        return tuple(sorted(by_key.get(k, f"key:{k:016x}") for k in keys))

    # ------------------------------------------------------------------ network thread: contributor
    def _key_of(self, peer: str) -> int:
        key = self._keys.get(peer)
        if key is None:
            key = self._keys[peer] = peer_key(peer)
        return key

    async def _aleader(self, tried: set[str]) -> str:
        """The lowest-id live peer among the last contributors; else the lowest-id live peer."""
        members = [p for p in sorted({*self._live, self.me}) if p not in tried]
        last = set(self._last_keys)
        chosen = [p for p in members if self._key_of(p) in last] or members
        return chosen[0] if chosen else self.me

    async def _exchange(self, t: int, codes: bytes, digest: int) -> _Outcome:
        tried: set[str] = set()
        timeouts: Counter[str] = Counter()
        body = Contribution(t, codes, digest).to_wire()
        wait_s = self.config.round_timeout_s + self.config.reply_grace_s
        while True:
            leader = await self._aleader(tried)
            if leader == self.me:
                reply = await self.sequencer.collect(self.key, self.me, t, codes, digest)
            else:
                try:
                    reply = (await self._request_patiently(leader, CONTRIB_TOPIC, body, wait_s)).body
                except RequestTimeout as exc:
                    timeouts[leader] += 1
                    if leader not in self._live or timeouts[leader] > _TIMEOUT_RETRIES:
                        tried.add(leader)
                    log.info("%s: step %d: no answer from leader %s: %s", self.me, t, leader, exc)
                    continue
                except Exception as exc:  # dead, gone, or refused by the node
                    log.info("%s: step %d: leader %s unavailable: %s", self.me, t, leader, exc)
                    tried.add(leader)
                    continue
            outcome = self._read_reply(reply, t, codes, leader)
            if outcome is not None:
                return outcome
            if leader == self.me:  # nobody else to ask: the step passes without an update
                return _Outcome(None, self.log.upto)
            tried.add(leader)

    async def _request_patiently(self, peer: str, topic: str, body: Any, wait_s: float) -> Message:
        """A request that retries while the peer's protocol is not up yet."""
        return await request_patiently(self.node, peer, topic, body, (), AwakeDeadline(wait_s),
                                       self.config.retry_interval_s)

    def _read_reply(self, reply: Any, t: int, codes: bytes, leader: str) -> _Outcome | None:
        declined = Declined.from_wire(reply)
        if declined is not None:
            if declined.too_old:
                return _Outcome(None, declined.upto, too_old=True)
            log.info("%s: leader %s refused step %d: %s", self.me, leader, t, declined.reason)
            return None
        try:
            closed = StepClosed.from_wire(reply, self.config.samples, mine=(self.key, codes))
            if closed.record.step != t:
                raise BodyError(f"record of step {closed.record.step} for step {t}")
        except BodyError as exc:
            self._refuse.count("bad_record", f"from {leader}: {exc}")
            return None
        if closed.late:
            self.counters["late"] += 1
        return _Outcome(closed.record, closed.upto)

    async def _fetch_log(self, since: int) -> tuple[list[Record], int, bool]:
        """Closed records from `since` on, from the leader (or, failing it, any live peer)."""
        tried: set[str] = set()
        while True:
            peer = await self._aleader(tried)
            if peer == self.me:
                return [], self.log.upto, False
            try:
                reply = (await self._request_patiently(peer, LOG_TOPIC, LogAsk(since).to_wire(),
                                                       self.config.round_timeout_s)).body
                declined = Declined.from_wire(reply)
                if declined is not None and declined.too_old:
                    return [], declined.upto, True
                answer = LogRecords.from_wire(reply, self.config.samples)
                return list(answer.records), answer.upto, False
            except Exception as exc:
                log.info("%s: log from %s unavailable: %s", self.me, peer, exc)
                tried.add(peer)

    # ------------------------------------------------------------------ network thread: leader
    async def _on_contrib(self, msg: Message) -> dict[str, Any]:
        if not self._open:
            return refusal(Refusal.CLOSED, "protocol closed")
        try:
            contribution = Contribution.from_wire(msg.body, self.config.samples)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, f"{msg.sender}: {exc}")
        return await self.sequencer.collect(self._key_of(msg.sender), msg.sender, contribution.step,
                                            contribution.codes, contribution.digest)

    async def _on_log(self, msg: Message) -> dict[str, Any]:
        return self.sequencer.serve_log(msg.sender, msg.body)

    async def _on_state(self, msg: Message) -> Reply | dict[str, Any]:
        """This peer's trained parameters, read between steps (never mid-perturbation)."""
        try:
            StateAsk.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, f"{msg.sender}: {exc}")
        self._state_waiters += 1
        try:
            deadline = time.monotonic() + self.config.round_timeout_s
            while not self._lock.acquire(blocking=False):
                if time.monotonic() > deadline:
                    return refusal(Refusal.BUSY)
                await asyncio.sleep(_LOCK_POLL_S)
        finally:
            self._state_waiters -= 1
        try:
            flat = self.space.read().clone()
            body = SpsaState(self.step_count, self.scale.scale_log2, self.scale.mean_abs, self._last_keys,
                             self._lineage).to_wire()
        finally:
            self._lock.release()
        return Reply(body, (flat,))

    # ------------------------------------------------------------------ hooks and state
    def on_peer_joined(self, peer_id: str) -> None:
        self._live.add(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        self._live.discard(peer_id)
        self.sequencer.peer_left(self._key_of(peer_id))

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            state = super().state_dict()
            state["spsa"] = {"scale_log2": self.scale.scale_log2, "mean_abs": self.scale.mean_abs,
                             "last_keys": torch.tensor(self._last_keys, dtype=torch.int64), "leader": self._lineage}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            super().load_state_dict(state)
            self.space.grids = [0.0] * len(self.space.params)
            self.space.snap()
            extra = state.get("spsa")
            if extra is not None:
                self.scale.scale_log2, self.scale.mean_abs = int(extra["scale_log2"]), float(extra["mean_abs"])
                self._last_keys = tuple(int(k) for k in extra["last_keys"].tolist())
                self._lineage = str(extra["leader"])
            self._behind = True

    def log_records(self, since: int) -> list[Record]:
        """Consecutive closed records from `since` on, as this peer holds them."""
        return self.log.since(since, self.config.log_steps)

    def digest(self) -> int:
        """A digest of the trained parameters (equal on every peer in lock-step)."""
        with self._lock:
            return self.space.digest()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "step": self.step_count, "parameters": self.space.numel,
                "tensors": len(self.space.params), "counters": dict(self.counters)}
