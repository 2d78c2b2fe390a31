"""Fragments of a model and the staggered schedule that syncs them (Streaming DiLoCo).

Split. The model's trainable parameters, in order, form one flat vector of N values
(`FlatModel`). A fragment is a set of runs [lo, hi) of that vector:

    sequential   F runs of N/F values: fragment f is the f-th slice of the network's depth
    strided      F*G runs of N/(F*G) values, run j goes to fragment j mod F, with G about the
                 number of layers per fragment: every fragment spans the whole depth (the
                 paper's "block i to fragment i mod F", which it found to train better)

A run may end inside a layer. The outer step and the merge act coordinate by coordinate, so
nothing depends on runs following layer boundaries, and equal runs make every fragment the
same size: peak bytes per sync are what a fragment costs, so they fall by exactly F.

Schedule (H = sync_every, F = fragments, tau = overlap_steps, stride = H / F; a step number
s counts inner steps done, s = 1 after the first):

    fragment f's k-th sync (k = 0, 1, ...) merges after step   merge(f, k) = k H + (f + 1) stride
    its exchange starts tau steps earlier, after step          send(f, k)  = merge(f, k) - tau
    a round whose send would fall at s <= 0 does not exist     (there is nothing to send yet)

Each fragment syncs once every H steps, one fragment every stride steps. With tau > stride
several fragments are in flight at once; tau < H keeps a fragment from overlapping itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from starling.collectives import shard_bounds

ASSIGNMENTS = ("strided", "sequential")


@dataclass(frozen=True)
class Fragment:
    index: int
    runs: tuple[tuple[int, int], ...]  # [lo, hi) ranges of the model's flat parameter vector

    @property
    def numel(self) -> int:
        return sum(hi - lo for lo, hi in self.runs)


def count_layers(model: nn.Module) -> int:
    """Modules that own trainable parameters directly (a Linear, a LayerNorm, an Embedding);
    a tied parameter counts for its first owner only."""
    seen: set[int] = set()
    layers = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        layers += bool(own)
    return layers


def check_assignment(assignment: str) -> None:
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"fragment_assignment must be one of {', '.join(ASSIGNMENTS)}, got {assignment!r}")


def check_schedule(sync_every: int, fragments: int, overlap_steps: int) -> None:
    """The step schedule's fields (H, F, tau): raises ValueError naming the bad one."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if sync_every % fragments:
        raise ValueError(f"sync_every (H={sync_every}) must be divisible by fragments "
                         f"(F={fragments}): one fragment syncs every H/F steps")
    if overlap_steps < 0:
        raise ValueError(f"overlap_steps must be >= 0, got {overlap_steps}")
    if overlap_steps >= sync_every:
        raise ValueError(f"overlap_steps (tau={overlap_steps}) must be < sync_every "
                         f"(H={sync_every}): a fragment's exchange would still be in flight "
                         "when its next one starts")


def check_overlap_window_share(share: float) -> None:
    if not 0.0 <= share < 1.0:
        raise ValueError(f"overlap_window_share must be in [0, 1) (0: merge overlap_steps after a send), "
                         f"got {share}")


