"""Attacks on a sharded all-reduce, for the Byzantine benchmark and tests: what a hostile
member of a swarm can send, done to one peer's protocol object from outside the library.

    attack = make("scale")                      # one of ATTACKS
    attack.apply(proto, board=board, seed=rank) # after the protocol is built, before it trains
    tap(proto, board)                           # on every honest peer, for attacks that read them

There is no attacker mode in the library or the CLI. An attack patches attributes of the
attacker's own instances, so that the honest peers of the same process run the code as it is:

- `ShardedReducer.start` of each of the protocol's reducers (`proto.reducers`: allreduce's one,
  DiLoCo's one per fragment; the side rounds of buffers and the drift guard are left alone).
  `reduce()` calls `self.start`, so an instance attribute takes both paths. The wrapper
  computes the vector to send from the honest one, starts the round on a vector of its own
  (lend=False: the parts are copies) with the weight it claims, and when the caller waits,
  writes the round's averages back into the caller's vector (a chunk without an average keeps
  the honest value), so the attacker's own model keeps training like an honest peer's and its
  next honest vector stays a real gradient.
- `reducer._answer` (where an owner judges a closed chunk's parts, signs the average and
  answers) for the lying owner: the chunk's average is scaled by -10 before the owner encodes
  and signs it; the owner's judgement of the members and its CenteredClip centre keep the true
  average (a liar that also accused honest members would be another attack: see `slander`).
- `reducer.codec` and `reducer._part_feedback` where the swarm's codec cannot carry the attack:
  NaN parts go out as raw float32 (`none`), because int4 refuses to encode NaN and a NaN scale
  is refused at decode as a malformed part; a replay turns the attacker's error feedback off,
  so that the same vector encodes to the same bytes under a lossy codec.
- `QuorumClose._close` of each fragment's quorum (streaming-diloco with `quorum`): a leader
  closes its rounds with itself alone, after acknowledging the others' asks.

Attacks that need the honest peers' vectors of the round ("a little is enough", inner-product
manipulation) read them from a `Board` shared by the peers of one process: every honest peer's
reducers are tapped (`tap`) to post a copy of each vector they start a round with, and the
attacker waits (bounded) for the honest vectors of its round. This is the omniscient attacker
of both papers; where the board has fewer than two honest vectors in time, the attacker falls
back to its own recent vectors (the `estimated` count on the attack says how often).

A process that is wholly the attacker (a `starling node start` in a test) calls
`on_every_protocol(name)`, which applies the attack to every protocol the process's
`Trainer.create_protocol` builds.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ALIE_Z = 1.0  # "a little is enough": how many honest standard deviations to move (see AlieAttack)
IPM_EPSILON = 0.1  # inner-product manipulation: the attacker sends -epsilon times the honest mean
NOISE_FACTOR = 10.0  # Gaussian noise of this many times the part's norm
SCALE = 100.0
CLAIMED_WEIGHT = 1000.0
REPLAY_LAG = 3  # rounds back
LIE_FACTOR = -10.0  # the lying owner's averages
COLLUDE_SCALE = 1.0  # colluders' crafted vector: minus the honest mean, at the honest median norm
BOARD_WAIT_S = 5.0  # the longest an attacker waits for the honest vectors of its round


# ---------------------------------------------------------------------------- the board
class Board:
    """The honest vectors of each (topic, round), posted by tapped honest peers of this process."""

    def __init__(self, honest: int, keep_rounds: int = 8) -> None:
        self.honest, self.keep_rounds = honest, keep_rounds
        self._vectors: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._cond = threading.Condition()
        self.reducers: dict[tuple[str, str], Any] = {}  # (topic, peer) -> an honest peer's reducer (omniscience)

    def post(self, topic: str, t: int, peer: str, vector: torch.Tensor) -> None:
        with self._cond:
            self._vectors.setdefault((topic, t), {})[peer] = vector.detach().to("cpu", torch.float32).clone()
            newest = max(r for _, r in self._vectors)
            for key in [k for k in self._vectors if k[1] < newest - self.keep_rounds]:
                del self._vectors[key]
            self._cond.notify_all()

    def honest_vectors(self, topic: str, t: int, wait_s: float = BOARD_WAIT_S) -> list[torch.Tensor]:
        """The honest vectors of (topic, t): all of them, or what came within `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while len(self._vectors.get((topic, t), {})) < self.honest:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._vectors.get((topic, t), {}).values())


def tap(proto: Any, board: Board) -> None:
    """An honest peer posts a copy of every vector it starts a round with; it sends it unchanged."""
    for reducer in proto.reducers:
        original = reducer.start
        board.reducers[reducer.topic, reducer.node.peer_id] = reducer

        def start(t: int, members: tuple[str, ...], vector: torch.Tensor, lend: bool = False,
                  weight: float | None = None, *, _original: Callable[..., Any] = original,
                  _topic: str = reducer.topic, _peer: str = reducer.node.peer_id, **more: Any) -> Any:
            board.post(_topic, t, _peer, vector)
            return _original(t, members, vector, lend=lend, weight=weight, **more)

        reducer.start = start


# ---------------------------------------------------------------------------- attacks
@dataclass
class Attack:
    """One attack, applied to one peer's protocol object. `poisons` says whether it is meant to
    move the swarm's model (a free rider's zeros only withhold work); `needs` names what the
    run must have for it (a quorum)."""

    name: str = ""
    poisons: bool = True
    needs: str = ""
    board: Board | None = field(default=None, repr=False)
    rounds: int = 0  # rounds the attack was applied in (on all its reducers)
    estimated: int = 0  # rounds where the honest vectors came from the attacker's own history

    def apply(self, proto: Any, board: Board | None = None, seed: int = 0) -> None:
        self.board = board
        self.generator = torch.Generator().manual_seed(10_007 + seed)
        for reducer in proto.reducers:
            self.patch(reducer, proto)

    def patch(self, reducer: Any, proto: Any) -> None:
        """Default: the reducer's parts go out as `forge` makes them."""
        original = reducer.start
        history: deque[torch.Tensor] = deque(maxlen=8)  # my own recent honest vectors

        def start(t: int, members: tuple[str, ...], vector: torch.Tensor, lend: bool = False,
                  weight: float | None = None, **more: Any) -> Any:
            honest = vector.detach().clone()
            self.members = members
            sent, claimed = self.forge(reducer, t, honest, weight, history)
            history.append(honest)
            self.rounds += 1
            if sent is None:
                return original(t, members, vector, lend=lend, weight=claimed, **more)
            forged = sent.clone()
            pending = original(t, members, sent, lend=False, weight=claimed, **more)
            wait = pending.wait

            def wait_and_write_back() -> Any:
                result = wait()
                unchanged = torch.eq(sent, forged) | (torch.isnan(sent) & torch.isnan(forged))
                vector.copy_(torch.where(unchanged, honest, sent))  # averaged chunks, else my honest values
                return result

            pending.wait = wait_and_write_back
            return pending

        reducer.start = start

    def forge(self, reducer: Any, t: int, honest: torch.Tensor, weight: float | None,
              history: deque[torch.Tensor]) -> tuple[torch.Tensor | None, float | None]:
        """(the vector to send, or None for the honest one; the weight to claim)."""
        raise NotImplementedError

    def honest_mean_std(self, reducer: Any, t: int, mine: torch.Tensor,
                        history: deque[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = self.board.honest_vectors(reducer.topic, t) if self.board is not None else []
        if len(vectors) < 2:
            self.estimated += 1
            vectors = [*history, mine]
        stacked = torch.stack([v.to(mine.device) for v in vectors])
        std = stacked.std(dim=0) if len(vectors) > 1 else torch.zeros_like(mine)
        return stacked.mean(dim=0), std


class SignFlip(Attack):
    def forge(self, reducer, t, honest, weight, history):
        return -honest, weight


class Scale(Attack):
    def forge(self, reducer, t, honest, weight, history):
        return honest * SCALE, weight


class Noise(Attack):
    """The honest part plus Gaussian noise whose norm is NOISE_FACTOR times the part's."""

    def forge(self, reducer, t, honest, weight, history):
        noise = torch.randn(honest.shape, generator=self.generator).to(honest.device)
        norm = float(honest.norm())
        return honest + noise * (NOISE_FACTOR * norm / math.sqrt(max(1, honest.numel()))), weight


class NotFinite(Attack):
    """NaN in even places, +Inf in odd ones, sent as raw float32 whatever the swarm's codec."""

    def patch(self, reducer, proto):
        from starling.compressors import from_spec

        if not reducer.codec.lossless or not reducer.codec.zero_copy:
            reducer.codec, reducer._part_feedback = from_spec("none"), None
        super().patch(reducer, proto)

    def forge(self, reducer, t, honest, weight, history):
        bad = torch.empty_like(honest)
        bad[0::2], bad[1::2] = float("nan"), float("inf")
        return bad, weight


class Alie(Attack):
    """"A little is enough" (Baruch et al. 2019): mean - z std of the honest vectors, per
    coordinate. The paper's z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f, is 0 for
    n = 8, f = 1 (the attack would send the mean) and 0.32 for f = 2; ALIE_Z = 1 is the
    stronger setting often used since."""

    def forge(self, reducer, t, honest, weight, history):
        mean, std = self.honest_mean_std(reducer, t, honest, history)
        return mean - ALIE_Z * std, weight


class InnerProduct(Attack):
    """Inner-product manipulation (Xie et al. 2020): -epsilon times the honest mean."""

    def forge(self, reducer, t, honest, weight, history):
        mean, _ = self.honest_mean_std(reducer, t, honest, history)
        return -IPM_EPSILON * mean, weight


class Overweight(Attack):
    """A claimed weight of CLAIMED_WEIGHT on a sign-flipped part: the weight is what amplifies
    a poisoned part in a weighted mean (an honest part with a big weight only trains the swarm
    on the attacker's data)."""

    def forge(self, reducer, t, honest, weight, history):
        return -honest, CLAIMED_WEIGHT


class Zeros(Attack):
    """A free rider: zeros for its parts (it withholds its work, poisons nothing)."""

    def forge(self, reducer, t, honest, weight, history):
        return torch.zeros_like(honest), weight


class Replay(Attack):
    """The vector it sent REPLAY_LAG rounds ago, again (re-signed for this round), with its
    error feedback off so that the same vector encodes to the same bytes."""

    def patch(self, reducer, proto):
        reducer._part_feedback = None
        if not hasattr(self, "_sent"):
            self._sent: dict[str, deque[torch.Tensor]] = {}
        super().patch(reducer, proto)

    def forge(self, reducer, t, honest, weight, history):
        sent = self._sent.setdefault(reducer.topic, deque(maxlen=REPLAY_LAG))
        old = sent[0] if len(sent) == REPLAY_LAG else None
        sent.append(old if old is not None else honest)
        return (old.clone() if old is not None else None), weight


class LyingOwner(Attack):
    """An owner that scales every average it signs by LIE_FACTOR; its parts are honest.

    Patched: `reducer._answer(key, group, bounds, average)`, where an owner judges a closed
    group's parts, signs its average and answers the contributors; `average()` gives the
    (average, shares, verdict) it signs. The lie replaces that average; the owner's judgement
    (`reducer.screening.on_close`) and its next CenteredClip centre keep the true one."""

    def patch(self, reducer, proto):
        answer, screening = reducer._answer, reducer.screening
        judge = screening.on_close
        truth: dict[str, torch.Tensor] = {}

        def lying_answer(key: Any, group: Any, bounds: tuple[int, int], average: Callable[[], Any]) -> None:
            def lie() -> Any:
                avg, shares, verdict = average()
                truth["avg"] = avg.clone()
                return (avg * LIE_FACTOR if avg.numel() else avg), shares, verdict

            answer(key, group, bounds, lie)
            if bounds in screening.centers and "avg" in truth:
                screening.centers[bounds] = truth["avg"]  # my next CenteredClip starts where the others' do
            truth.pop("avg", None)
            self.rounds += 1

        reducer._answer = lying_answer
        screening.on_close = lambda t, i, c, bounds, group, verdict, avg: judge(t, i, c, bounds, group, verdict,
                                                                               truth.get("avg", avg))


class QuorumLeader(Attack):
    """A quorum leader that closes every round it leads with itself alone, after acknowledging
    the others' asks (streaming-diloco with `quorum`)."""

    def apply(self, proto, board=None, seed=0):
        quorums = [f.quorum for f in getattr(proto, "fragments", []) if f.quorum is not None]
        if not quorums:
            raise ValueError("quorum_leader needs a protocol with a quorum (streaming-diloco, quorum > 0)")
        for quorum in quorums:
            close = quorum._close

            def alone(t: int, gathering: Any, _close: Callable[..., Any] = close,
                      _me: str = quorum.node.peer_id) -> None:
                if gathering.closing is None:
                    gathering.weights = {p: w for p, w in gathering.weights.items() if p == _me}
                    self.rounds += 1
                _close(t, gathering)

            quorum._close = alone


class Slander(Attack):
    """Beyond the model: at its first round the attacker accuses, as a witness, the member that
    sorts last (an honest peer for both placements of the benchmark) of sending outliers. The
    accusation is witness evidence, which no peer can check; a ban takes `ban_witnesses` (2)
    distinct accusers, so one slanderer bans nobody and two (colluding) ban whom they like."""

    def patch(self, reducer, proto):
        if getattr(self, "_slandered", False):
            return
        self._slandered = True
        original, node = reducer.start, reducer.node

        def start(t: int, members: tuple[str, ...], vector: torch.Tensor, lend: bool = False,
                  weight: float | None = None, **more: Any) -> Any:
            if self.rounds == 0:
                self.rounds += 1
                victim = max(members)
                node.run(self._accuse(node, victim, t, reducer.topic))
            return original(t, members, vector, lend=lend, weight=weight, **more)

        reducer.start = start

    @staticmethod
    async def _accuse(node: Any, victim: str, t: int, topic: str) -> None:
        from starling.collectives.defences import OUTLIER
        from starling.node.trust import Evidence

        key = node.trust.key_of(victim)
        if key is not None:
            node.trust.accuse(Evidence(OUTLIER, victim, key, t, {"topic": topic, "shard": 0, "chunk": 0,
                                                                  "rounds": 3, "why": "norm_high"}))


class Collude(Attack):
    """Two (or more) colluders send the same crafted vector, -COLLUDE_SCALE times the honest
    mean scaled to the honest median norm (within the norm screen), in 2 of every 3 rounds
    (`t % 3 != 2`), and their honest vector in the third: no owner sees them flagged 3 rounds
    in a row."""

    def poisons_round(self, t: int) -> bool:
        return t % 3 != 2

    def crafted(self, reducer: Any, t: int, honest: torch.Tensor, history: deque[torch.Tensor]) -> torch.Tensor:
        mean, _ = self.honest_mean_std(reducer, t, honest, history)
        vectors = self.board.honest_vectors(reducer.topic, t) if self.board is not None else []
        norm = statistics.median(float(v.norm()) for v in vectors) if vectors else float(honest.norm())
        return -COLLUDE_SCALE * mean * (norm / max(float(mean.norm()), 1e-30))

    def forge(self, reducer, t, honest, weight, history):
        if not self.poisons_round(t):
            return None, weight
        return self.crafted(reducer, t, honest, history).to(honest.device), weight


class ColludeSkip(Collude):
    """Colluders that read the owners' watch: every round they send the crafted vector on every
    chunk but those whose owners flagged them in their last two rounds in a row there (an
    owner accuses at three), and their honest values on those."""

    def poisons_round(self, t: int) -> bool:
        return True

    def forge(self, reducer, t, honest, weight, history):
        crafted = self.crafted(reducer, t, honest, history).to(honest.device)
        me = reducer.node.peer_id
        sent = crafted.clone()
        for chunks, owners in reducer.placement.shards(self.members, t):
            if any(self._flagged_twice(reducer.topic, owner, me) for owner in owners):
                for lo, hi in chunks:
                    sent[lo:hi] = honest[lo:hi]
        return sent, weight

    def _flagged_twice(self, topic: str, owner: str, me: str) -> bool:
        theirs = self.board.reducers.get((topic, owner)) if self.board is not None else None
        if theirs is None:
            return False
        recent = list(theirs.screening._watch._recent.get(me, ()))  # an omniscient attacker reads it
        return len(recent) >= 2 and all(flagged for _, flagged in recent[-2:])


ATTACKS: dict[str, Callable[[], Attack]] = {
    "sign_flip": lambda: SignFlip("sign_flip"),
    "scale": lambda: Scale("scale"),
    "noise": lambda: Noise("noise"),
    "nan": lambda: NotFinite("nan"),
    "alie": lambda: Alie("alie"),
    "ipm": lambda: InnerProduct("ipm"),
    "weight": lambda: Overweight("weight"),
    "zeros": lambda: Zeros("zeros", poisons=False),
    "replay": lambda: Replay("replay"),
    "lying_owner": lambda: LyingOwner("lying_owner"),
    "quorum_leader": lambda: QuorumLeader("quorum_leader", needs="quorum"),
    "slander": lambda: Slander("slander", poisons=False),
    "collude": lambda: Collude("collude"),
    "collude_skip": lambda: ColludeSkip("collude_skip"),
}
NEEDS_BOARD = ("alie", "ipm", "collude", "collude_skip")


def make(name: str) -> Attack:
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    return ATTACKS[name]()


def on_every_protocol(name: str, seed: int = 0) -> Attack:
    """Apply attack `name` to every protocol this process builds (`Trainer.create_protocol`):
    for a process that is wholly an attacker, such as a `starling node start` run by a test."""
    from starling.runtime.trainer import Trainer

    attack = make(name)
    create = Trainer.create_protocol

    def create_and_attack(self: Any, *args: Any, **kwargs: Any) -> Any:
        proto = create(self, *args, **kwargs)
        attack.apply(proto, seed=seed)
        return proto

    Trainer.create_protocol = create_and_attack  # type: ignore[method-assign]
    return attack
