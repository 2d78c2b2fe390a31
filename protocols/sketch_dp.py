"""`sketch-dp`: peers send a random sketch of their update with Gaussian noise calibrated to
a privacy budget (Song et al., ICML 2023; count sketches as in FetchSGD, Rothchild et al. 2020).

    R_t = sketch map from (swarm seed, t)              # every peer rebuilds the same R_t, fresh each round
    peer unit:   y = clip_C(R_t grad L(batch))                     # a peer's whole contribution
      or, H = local_steps > 1: H local SGD steps from x_t on my batches to x_local,
                 y = clip_C(R_t (x_t - x_local) / lr)              # the delta, in gradient units
    sample unit: B ~ Poisson(q) over my N samples                  # torch.func per-sample grads
                 y = sum_{i in B} clip_C(R_t grad l_i)
    y += N(0, sigma^2 C^2 I)                           # clipping in sketch space: sensitivity C for any R_t
    y /= q N                                           # sample unit: the mean over the expected batch
    Y = mean of y over live peers                      # sketches are linear: sharded all-reduce (collectives/reduce.py)
    g = R_t^T Y                                        # gsketch, or a one-row count sketch: unbiased
      | top_K(e + median_t(Y)), e <- rest              # countsketch:RxC,heavy=K: heavy hitters with
                                                       #   error accumulation (FetchSGD)
    optimizer.step(g)                                  # from x_t; post-processing: momentum costs no privacy
    accountant.step(sigma, q); report epsilon(delta)   # Opacus RDP or PRV (protocols/privacy.py)

A round t spans `local_steps` calls of `step`; only its last one releases y, so the accountant
counts one release per round, and `budget_steps` (training steps, as `--steps`) plans for
budget_steps // local_steps releases. With local_steps = 1 the update is the gradient.

Only y, clipped and noised, leaves a peer, and each peer adds its own noise, so the epsilon
reported protects a peer's data (peer unit) or any one of its samples (sample unit) even from
the owners that sum its sketch. Everything after the all-reduce is post-processing that every
peer computes identically (and within a round a peer serves joiners x_t, never its local
steps). Given `target_epsilon` and `budget_steps` instead of `noise_multiplier`, sigma is
solved for with Opacus. Without either there is no noise and no privacy (epsilon is inf);
the protocol says so.

The sample unit needs the peer's private data set: `attach_task(task, rank, world, seed)`
(or `attach_data`) before the first step (the runner behind `starling simulate` and `starling
node start` calls any protocol's `attach_task`); its batches are drawn here by Poisson sampling and
`step`'s closure is only used to report a loss when a batch comes out empty.

Buffers (BatchNorm statistics) stay each peer's own: averaging them would release statistics
of its data outside the privacy accounting.

Every peer holds the same x_t (and optimizer state, and FetchSGD's error), so the drift guard
of allreduce applies (`guard.py`): every `check_every` rounds the members compare digests of
x_t, and one that drifted takes the public state a majority holds. Both are post-processing of
released means, so the check costs no privacy.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from starling.collectives import ShardedReducer, membership
from starling.common.text import few
from starling.compressors import CountSketch, GaussianSketch, from_spec, rng
from starling.node.node import Node
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import (
    MAX_OWNERS,
    MIN_SHARD_NUMEL,
    DivergedError,
    LossFn,
    ProtocolConfig,
    ProtocolError,
    StepReport,
    register,
)
from starling.protocols.optim import check_reduce_config, make_defences, make_secure, reduce_timeouts
from starling.protocols.privacy import (
    MECHANISMS,
    UNITS,
    Accountant,
    PrivacyReport,
    PrivateData,
    clip_rows_,
    gaussian_noise,
    per_sample_grads,
    secret_generator,
    solve_noise_multiplier,
)

log = logging.getLogger(__name__)

PART_TOPIC = "sketchdp.part"


@dataclass(frozen=True)
class SketchDPConfig(ProtocolConfig):
    sketch: str = "countsketch:1x4096,hash=shift"  # countsketch:RxC[,heavy=K][,hash=shift] | gsketch:S[,kind=srht]
    clip: float = 1.0  # C: L2 bound in sketch space (inf: no clipping, only without noise)
    noise_multiplier: float | None = None  # sigma; noise std is sigma * C
    target_epsilon: float | None = None  # instead of sigma: spend this over budget_steps steps
    delta: float = 1e-5
    dp_unit: str = "peer"  # peer | sample
    accountant: str = "rdp"  # rdp | prv (Opacus)
    budget_steps: int = 0  # training steps the target epsilon is planned for (needed with target_epsilon)
    local_steps: int = 1  # H: local SGD steps per round, whose delta is released (1: the gradient; peer unit)
    sample_rate: float = 0.01  # sample unit: Poisson rate q
    dataset_size: int = 6400  # sample unit: samples of the peer's stream kept as its private data
    seed: int = 0  # swarm seed: R_t is derived from (seed, t)
    optimizer: str = "sgd"  # sgd | adamw, on the unsketched mean
    momentum: float = 0.0
    weight_decay: float = 0.0
    reply_grace_s: float = 2.0
    retry_interval_s: float = 0.05
    max_owners: int = MAX_OWNERS  # the most owners a round's shards have (drawn from its members)
    min_shard_numel: int = MIN_SHARD_NUMEL  # the fewest values a shard holds (fewer owners for a small model)
    check_every: int = 100  # rounds between drift checks of x_t (guard.py), round 0 first; 0: never
    # Against members that cannot be trusted (collectives/defences.py, docs/security.md): how an
    # owner combines the parts (mean | centered_clip | trimmed_mean | median, with parameters:
    # "centered_clip:tau=1.5,iters=3"), and how many owners each shard has (2 or 3: members compare
    # their signed averages; parts cost that many times the bytes)
    aggregator: str = "mean"
    owner_replication: int = 1
    # With one owner per shard: the share of each round's chunks that members drawn after the
    # round check, averaging the owner's signed parts again (collectives/checking.py); 0: off.
    # An owner caught is banned on that one check. Costs about this share of the vector in bytes.
    check_rate: float = 0.0
    # Secure aggregation (collectives/secure.py, docs/security.md): "on" masks every part so that
    # an owner learns only the sum of its shard ("on:scale=0,clip=8,threshold=0.5"; scale 0 fits each round); needs
    # compressor "none", the plain mean and one owner per shard; "off": parts in the clear
    secure_aggregation: str = "off"
    # Where the noise is added: "local", each peer's release carries all of it (N(0, sigma^2 C^2));
    # "distributed" (needs secure_aggregation): each of n members adds a discrete Gaussian share
    # of variance sigma^2 C^2 / n to its integers, so that only the sum carries the full noise
    # (Kairouz et al. 2021): the same epsilon for the sum, sqrt(n) less noise in the mean
    dp_noise: str = "local"

    def __post_init__(self) -> None:
        sketch_codec(self.sketch)
        if self.dp_noise not in ("local", "distributed"):
            raise ValueError(f"dp_noise must be 'local' or 'distributed', got {self.dp_noise!r}")
        if self.dp_noise == "distributed" and self.secure_aggregation == "off":
            raise ValueError("dp_noise='distributed' needs secure_aggregation: without it an owner sees each "
                             "member's part with only its share of the noise")
        if self.check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {self.check_every}")
        if not self.clip > 0.0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("give noise_multiplier or target_epsilon, not both")
        if self.noise_multiplier is not None and not 0.0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be >= 0 and finite, got {self.noise_multiplier}")
        if self.target_epsilon is not None:
            if not 0.0 < self.target_epsilon < math.inf:
                raise ValueError(f"target_epsilon must be > 0 and finite, got {self.target_epsilon}")
            if self.budget_steps < self.local_steps:
                raise ValueError(f"target_epsilon needs budget_steps >= local_steps ({self.local_steps}): the "
                                 f"training steps the budget is spread over, got {self.budget_steps}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if math.isinf(self.clip) and (self.target_epsilon is not None or (self.noise_multiplier or 0.0) > 0.0):
            raise ValueError("clip must be finite when there is noise (its std is sigma * clip)")
        if self.dp_unit not in UNITS:
            raise ValueError(f"dp_unit must be one of {', '.join(UNITS)}, got {self.dp_unit!r}")
        if self.accountant not in MECHANISMS:
            raise ValueError(f"accountant must be one of {', '.join(MECHANISMS)}, got {self.accountant!r}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {self.dataset_size}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if self.local_steps > 1 and self.dp_unit != "peer":
            # a delta mixes every sample of H batches: one sample's sensitivity is no longer C
            raise ValueError("local_steps > 1 needs dp_unit='peer' (per-sample clipping bounds a gradient, "
                             "not a delta of several local steps)")
        if self.local_steps > 1 and not self.lr > 0.0:
            raise ValueError(f"local_steps > 1 needs lr > 0 (the delta is released in units of lr), got {self.lr}")
        check_reduce_config(self)

    @property
    def rate(self) -> float:
        """q for the accountant: every peer takes part in every round under the peer unit."""
        return self.sample_rate if self.dp_unit == "sample" else 1.0

    @property
    def budget_rounds(self) -> int:
        """Releases the target epsilon is planned for: one per round of local_steps steps."""
        return self.budget_steps // self.local_steps


def sketch_codec(spec: str) -> CountSketch | GaussianSketch:
    codec = from_spec(spec)
    if not isinstance(codec, (CountSketch, GaussianSketch)) or codec.inner is not None:
        raise ValueError(f"sketch must be countsketch:RxC[,...] or gsketch:S[,...] with no next stage, got {spec!r}")
    return codec


class SketchMap:
    """R_t for one model size: sketch a batch of vectors, unsketch a (mean) sketch."""

    DENSE_MAX = 1 << 24  # a Gaussian R_t up to this many entries is drawn once per round, not twice

    def __init__(self, spec: str, numel: int) -> None:
        self.codec = sketch_codec(spec)
        self.numel = numel
        if isinstance(self.codec, GaussianSketch):
            self.size, self.heavy = self.codec.sketch_size(numel), 0
        else:
            rows, cols = self.codec.size
            self.size, self.heavy = rows * cols, self.codec.heavy
        self._dense: tuple[int, torch.Tensor] | None = None

    def _matrix(self, seed: int) -> torch.Tensor | None:
        if not (isinstance(self.codec, GaussianSketch) and self.codec.kind == "gauss"
                and self.size * self.numel <= self.DENSE_MAX):
            return None
        if self._dense is None or self._dense[0] != seed:
            self._dense = (seed, self.codec.matrix(self.numel, seed))
        return self._dense[1]

    def sketch(self, matrix: torch.Tensor, seed: int) -> torch.Tensor:
        """(B, n) -> (B, size) with one R_t for every row."""
        dense = self._matrix(seed)
        if dense is not None:
            return matrix.detach().to(torch.float32) @ dense.T
        return self.codec.sketch_rows(matrix, seed).reshape(matrix.shape[0], self.size)

    def unsketch(self, y: torch.Tensor, seed: int) -> torch.Tensor:
        """R^T y (Gaussian/SRHT; one-row count sketch), or the median of rows' estimates."""
        dense = self._matrix(seed)
        if dense is not None:
            return dense.T @ y
        if isinstance(self.codec, GaussianSketch):
            return self.codec.unsketch(y, self.numel, seed)
        return self.codec.unsketch(y.view(self.codec.size), self.numel, seed)


