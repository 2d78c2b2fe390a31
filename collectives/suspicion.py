"""Accusation from accumulated evidence: every member's running test of every other member's
parts against a reference a minority cannot pull.

The reference of a chunk is the coordinate-wise median of its parts, over a strided sample of
its coordinates (`sample_of`). An owner with a robust aggregator reports, in each chunk's signed
answer, for every contributor c, <part_c, median> and |part_c|^2 over the sample, and
|median|^2 there (`Scores`). Every member receives every chunk's answer, so every member sees the
same signed reports and reaches the same verdicts.

    cos_m(t) = sum_chunks <part_m, med> / sqrt(sum |part_m|^2 * sum |med|^2)   member m, round t
    coherent(t) = median over members m of cos_m(t) >= coherent                   (0.5)
    flag_m(t) = cos_m(t) < strong                      (-0.5: its round's parts point against the median)
             or cos_m(t) < below and coherent(t)       (-0.1: away from it, in a round that agrees)
    S_m(t)   = S_m(t-1) + 1 if flagged (+ 2 if cos_m(t) < strong, -0.5), else max(0, S_m(t-1) - drift)
    accuse m when S_m(t) >= threshold

Why a median: two colluders that send the same large vector against the honest mean pull any
mean-like centre their way (a robust average after clipping, the mean of the others, the
previous round's agreed average, which they pulled the round before), far enough that honest
parts point against it. A coordinate's median moves by one rank per colluder, within the honest
values' spread, so it keeps the honest direction while the colluders are a minority.

A member that poisons some chunks every round, or every round but one in three, pulls its
whole-round cosine below zero in every round it poisons: its statistic climbs whatever pattern
it skips in, across owners and chunks (an owner's own watch sees only its chunks, three rounds
in a row). A part against the median (cosine below -0.5) counts twice: two such rounds accuse.
Poisoning 2 rounds of 3 adds at least 1 + 1 - drift every 3 rounds: accused by round 6 at the
default threshold 4 and drift 0.5, by round 1 when its parts point against the median. The
threshold is 4 and `below` -0.1 (not 0) because two "a little is enough" attackers can shift
the medians enough that an honest member's rounds sit slightly below 0 round after round, and
once below -0.5. An honest member is flagged only where its own round's parts point away
from the honest majority's median, which the benchmark measures (the
false-accusation rate the threshold gives, from the flags honest members got, is stated in
docs/benchmarks.md).

Why a mild flag needs a coherent round: members that train on different data (non-IID shards,
federated users) keep pointing their own ways once the model nears what they agree on. Those
at the edge of the distribution then point a little away from the median round after round,
with no attacker anywhere: in a 4-member swarm on such shards, the two edge members' cosines
fell steadily from 0.4 to -0.12 over 50 rounds, while the two in the middle stayed near 0.65,
and the members were banned. In such a round the typical member's cosine is low (the median of
the four was 0.31), so a cosine a little below zero says nothing about an attack. A minority
cannot make a round incoherent: the median moves by one rank per colluder, so the honest
majority's cosines stay high. The benchmark's honest swarms score a median of 0.9 and more in
most rounds. A part against the median (below `strong`) counts whatever the round.

What it cannot see: a part built to sit inside the honest spread ("a little is enough") scores
like an honest one; recomputation (audits) is what catches it.

Everything here is plain arithmetic on numbers: the reducer feeds it (collectives/reduce.py).
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from starling.node.trust import Evidence

if TYPE_CHECKING:
    from starling.collectives.contributions import Scores
    from starling.node.trust import Trust

log = logging.getLogger(__name__)

SUSPECT = "part.suspect"  # witness evidence: a member whose parts point away from the agreed average
SAMPLE_BUDGET = 1 << 18  # reference values kept per vector at most (1 MiB of float32)


@dataclass(frozen=True)
class SuspicionConfig:
    below: float = -0.1  # a whole-round cosine with the median below this is flagged, in a coherent round
    coherent: float = 0.5  # a round is coherent when its members' median cosine is at least this
    strong: float = -0.5  # below this a round is flagged whatever the others, and counts `strong_weight`
    strong_weight: float = 2.0
    drift: float = 0.5  # what a round without a flag takes off the statistic
    threshold: float = 4.0  # accused at this statistic
    min_members: int = 3  # fewer contributors: a median of too few parts to say anything

    def __post_init__(self) -> None:
        if not -1.0 <= self.strong <= self.below <= 1.0 or not -1.0 <= self.coherent <= 1.0:
            raise ValueError(f"suspicion needs -1 <= strong <= below <= 1 and coherent in [-1, 1], got {self}")


def stride_for(numel: int, budget: int = SAMPLE_BUDGET) -> int:
    """The sample's stride over a vector of `numel` values: at most `budget` values in all."""
    return max(1, math.ceil(numel / budget))