def split_fragments(numel: int, layers: int, fragments: int, assignment: str) -> list[Fragment]:
    """Cut a flat vector of `numel` values into `fragments` fragments of equal size (+-1 run)."""
    check_assignment(assignment)
    groups = 1 if assignment == "sequential" else max(1, layers // fragments)
    if fragments > numel:
        raise ValueError(f"fragments ({fragments}) must not exceed the model's {numel} parameters")
    groups = min(groups, numel // fragments)
    runs = shard_bounds(numel, fragments * groups)
    return [Fragment(f, tuple(runs[f::fragments])) for f in range(fragments)]


class FragmentView:
    """Reads one fragment of a model's parameters as a contiguous float32 vector on their device,
    and writes it back (rounded to the parameters' dtype, from any device)."""

    def __init__(self, params: Sequence[nn.Parameter], fragment: Fragment) -> None:
        self.fragment = fragment
        self.numel = fragment.numel
        # (parameter, start and end inside it, where that piece sits in the fragment vector)
        self._pieces: list[tuple[nn.Parameter, int, int, int]] = []
        starts, offset = [], 0
        for p in params:
            starts.append(offset)
            offset += p.numel()
        at = 0
        for lo, hi in fragment.runs:
            for p, start in zip(params, starts):
                a, b = max(lo, start), min(hi, start + p.numel())
                if a < b:
                    self._pieces.append((p, a - start, b - start, at))
                    at += b - a
        assert at == self.numel

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=torch.float32, device=self._pieces[0][0].device)
        for p, a, b, at in self._pieces:
            out[at:at + b - a].copy_(p.detach().reshape(-1)[a:b])
        return out

    @torch.no_grad()
    def write(self, values: torch.Tensor) -> None:
        for p, a, b, at in self._pieces:
            p.detach().view(-1)[a:b].copy_(values[at:at + b - a])


@dataclass(frozen=True)
class FragmentSchedule:
    """Which fragment starts its exchange, and which merges, after inner step s."""

    sync_every: int  # H
    fragments: int  # F
    overlap_steps: int = 0  # tau

    def __post_init__(self) -> None:
        check_schedule(self.sync_every, self.fragments, self.overlap_steps)

    @property
    def stride(self) -> int:
        """Steps between two consecutive fragment syncs."""
        return self.sync_every // self.fragments

    def merge_step(self, fragment: int, k: int) -> int:
        return k * self.sync_every + (fragment + 1) * self.stride

    def send_step(self, fragment: int, k: int) -> int:
        return self.merge_step(fragment, k) - self.overlap_steps

    def first_round(self, fragment: int) -> int:
        """The fragment's first round that exists (1 when round 0 would send at step <= 0)."""
        return 0 if self.send_step(fragment, 0) >= 1 else 1

    def _round_at(self, s: int) -> tuple[int, int] | None:
        """(fragment, k) whose merge falls at step s, if any (the send need not exist)."""
        if s < self.stride or s % self.stride:
            return None
        j = s // self.stride - 1
        return j % self.fragments, j // self.fragments

    def merging_at(self, s: int) -> tuple[int, int] | None:
        """(fragment, round) to merge after step s."""
        found = self._round_at(s)
        if found is None or self.send_step(*found) < 1:
            return None
        return found

    def sending_at(self, s: int) -> tuple[int, int] | None:
        """(fragment, round) whose exchange starts after step s."""
        if s < 1:
            return None
        return self._round_at(s + self.overlap_steps)

    def in_flight_at(self, s: int) -> list[tuple[int, int]]:
        """Rounds started at or before step s that merge after it, oldest first."""
        return [r for d in range(self.overlap_steps - 1, -1, -1)
                if (r := self.sending_at(s - d)) is not None]


class SyncClock:
    """Time-based inner rounds (`sync_every_s`): fragment f's k-th sync is due at

        due(f, k) = epoch + k W + (f + 1) W / F                  (W = sync_every_s)

    and a peer starts its exchange after the last inner step that ends before it: when one
    more step (its own recent step time) would end past due(f, k). Fast and slow peers thus
    reach a fragment's sync together, each with as many inner steps as fit in its window.
    The epoch is the swarm's: the first peer's first step, which a joiner takes from its
    donor's state (wall-clock time, so peers compare it across hosts with synced clocks).

    The exchange then merges after

        overlap = max(tau, floor(share W / F / step_s))          (share = overlap_window_share)

    of this peer's steps: a round costs about the same time on every peer (a quorum question
    and an all-reduce), so a fixed number of steps hides it on a peer of one speed only. A
    fast peer hides it behind several short steps, a slow one behind about one; share < 1
    merges a fragment before its own next send, W later (the fragment after it, W / F later,
    may start meanwhile: they travel apart)."""

    SMOOTHING = 0.3  # weight of the newest step in the step-time average

    def __init__(self, sync_every_s: float, fragments: int, overlap_steps: int = 0,
                 overlap_window_share: float = 0.0) -> None:
        if not sync_every_s > 0.0 or fragments < 1:
            raise ValueError("sync_every_s must be > 0 and fragments >= 1")
        if overlap_steps < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {overlap_steps}")
        check_overlap_window_share(overlap_window_share)
        self.window_s, self.fragments = sync_every_s, fragments
        self.overlap_steps, self.overlap_window_share = overlap_steps, overlap_window_share
        self.epoch: float | None = None
        self.step_s = 0.0  # recent time between two steps' ends (compute, data, emulated slowness)

    def due(self, fragment: int, k: int) -> float:
        assert self.epoch is not None
        return self.epoch + k * self.window_s + (fragment + 1) * self.window_s / self.fragments

    def started(self, now: float) -> None:
        """A step begins at `now`; the first one fixes the epoch unless a donor's state did."""
        if self.epoch is None:
            self.epoch = now

    def stepped(self, took_s: float) -> None:
        self.step_s = took_s if self.step_s == 0.0 else \
            (1.0 - self.SMOOTHING) * self.step_s + self.SMOOTHING * took_s

    def should_send(self, fragment: int, k: int, now: float) -> bool:
        """Whether fragment f's round k starts now: one more step would end past its time."""
        return now + self.step_s >= self.due(fragment, k)

    def overlap(self) -> int:
        """Steps from an exchange that starts now to its merge (see the class docstring)."""
        if self.overlap_window_share == 0.0 or self.step_s <= 0.0:
            return self.overlap_steps
        fit = self.overlap_window_share * self.window_s / self.fragments / self.step_s
        return max(self.overlap_steps, int(fit))
