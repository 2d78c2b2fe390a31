"""The owner's half of secure aggregation (`collectives/secure.py` tells the whole protocol): a
closed group of masked parts unmasked. The owner tells the round's unmasker whose parts it
holds; the unmasker takes as survivors the members whose parts every group holds, gathers their
secrets from the holders (first the survivors' pair seeds with the dropped, then the shares of
the survivors' seeds), checks them against the commitments the members signed, and passes them
on to the other owners, who check them against the commitments in their own parts. Each owner
then removes the masks from its slice and averages the survivors' sum.

`Unmasking` is a base of `SecureStage`, which holds the state both share (the rounds it keeps,
the shares it holds as a neighbour) and answers the reveal requests (`_on_reveal`).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starling.collectives.accumulator import Verdict
from starling.collectives.bodies import BodyError, GaveUp, Held, Passed, Reveal, Revealed
from starling.collectives.compact import contributor_mask, contributors_of
from starling.collectives.masking import (
    KEEP_ROUNDS,
    RECIPE_TAG,
    RoundState,
    Secrets,
    Unmasked,
    commit,
    round_id,
    share_statement,
)
from starling.collectives.secagg import PRIME, SecAggError, add, combine_shares, neighbours, point_of, prg, sub
from starling.common.faults import fault_point

if TYPE_CHECKING:
    from starling.collectives.accumulator import ShardGroup
    from starling.collectives.secure import SecureAggregation
    from starling.node import Node
    from starling.node.rpc import Refuser

# secure aggregation's logger: the owner's lines read as the stage's (`collectives/secure.py`)
log = logging.getLogger("starling.collectives.secure")

_GONE_POLL_S = 0.25  # how often an owner waiting for the unmasker's secrets checks that it is still alive



class Unmasking:
    """An owner's unmasking of its groups, and the round's unmasker's gathering and passing on of
    the secrets. A base of `SecureStage`, whose `__init__` sets what it reads (below)."""

    node: Node
    topic: str
    config: SecureAggregation
    reveal_topic: str
    reveal_timeout_s: float
    held_wait_s: float
    dropped: int
    _refuse: Refuser
    _owners: Callable[[tuple[str, ...], int], set[str]]
    _resolve: Callable[[bytes], tuple[str, ...] | None]
    _groups: Callable[[tuple[str, ...], int], list[tuple[int, int, tuple[str, ...]]]] | None
    _silent: set[tuple[int, str]]
    _rounds: OrderedDict[bytes, RoundState]
    _latest: int

    async def close(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int, bounds: tuple[int, int],
                    group: ShardGroup) -> tuple[torch.Tensor, dict[str, float] | None, Verdict]:
        """A closed group's average, unmasked with its survivors' revealed shares, as the round
        engine answers it; the group's contributors become the survivors summed. A group that
        cannot be unmasked is counted (`secagg_dropped`) and raises: it has no average. First the
        round's unmasker hears whose parts the group holds (`Held`)."""
        recipes = {sender: signed.recipe for sender, signed in group.signed.items()}
        self._tell_held(t, members, view, i, c, tuple(m for m in members if m in group.received))
        try:
            average, shares, summed = await self.unmask(t, members, view, *bounds, group.received, group.weights,
                                                        recipes)
        except Exception as exc:
            self.dropped += 1
            self._refuse.count("secagg_dropped", f"round {t} chunk {bounds}: {exc}")
            raise
        group.contributors = [s for s in group.contributors if s in summed]
        return average, shares, Verdict()

    async def unmask(self, t: int, members: tuple[str, ...], view: bytes, lo: int, hi: int,
                     parts: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                     recipes: Mapping[str, Any]
                     ) -> tuple[torch.Tensor, dict[str, float] | None, tuple[str, ...]]:
        """The survivors' average over [lo, hi) from their masked parts, with the weights'
        shares and the survivors summed (a part the round's unmasker never got is left out).
        SecAggError when the group cannot be unmasked: it is dropped, nothing of any part is
        learned."""
        rid = round_id(self.topic, t, view)
        k, threshold = self.config.shape(len(members))
        graph = neighbours(members, k, rid)
        alive = tuple(m for m in members if m in parts)
        commits = self._commitments(t, rid, alive, recipes)
        alive, seeds, pair_seeds = await self._secrets(t, members, view, rid, graph, alive, commits, threshold)
        n = hi - lo
        total = np.zeros(n, dtype=np.uint32)
        for member in alive:  # in member order
            add(total, parts[member].contiguous().view(torch.int32).numpy().view(np.uint32))
        for member in alive:
            sub(total, prg(seeds[member], n, rid, offset=lo))
        summed = set(alive)
        for gone in sorted(set(members) - summed):
            for j in graph[gone]:
                if j in summed:  # j added +PRG(s_jd) when gone > j, else -PRG
                    (sub if gone > j else add)(total, prg(pair_seeds[j, gone], n, rid, offset=lo))
        decoded = self.config.codec(len(members)).decode_sum(total, len(alive)).to(torch.float64)
        weight = {m: weights.get(m, 1.0) for m in alive}
        whole = sum(weight.values())
        if whole <= 0.0:
            return torch.zeros(n, dtype=torch.float32), None, alive
        average = (decoded * (self.config.unit / whole)).to(torch.float32)
        shares_out = None if len(set(weight.values())) == 1 else {m: w / whole for m, w in weight.items()}
        return average, shares_out, alive

    def _commitments(self, t: int, rid: bytes, alive: Sequence[str],
                     recipes: Mapping[str, Any]) -> dict[str, tuple[bytes, bytes]]:
        """Each survivor's (seed commitment, digest of its pair-seed hashes), as it signed them
        with its parts (mine from my own round)."""
        commits: dict[str, tuple[bytes, bytes]] = {}
        for member in alive:
            recipe = recipes.get(member)
            if member == self.node.peer_id:
                mine = self._round(rid).mine
                if mine is None:
                    raise SecAggError(f"round {t}: my own secrets are gone")
                recipe = (RECIPE_TAG, mine.seed_commit, hashlib.sha256(b"".join(mine.commits)).digest())
            if not (isinstance(recipe, (tuple, list)) and len(recipe) == 3 and recipe[0] == RECIPE_TAG
                    and all(isinstance(r, bytes) and len(r) == 32 for r in recipe[1:])):
                raise SecAggError(f"{member}'s part carries no secure aggregation commitments")
            commits[member] = (recipe[1], recipe[2])
        return commits

    @property
    def unmask_within_s(self) -> float:
        """How long the unmasker may take after its group closed: waiting for every group's held
        set, then two rounds of asks (pair seeds, then seed shares), each up to a reveal timeout."""
        return self.held_wait_s + 2 * (self.reveal_timeout_s + 1.0)

    def _tell_held(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int,
                   alive: tuple[str, ...]) -> None:
        unmasker = self.unmasker(members, t)
        if unmasker == self.node.peer_id:
            self._note_held(self._round(round_id(self.topic, t, view)), i, c, alive)
        elif self._groups is not None:
            self.node.send(unmasker, self.reveal_topic, Held(t, view, i, c, contributor_mask(members, alive)).to_wire())

    @staticmethod
    def _note_held(state: RoundState, i: int, c: int, alive: tuple[str, ...]) -> None:
        state.held.setdefault((i, c), alive)
        state.arrived.set()
        state.arrived = asyncio.Event()

    def _on_held(self, sender: str, body: Held) -> None:
        """An owner's held set for one of its groups (I am the round's unmasker)."""
        t, view = body.round, body.view
        members = self._resolve(view)
        if members is None or self._groups is None or self.unmasker(members, t) != self.node.peer_id:
            self._refuse.count("secagg_not_unmasker", f"a held set of round {t} from {sender}")
            return
        if not any(i == body.shard and c == body.chunk and sender in owners
                   for i, c, owners in self._groups(members, t)):
            self._refuse.count("secagg_not_owner", f"a held set of round {t} from {sender}, which owns no such group")
            return
        try:
            alive = contributors_of(members, body.alive)
        except ValueError as exc:
            self._refuse.count("secagg_malformed", f"a held set from {sender}: {exc}")
            return
        if t < self._latest - KEEP_ROUNDS or t > self._latest + KEEP_ROUNDS:
            self._refuse.count("secagg_stale", f"a held set of round {t} from {sender}")
            return
        # (it may come before I masked in the round myself: an owner closed its group first)
        self._note_held(self._round(round_id(self.topic, t, view)), body.shard, body.chunk, alive)

    async def _held_by_all(self, t: int, members: tuple[str, ...], state: RoundState,
                           alive: tuple[str, ...]) -> tuple[str, ...]:
        """The unmasker's survivors: those of `alive` whose parts every group of the round holds,
        once every live owner said (or `held_wait_s` passed). A member whose part reached some
        owners and not others (it died in the middle of sending) is then dropped at every owner
        alike, and no holder is asked to call one member both alive and dropped."""
        if self._groups is None:
            return alive
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.held_wait_s
        groups = self._groups(members, t)
        while True:
            live = {*self.node.live_peers_here(), self.node.peer_id}  # an owner found dead meanwhile says nothing
            missing = [(i, c) for i, c, owners in groups if (i, c) not in state.held and any(o in live for o in owners)]
            if not missing:
                break
            left = deadline - loop.time()
            if left <= 0:
                log.info("%s: %s round %d: %d groups did not say whose parts they hold", self.node.peer_id,
                         self.topic, t, len(missing))
                break
            try:
                await asyncio.wait_for(state.arrived.wait(), min(left, _GONE_POLL_S))
            except asyncio.TimeoutError:
                pass
        held = [set(s) for s in state.held.values()]
        return tuple(m for m in alive if all(m in s for s in held))

    def unmasker(self, members: tuple[str, ...], t: int) -> str:
        """The owner that gathers round t's secrets from the holders and passes them on to the
        other owners (who check them against the commitments in their own parts): one owner
        asks, not every one. Rotates with the round."""
        owners = sorted(self._owners(members, t))
        return owners[t % len(owners)]

    async def _secrets(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                       graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                       commits: Mapping[str, tuple[bytes, bytes]], threshold: int) -> Unmasked:
        """The survivors I sum, their mask seeds and their pair seeds with the dropped: from the
        round's unmasker when it saw the same survivors or fewer (checked here), else gathered
        from the holders."""
        me, key = self.node.peer_id, alive
        state = self._round(rid)
        known = state.secrets.get(key)
        if known is not None:
            return known
        unmasker = self.unmasker(members, t)
        if unmasker == me:
            key = alive = await self._held_by_all(t, members, state, alive)
            known = state.secrets.get(key)
            if known is not None:
                return known
        else:
            passed = await self._passed_on(state, alive, self.unmask_within_s + self.reveal_timeout_s, unmasker)
            if passed is not None:
                used, body = passed
                checked = self._check_passed(t, rid, graph, used, commits, body)
                if checked is not None:
                    state.secrets[key] = (used, *checked)
                    return state.secrets[key]
        try:
            used, seeds, pair_seeds = state.secrets[key] = await self._gather(t, members, view, rid, graph, alive,
                                                                              commits, threshold)
        except SecAggError:
            if unmasker == me:  # the other owners would wait out my deadline for secrets that never come
                self._give_up(t, members, view)
            raise
        if unmasker == me:
            fault_point("secure.unmasker.gathered", t)
            self._pass_on(t, members, view, rid, used, (seeds, pair_seeds), graph)
        return state.secrets[key]

    async def _passed_on(self, state: RoundState, alive: tuple[str, ...], timeout_s: float,
                         unmasker: str) -> tuple[tuple[str, ...], Passed] | None:
        """The unmasker's secrets for my survivors, or for the most of them it saw: a member
        whose part reached me and not every owner is left out of my sum too (its neighbours
        revealed its pair seeds, and will not reveal its seed's shares now). None once the
        unmasker is gone, or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        mine = set(alive)
        while True:
            fits = [(seen, body) for seen, body in state.passed.items() if set(seen) <= mine]
            if fits:
                return max(fits, key=lambda f: len(f[0]))
            left = deadline - loop.time()
            if left <= 0 or state.gave_up or unmasker not in self.node.live_peers_here():
                return None
            try:
                await asyncio.wait_for(state.arrived.wait(), min(left, _GONE_POLL_S))
            except asyncio.TimeoutError:
                pass

    def _pass_on(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes, alive: tuple[str, ...],
                 found: Secrets, graph: Mapping[str, tuple[str, ...]]) -> None:
        seeds, pairs = found
        lists = {j for j, _ in pairs}
        state = self._round(rid)
        body = Passed(t, view, contributor_mask(members, alive), tuple((m, seeds[m]) for m in alive),
                      tuple((j, d, s) for (j, d), s in sorted(pairs.items())),
                      tuple((j, tuple(state.lists[j])) for j in sorted(lists) if j in state.lists)).to_wire()
        for owner in sorted(self._owners(members, t) - {self.node.peer_id}):
            self.node.send(owner, self.reveal_topic, body)

    def _give_up(self, t: int, members: tuple[str, ...], view: bytes) -> None:
        body = GaveUp(t, view).to_wire()
        for owner in sorted(self._owners(members, t) - {self.node.peer_id}):
            self.node.send(owner, self.reveal_topic, body)

    def _on_gave_up(self, sender: str, body: GaveUp) -> None:
        members = self._resolve(body.view)
        if members is None or sender != self.unmasker(members, body.round):
            self._refuse.count("secagg_not_unmasker", f"a gave-up notice of round {body.round} from {sender}")
            return
        state = self._rounds.get(round_id(self.topic, body.round, body.view))
        if state is None:  # not a round of mine: nothing waits on it, and nothing is made for it
            self._refuse.count("secagg_stale", f"a gave-up notice of round {body.round} from {sender}")
            return
        state.gave_up = True
        state.arrived.set()
        state.arrived = asyncio.Event()

    def _on_passed(self, sender: str, body: Passed) -> None:
        t, view, mask = body.round, body.view, body.alive
        members = self._resolve(view)
        if members is None or sender != self.unmasker(members, t):
            self._refuse.count("secagg_not_unmasker", f"secrets of round {t} passed on by {sender}")
            return
        try:
            alive = contributors_of(members, mask)
        except ValueError as exc:
            self._refuse.count("secagg_malformed", f"secrets passed on by {sender}: {exc}")
            return
        rid = round_id(self.topic, t, view)
        state = self._rounds.get(rid)  # a round I masked in (every owner did): passes for others make nothing
        if state is None:
            self._refuse.count("secagg_stale", f"secrets of round {t} passed on by {sender}: not a round of mine")
            return
        if len(state.passed) < 8:
            state.passed[alive] = body
        state.arrived.set()
        state.arrived = asyncio.Event()

    def _check_passed(self, t: int, rid: bytes, graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                      commits: Mapping[str, tuple[bytes, bytes]], body: Passed) -> Secrets | None:
        """The unmasker's secrets if every one keeps the commitment its member signed; None
        (counted) if any does not, or some are missing."""
        try:
            seeds = dict(body.seeds)
            pairs = {(j, d): s for j, d, s in body.pairs}
            lists = {j: list(h) for j, h in body.lists}
            if set(seeds) != set(alive) or any(commit(seeds[m], rid) != commits[m][0] for m in alive):
                raise ValueError("a seed that breaks its commitment")
            for j, hashes_ in lists.items():
                if hashlib.sha256(b"".join(hashes_)).digest() != commits[j][1]:
                    raise ValueError(f"{j}'s pair-seed hashes break its commitment")
            dropped = set(graph) - set(alive)
            wanted = {(j, d) for d in dropped for j in graph[d] if j in seeds}
            if set(pairs) != wanted:
                raise ValueError("not the pair seeds of the dropped")
            for (j, d), seed in pairs.items():
                if hashlib.sha256(seed).digest() != lists[j][graph[j].index(d)]:
                    raise ValueError(f"a wrong pair seed of {j} with {d}")
        except Exception as exc:
            self._refuse.count("secagg_bad_passed", f"round {t}: the unmasker's secrets: {exc}")
            return None
        return seeds, pairs

    async def _gather(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                      graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                      commits: Mapping[str, tuple[bytes, bytes]], threshold: int,
                      retry: bool = True) -> Unmasked:
        """First every survivor's pair seeds with its dropped neighbours (`_pairs_of_dropped`: a
        survivor that cannot give them, dead since its part came, is dropped too), then the
        survivors' shares of their surviving neighbours' seeds; rebuild and check them. Returns
        the survivors summed (those whose seed could be rebuilt) with the secrets."""
        alive, pair_seeds = await self._pairs_of_dropped(t, members, view, rid, graph, alive, commits)
        dropped = set(members) - set(alive)
        asks = {j: [n for n in graph[j] if n in alive] for j in alive}
        replies = await asyncio.gather(*(self._ask(j, t, view, seeds, ()) for j, seeds in asks.items()))
        shares: dict[str, dict[int, tuple[str, int, bytes]]] = {}  # dealer -> x -> (holder, y, signature)
        for j, reply in zip(alive, replies):
            if reply is None:
                continue
            for dealer, x, y, sig in reply.shares:
                if dealer not in asks[j] or x != point_of(j, members) or not 0 <= y < PRIME:
                    self._refuse.count("secagg_bad_share", f"round {t}: {j} revealed a share of {dealer} it "
                                       "does not hold")
                    continue
                shares.setdefault(dealer, {})[x] = (j, y, sig)
        short = [m for m in alive if len(shares.get(m, {})) < threshold]
        if short and retry and len(short) < len(alive):
            # Its shares never reached enough holders (it died mid-send), or they gave its pair seeds
            # to an owner that did not get its part: leave its part out, and unmask it as a dropout's.
            log.info("%s: %s round %d: too few shares of %s; summing without", self.node.peer_id, self.topic, t, short)
            left = tuple(m for m in alive if m not in short)
            return await self._gather(t, members, view, rid, graph, left, commits, threshold, retry=False)
        seeds = {m: self._rebuild(t, rid, m, shares.get(m, {}), threshold, commits[m][0]) for m in alive}
        for gone in dropped:
            for j in graph[gone]:
                if j in seeds and (j, gone) not in pair_seeds:
                    raise SecAggError(f"round {t}: {j} did not reveal its mask seed with dropped {gone}")
        return alive, seeds, pair_seeds

    async def _pairs_of_dropped(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                                graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                                commits: Mapping[str, tuple[bytes, bytes]]
                                ) -> tuple[tuple[str, ...], dict[tuple[str, str], bytes]]:
        """Each survivor's pair seeds with its dropped neighbours, checked against its signed
        hashes. Only a survivor can give them: one that does not (it died after its part came,
        before the unmasking) is dropped as well, its part left out, and its own surviving
        neighbours are asked for their pair seeds with it, until every survivor has answered.
        No seed share is asked for before this ends, so no holder is asked to call a member
        alive that then turns out dropped."""
        state = self._round(rid)
        pair_seeds: dict[tuple[str, str], bytes] = {}
        for _ in range(len(members)):  # each pass drops at least one survivor, or ends
            dropped = set(members) - set(alive)
            asks = {j: [d for d in graph[j] if d in dropped and (j, d) not in pair_seeds] for j in alive}
            asks = {j: pairs for j, pairs in asks.items() if pairs}
            if not asks:
                break
            self._silent = {(r, j) for r, j in self._silent if r >= t - KEEP_ROUNDS}
            replies = await asyncio.gather(*(self._ask(j, t, view, (), pairs) for j, pairs in asks.items()))
            silent = []
            for j, reply in zip(asks, replies):
                if reply is None:
                    if (t, j) in self._silent:  # no answer at all: gone (a refusal drops the group below)
                        silent.append(j)
                    continue
                hashes_ = list(reply.commits)
                if hashlib.sha256(b"".join(hashes_)).digest() != commits[j][1] or len(hashes_) != len(graph[j]):
                    self._refuse.count("secagg_bad_seed", f"round {t}: {j}'s pair-seed hashes break its commitment")
                    continue
                index = {n: h for n, h in zip(graph[j], hashes_)}
                for d, seed in reply.pairs:
                    if d not in asks[j] or hashlib.sha256(seed).digest() != index.get(d):
                        self._refuse.count("secagg_bad_seed", f"round {t}: {j} revealed a wrong mask seed for {d}")
                        continue
                    pair_seeds[j, d] = seed
                state.lists[j] = hashes_  # what the other owners check my passed pair seeds against
            if not silent:
                break
            log.info("%s: %s round %d: %s gave no pair seeds (gone since its part came): summing without",
                     self.node.peer_id, self.topic, t, silent)
            alive = tuple(m for m in alive if m not in silent)
            pair_seeds = {(j, d): seed for (j, d), seed in pair_seeds.items() if j in alive}
        return alive, pair_seeds

    def _rebuild(self, t: int, rid: bytes, member: str, got: dict[int, tuple[str, int, bytes]], threshold: int,
                 commitment: bytes) -> bytes:
        """A survivor's mask seed from t of the shares its neighbours revealed. The seed it
        committed to in its signed parts says whether they were right; only when it is not
        are the shares' signatures checked, and those not signed by the member (tampered by
        their holder) counted and left out before trying again."""
        if len(got) < threshold:
            raise SecAggError(f"round {t}: {len(got)} shares of {member}'s mask seed came, it needs {threshold}")
        seed = _rebuilt(combine_shares({x: y for x, (_, y, _) in got.items()}, threshold))
        if seed is not None and commit(seed, rid) == commitment:
            return seed
        good = {}
        for x, (holder, y, sig) in got.items():
            if self.node.trust.verify(member, share_statement(rid, member, holder, x, y), sig):
                good[x] = y
            else:
                self._refuse.count("secagg_bad_share", f"round {t}: {holder} revealed a share of {member}'s seed "
                                   f"that {member} did not sign: tampered")
        if len(good) >= threshold and len(good) < len(got):
            seed = _rebuilt(combine_shares(good, threshold))
            if seed is not None and commit(seed, rid) == commitment:
                return seed
        self._refuse.count("secagg_bad_seed", f"round {t}: {member}'s seed rebuilt from its shares breaks its "
                           "commitment")
        raise SecAggError(f"round {t}: {member}'s mask seed rebuilt from its shares breaks its commitment")

    async def _ask(self, holder: str, t: int, view: bytes, seeds: Sequence[str],
                   pairs: Sequence[str]) -> Revealed | None:
        """The holder's answer; None if it refused or gave none (`_silent` holds the latter)."""
        ask = Reveal(t, view, tuple(seeds), tuple(pairs))
        try:
            if holder == self.node.peer_id:
                reply = await self._on_reveal(holder, ask)
            else:
                reply = (await self.node.arequest(holder, self.reveal_topic, ask.to_wire(),
                                                  timeout_s=self.reveal_timeout_s + 1.0)).body
            return Revealed.from_wire(reply)
        except BodyError as exc:  # a refusal, or an answer that is not one: its shares are missing
            if isinstance(reply, dict) and reply.get("ok") is not False:
                self._refuse.count("secagg_malformed", f"round {t}: {holder}'s reveal: {exc}")
            log.info("%s: %s round %d: %s revealed nothing: %s", self.node.peer_id, self.topic, t, holder, exc)
        except Exception as exc:  # a survivor that died since: its shares are missing, no more
            log.info("%s: %s round %d: %s revealed nothing: %s", self.node.peer_id, self.topic, t, holder, exc)
            self._silent.add((t, holder))
        return None


def _rebuilt(value: int) -> bytes | None:
    return value.to_bytes(32, "big") if value < 2**256 else None