@register
class SketchDP(BackpropProtocol, name="sketch-dp", config_class=SketchDPConfig, topic_prefix="sketchdp."):
    config: SketchDPConfig
    replicas_agree = True

    def __init__(self, node: Node, model: nn.Module, config: SketchDPConfig) -> None:
        super().__init__(node, model, config)
        self.sketches = SketchMap(config.sketch, self.flat.numel)
        self.accountant = Accountant(config.accountant)
        self.sigma = self._noise_multiplier()
        self.error = torch.zeros(self.flat.numel) if self.sketches.heavy else None  # public: from means only
        # x_t, where this round's local steps started (public: every peer holds the same)
        self.anchor = self.flat.read_params() if config.local_steps > 1 else None
        self.data: PrivateData | None = None
        self.last_release: torch.Tensor | None = None  # what this peer last sent, clipped and noised (bar a share)
        self._secret = secret_generator()
        self._warned_budget = False
        self.reducer = ShardedReducer(node, PART_TOPIC, self.sketches.size, config.compressor,
                                      reduce_timeouts(config), self.is_open, min_shard_numel=config.min_shard_numel,
                                      defences=make_defences(config, 1.0), secure=make_secure(config, 1.0),
                                      max_owners=config.max_owners, unaveraged=0.0)
        self.reducers = [self.reducer]
        self.guard = self._drift_guard("sketchdp.")
        self._serve()
        log.info("%s: sketch-dp, %s-level DP, sigma=%.4g, C=%g, delta=%g, sketch %s (%d of %d values)%s",
                 node.peer_id, config.dp_unit, self.sigma, config.clip, config.delta, config.sketch,
                 self.sketches.size, self.flat.numel, "" if self.sigma > 0 else ": NO NOISE, epsilon = inf")

    def _noise_multiplier(self) -> float:
        c = self.config
        if c.target_epsilon is None:
            return float(c.noise_multiplier or 0.0)
        try:
            return solve_noise_multiplier(c.target_epsilon, c.delta, c.rate, c.budget_rounds, c.accountant)
        except ValueError as exc:  # Opacus: "The privacy budget is too low."
            raise ProtocolError(f"sketch-dp: cannot reach epsilon={c.target_epsilon} at delta={c.delta} "
                                f"in {c.budget_rounds} rounds: {exc}") from None

    # ------------------------------------------------------------------ private data (sample unit)
    def attach_data(self, data: PrivateData) -> None:
        self.data = data

    def attach_task(self, task: Any, rank: int, world: int, seed: int) -> None:
        """Keep `dataset_size` samples of peer `rank`'s stream as its private data set (sample
        unit; the peer unit trains on the batches `step` is given and keeps nothing)."""
        if self.config.dp_unit != "sample":
            return
        try:
            self.attach_data(PrivateData.from_task(task, rank, world, seed, self.config.dataset_size))
        except ValueError as exc:
            raise ProtocolError(f"sketch-dp: dp_unit='sample' cannot use this task: {exc}") from None

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        clock = self._begin_step()
        s, c = self.step_count, self.config
        with clock.computing():
            if c.local_steps > 1:
                loss = self._local_step(loss_fn)
                if (s + 1) % c.local_steps:  # mid-round: nothing leaves this peer (its bytes are the round's)
                    self.step_count = s + 1
                    spent = clock.wall_s
                    return StepReport(step=s, loss=loss, wall_s=spent, compute_s=spent)
            t = s // c.local_steps  # the round: one R_t, one release
            seed_t = rng.derive_seed(c.seed, t)
            if c.local_steps > 1:
                y = self._release(self.sketches.sketch(self._local_delta().unsqueeze(0), seed_t))
            else:
                y, loss = self._private_sketch(loss_fn, seed_t)
            if not bool(torch.isfinite(y).all()):  # owners would refuse it and the round would stall
                raise DivergedError(f"sketch-dp: non-finite update at step {s} (training diverged; lower lr or clip)")
            self.last_release = y.clone()

        members = membership(self.node)
        share = 0.0  # distributed noise: my share of the sum's, added to my integers in the ring
        if self.distributed and self.sigma > 0.0:
            if len(members) <= 1:  # alone, nobody sums it: all the noise is mine to add
                y.add_(gaussian_noise(y.numel(), self.sigma * c.clip / self._per_release, self._secret))
            else:
                share = self.sigma * c.clip / math.sqrt(len(members)) / self._per_release
        # y becomes the mean of the peers' sketches
        # x_t, which every member should hold alike (local steps move the parameters off it)
        state = self._round_state(t) if self.anchor is None and len(members) > 1 else None
        result = self.reducer.start(t, members, y, lend=True, noise_std=share, state=state).wait()
        if result.ahead > t:
            log.info("%s: sketch-dp round %d was late; catching up to round %d", self.node.peer_id, t, result.ahead)
            self.step_count = result.ahead * c.local_steps
        with clock.computing():
            self.flat.scatter_grads(self._unsketch(y, seed_t))
            self.optimizer.step()
            if self.anchor is not None:
                self.flat.read_params(self.anchor)
            self.accountant.step(self._released_sigma(members, result), c.rate)
            self._check_budget()
        if self.guard is not None:
            self.guard.after_round(t, members, result)  # on x_{t+1}, which every peer holds
        self.step_count = max(self.step_count, s + 1)
        if result.lost:
            log.warning("%s: sketch-dp round %d went on without %s", self.node.peer_id, t, few(result.lost))
        return self._report(s, loss, clock, synced=result.synced, peers=result.peers, lost=result.lost,
                            diverged=result.diverged)

    def _private_sketch(self, loss_fn: LossFn, seed: int) -> tuple[torch.Tensor, float]:
        """This peer's release for the round: clipped in sketch space, then noised."""
        c = self.config
        if c.dp_unit == "peer":
            value = self._backprop(loss_fn)
            rows = self.sketches.sketch(self.flat.gather_grads().unsqueeze(0), seed)
        else:
            if self.data is None:
                raise ProtocolError("sketch-dp: dp_unit='sample' needs the peer's private data: call "
                                    "attach_task(task, rank, world, seed) or attach_data(...) before step()")
            batch = self.data.poisson_batch(c.sample_rate, self._secret)
            if batch[0].shape[0] == 0:  # an empty Poisson batch still releases noise
                rows = torch.zeros(1, self.sketches.size)
                with torch.no_grad():
                    value = float(loss_fn())
            else:
                grads, losses = per_sample_grads(self.model, self.data.loss, batch)
                rows, value = self.sketches.sketch(grads, seed), float(losses.mean())
        return self._release(rows), value

    def _release(self, rows: torch.Tensor) -> torch.Tensor:
        """The sum of the sketched rows, each clipped to C, plus N(0, sigma^2 C^2) (with
        distributed noise, the share goes in later, in the ring)."""
        c = self.config
        if math.isfinite(c.clip):
            clip_rows_(rows, c.clip)
        y = rows.sum(dim=0)
        if self.sigma > 0.0 and not self.distributed:
            y.add_(gaussian_noise(y.numel(), self.sigma * c.clip, self._secret))
        return y.div_(self._per_release)

    @property
    def distributed(self) -> bool:
        return self.config.dp_noise == "distributed"

    @property
    def _per_release(self) -> float:
        """What a release is divided by: the expected batch under the sample unit (its mean)."""
        c = self.config
        return c.sample_rate * self.data.size if c.dp_unit == "sample" and self.data is not None else 1.0

    def _released_sigma(self, members: tuple[str, ...], result: Any) -> float:
        """The noise multiplier of what this round released. Local noise: sigma. Distributed:
        sigma when every member's share went into every sum; a round that lost a member or an
        owner counts as sigma / sqrt(n), what one member's share alone gives (a chunk that
        kept my local values, or a sum with fewer shares, carries less than the full noise)."""
        if not self.distributed or len(members) <= 1 or not (result.lost or result.skipped):
            return self.sigma
        log.warning("%s: sketch-dp round lost %s: accounted at sigma / sqrt(%d)", self.node.peer_id,
                    list(result.lost or result.skipped), len(members))
        return self.sigma / math.sqrt(len(members))

    def _local_step(self, loss_fn: LossFn) -> float:
        """One plain SGD step at lr on this peer's batch; the optimizer sees only the round's delta."""
        loss = self._backprop(loss_fn)
        with torch.no_grad():
            for p in self.flat.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.config.lr)
        return loss

    def _local_delta(self) -> torch.Tensor:
        """(x_t - x_local) / lr, the sum of the round's local gradients; the parameters go back to x_t."""
        assert self.anchor is not None
        delta = (self.anchor - self.flat.read_params()).div_(self.config.lr)
        self.flat.write_params(self.anchor)
        return delta

    def _unsketch(self, y: torch.Tensor, seed: int) -> torch.Tensor:
        estimate = self.sketches.unsketch(y, seed)
        if self.error is None:
            return estimate
        # FetchSGD: accumulate what the top-K did not apply; R_t is fresh each round, so the
        # accumulator lives in parameter space and every round's sketch is added to it.
        self.error.add_(estimate)
        keep = torch.topk(self.error.abs(), min(self.sketches.heavy, self.flat.numel), sorted=False).indices
        update = torch.zeros_like(self.error)
        update[keep] = self.error[keep]
        self.error[keep] = 0.0
        return update

    def _check_budget(self) -> None:
        c = self.config
        if c.target_epsilon is not None and self.accountant.rounds > c.budget_rounds and not self._warned_budget:
            self._warned_budget = True
            log.warning("%s: sketch-dp ran past budget_steps=%d (%d rounds): epsilon now exceeds the target %g",
                        self.node.peer_id, c.budget_steps, c.budget_rounds, c.target_epsilon)

    # ------------------------------------------------------------------ privacy report
    @property
    def privacy(self) -> PrivacyReport:
        c = self.config
        return PrivacyReport(epsilon=self.accountant.epsilon(c.delta), delta=c.delta, noise_multiplier=self.sigma,
                             noise=c.dp_noise,
                             noise_std=self.sigma * c.clip, clip=c.clip, dp_unit=c.dp_unit, sample_rate=c.rate,
                             rounds=self.accountant.rounds, accountant=c.accountant)

    # ------------------------------------------------------------------ hooks and state
    def _replica_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        header, tensors = super()._replica_state()
        if self.error is not None:
            header["error"] = len(tensors)
            tensors.append(self.error.clone())
        return header, tensors

    def _take_replica_state(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        error = None
        if self.error is not None:
            index = header.get("error")
            error = tensors[index] if isinstance(index, int) and 0 <= index < len(tensors) else None
            if error is None or error.numel() != self.error.numel() or error.dtype != torch.float32:
                raise ValueError(f"expected FetchSGD's error of {self.error.numel()} float32 values")
            tensors = tensors[:index] + tensors[index + 1:]
        super()._take_replica_state(header, tensors)
        if error is not None and self.error is not None:
            self.error.copy_(error.reshape(-1))
        if self.anchor is not None:
            self.flat.read_params(self.anchor)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.anchor is not None and self.step_count % self.config.local_steps:
            # mid-round: a joiner gets x_t, which every peer holds, not this peer's private local steps
            names = [name for name, p in self.model.named_parameters() if p.requires_grad]
            for name, p, chunk in zip(names, self.flat.params, torch.split(self.anchor, self.flat.sizes)):
                state["model"][name] = chunk.view_as(p).to(p.dtype).clone()
        state["privacy"] = {"history": self.accountant.state(), "noise_multiplier": self.sigma}
        if self.error is not None:
            state["error"] = self.error.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "privacy" in state:
            self.accountant.load(state["privacy"]["history"])
            self.sigma = float(state["privacy"]["noise_multiplier"])
        if self.error is not None and "error" in state:
            self.error.copy_(state["error"])
        if self.anchor is not None:
            self.flat.read_params(self.anchor)

    def describe(self) -> dict[str, Any]:
        h = self.config.local_steps
        return {**super().describe(), "step": self.step_count, "parameters": self.flat.numel,
                "sketch_size": self.sketches.size, "privacy": self.privacy.as_dict(),
                "update": "gradient" if h == 1 else f"delta of {h} local steps"}