def sample_of(lo: int, hi: int, stride: int) -> slice | None:
    """The sampled offsets within chunk [lo, hi) (every `stride`-th index of the vector); None if none."""
    first = -(-lo // stride) * stride  # the first sampled index >= lo
    return None if first >= hi else slice(first - lo, hi - lo, stride)


def chunk_scores(parts: list[torch.Tensor], within: slice) -> tuple[float, list[tuple[float, float]]]:
    """|median|^2 and each part's (<part, median>, |part|^2) over the sampled offsets, where
    median is the coordinate-wise median of the parts (the lower one for an even count)."""
    sampled = torch.stack([p[within] for p in parts]).to(torch.float64)
    median = sampled.median(dim=0).values
    dots = sampled @ median
    norms = (sampled * sampled).sum(dim=1)
    return float(median @ median), [(float(d), float(n)) for d, n in zip(dots, norms)]


class SuspicionLedger:
    """One member's running test of every contributor (network thread). `add` each chunk's
    reported scores as the chosen answers come back; `close(t)` once round t's answers are in:
    it returns the members whose statistic reached the threshold at round t."""

    def __init__(self, config: SuspicionConfig | None = None, max_peers: int = 4096) -> None:
        self.config = config or SuspicionConfig()
        self.max_peers = max_peers
        self.statistic: dict[str, float] = {}
        self.peak: dict[str, float] = {}  # each member's highest statistic so far
        self.flags: dict[str, int] = {}  # each member's flagged rounds so far
        self.rounds: dict[str, int] = {}  # each member's scored rounds so far
        self._rounds: dict[int, dict[str, list[float]]] = {}  # round -> member -> [dot, part^2, ref^2]
        self.accused: set[str] = set()
        self.history: deque[tuple[int, str, float]] = deque(maxlen=4096)  # (round, member, cos), newest last

    def add(self, t: int, ref_norm2: float, scores: Mapping[str, tuple[float, float]]) -> None:
        if not (math.isfinite(ref_norm2) and ref_norm2 > 0.0) or len(scores) < self.config.min_members:
            return
        sums = self._rounds.setdefault(t, {})
        for member, (dot, norm2) in scores.items():
            if not (math.isfinite(dot) and math.isfinite(norm2) and norm2 >= 0.0):
                continue
            acc = sums.setdefault(member, [0.0, 0.0, 0.0])
            acc[0] += dot
            acc[1] += norm2
            acc[2] += ref_norm2
        while len(self._rounds) > 4:  # rounds never closed (a round that failed) go
            del self._rounds[min(self._rounds)]

    def cosines(self, t: int) -> dict[str, float]:
        sums = self._rounds.get(t, {})
        return {m: d / math.sqrt(p * r) for m, (d, p, r) in sums.items() if p > 0.0 and r > 0.0}

    def close(self, t: int) -> list[str]:
        """Round t's verdict: the members whose statistic reached the threshold now."""
        cos = self.cosines(t)
        self._rounds.pop(t, None)
        c = self.config
        coherent = bool(cos) and statistics.median(cos.values()) >= c.coherent
        crossed = []
        for member, value in cos.items():
            if member not in self.statistic and len(self.statistic) >= self.max_peers:
                continue
            flagged = value < c.strong or (coherent and value < c.below)
            self.history.append((t, member, value))
            before = self.statistic.get(member, 0.0)
            if flagged:
                s = before + (c.strong_weight if value < c.strong else 1.0)
            else:
                s = max(0.0, before - c.drift)
            self.statistic[member] = s
            self.peak[member] = max(s, self.peak.get(member, 0.0))
            self.flags[member] = self.flags.get(member, 0) + flagged
            self.rounds[member] = self.rounds.get(member, 0) + 1
            if s >= c.threshold and member not in self.accused:
                self.accused.add(member)
                crossed.append(member)
        return crossed


class Suspicion:
    """One reducer's side of the test (its topic): the owner's `scores` for a closed group, a
    member's `take` of each chunk answer it chose, and `verdict(t)` once round t's answers are
    in, which accuses, as this member's witness, each member whose statistic reached the
    threshold (every member sees the same signed scores, so the others accuse with it).
    Network thread."""

    def __init__(self, me: str, topic: str, trust: Trust, numel: int, config: SuspicionConfig | None = None) -> None:
        self.me, self.topic, self._trust = me, topic, trust
        self.stride = stride_for(numel)
        self.ledger = SuspicionLedger(config)

    def scores(self, bounds: tuple[int, int], parts: Sequence[torch.Tensor | None]
               ) -> tuple[float, tuple[tuple[float, float], ...]] | None:
        """A closed group's scores, its contributors' parts in contributor order; None with too
        few parts (or one missing), or a chunk with no sampled coordinate."""
        within = sample_of(*bounds, self.stride)
        if within is None or len(parts) < self.ledger.config.min_members or any(p is None for p in parts):
            return None
        ref_norm2, rows = chunk_scores(parts, within)  # type: ignore[arg-type]
        return ref_norm2, tuple(rows)

    def over_bound(self, bounds: tuple[int, int], average: torch.Tensor, scores: Scores, slack: float) -> bool:
        """Whether an average is larger, over the sample, than its signed scores allow. A robust
        average is a convex combination of the parts and their coordinate median (CenteredClip
        from the median), or lies within the parts' range in each coordinate (trimmed mean,
        median), so |average|^2 <= sum of the contributors' |part|^2 over the same coordinates;
        `slack` covers a lossy average codec. An owner that widens the bound by raising a
        contributor's |part|^2 signs a figure that contributor can check (`own_row_wrong`)."""
        within = sample_of(*bounds, self.stride)
        if within is None:
            return False
        values = average.reshape(-1)[within].to(torch.float64)
        return float(values @ values) > slack * sum(n for _, n in scores[1])

    def own_row_wrong(self, bounds: tuple[int, int], mine: torch.Tensor, row: tuple[float, float]) -> bool:
        """Whether the |part|^2 an owner signed for my part is not my part's."""
        within = sample_of(*bounds, self.stride)
        if within is None:
            return False
        values = mine.reshape(-1)[within].to(torch.float64)
        norm2 = float(values @ values)
        return abs(row[1] - norm2) > 1e-6 * max(norm2, 1e-30) + 1e-30

    def take(self, t: int, contributors: Sequence[str],
             scores: tuple[float, tuple[tuple[float, float], ...]] | None) -> None:
        if scores is not None:
            self.ledger.add(t, scores[0], dict(zip(contributors, scores[1])))

    def verdict(self, t: int) -> list[str]:
        accused = []
        for member in self.ledger.close(t):
            key = self._trust.key_of(member)
            if key is None or member == self.me:
                continue
            statistic = self.ledger.statistic.get(member, 0.0)
            log.warning("%s: %s: %s's parts point away from their chunks' median, round after round "
                        "(statistic %.1f at round %d): accused", self.me, self.topic, member, statistic, t)
            self._trust.accuse(Evidence(SUSPECT, member, key, t, {"topic": self.topic,
                                                                  "statistic": round(statistic, 3)}))
            accused.append(member)
        return accused
