"""Non-IID partitions of a labelled data set over a swarm's peers, as Flower's partitioners
define them (`flwr_datasets.partitioner`):

- ``iid``: a seeded permutation of the samples cut into `world` near-equal parts.
- ``dirichlet:ALPHA`` (DirichletPartitioner, without self-balancing): for each class c,
  proportions q_c ~ Dirichlet(ALPHA, ..., ALPHA) over the `world` partitions, and class c's
  samples (shuffled) are cut at the cumulative proportions. Small ALPHA: each class lands on
  few peers; large ALPHA: close to IID. `min_size` (Flower's min_partition_size) redraws until
  every partition holds that many samples.
- ``shards:K`` (ShardPartitioner): the samples sorted by label are cut into `world * K` equal
  shards (the remainder dropped), and each partition takes K of them at random: each peer
  sees about K classes.

`indices()` partitions a labelled data set; `label_mixes()` gives each peer's label
distribution for a task that draws its samples (its classes balanced): what `indices()` would
give a large balanced data set.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("iid", "dirichlet", "shards")
MAX_REDRAWS = 100  # Dirichlet draws before a `min_size` that cannot be met is an error


@dataclass(frozen=True)
class Partition:
    kind: str = "iid"
    alpha: float = 0.0  # dirichlet
    shards: int = 0  # shards per partition
    min_size: int = 0  # dirichlet: redraw until every partition holds this many samples

    @classmethod
    def parse(cls, spec: str) -> Partition:
        """``iid``, ``dirichlet:ALPHA`` or ``shards:K``; ValueError naming what is wrong."""
        kind, _, arg = str(spec).strip().partition(":")
        try:
            if kind == "iid" and not arg:
                return cls()
            if kind == "dirichlet":
                alpha = float(arg)
                if not (alpha > 0 and np.isfinite(alpha)):
                    raise ValueError
                return cls("dirichlet", alpha=alpha)
            if kind == "shards":
                shards = int(arg)
                if shards < 1:
                    raise ValueError
                return cls("shards", shards=shards)
        except ValueError:
            pass
        raise ValueError(f"partition must be iid, dirichlet:ALPHA (ALPHA > 0) or shards:K (K >= 1), got {spec!r}")

    def __str__(self) -> str:
        return {"iid": "iid", "dirichlet": f"dirichlet:{self.alpha:g}", "shards": f"shards:{self.shards}"}[self.kind]

    def indices(self, labels: torch.Tensor | np.ndarray, world: int, seed: int) -> list[np.ndarray]:
        """The sample indices of each of `world` partitions (sorted), deterministic for
        (labels, world, seed)."""
        y = np.asarray(labels).reshape(-1)
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        rng = np.random.default_rng([seed, world, KINDS.index(self.kind)])
        if self.kind == "iid":
            return [np.sort(part) for part in np.array_split(rng.permutation(len(y)), world)]
        if self.kind == "shards":
            return self._shards(y, world, rng)
        return self._dirichlet(y, world, rng)

    def _shards(self, y: np.ndarray, world: int, rng: np.random.Generator) -> list[np.ndarray]:
        total = world * self.shards
        size = len(y) // total
        if size < 1:
            raise ValueError(f"{len(y)} samples cannot make {total} shards ({world} partitions x {self.shards})")
        ordered = np.argsort(y, kind="stable")[:size * total].reshape(total, size)
        picks = rng.permutation(total).reshape(world, self.shards)
        return [np.sort(ordered[row].reshape(-1)) for row in picks]

    def _dirichlet(self, y: np.ndarray, world: int, rng: np.random.Generator) -> list[np.ndarray]:
        classes = np.unique(y)
        for _ in range(MAX_REDRAWS):
            parts: list[list[np.ndarray]] = [[] for _ in range(world)]
            for c in classes:
                members = rng.permutation(np.flatnonzero(y == c))
                q = rng.dirichlet(np.full(world, self.alpha))
                cuts = (np.cumsum(q) * len(members)).astype(int)[:-1]
                for r, piece in enumerate(np.split(members, cuts)):
                    parts[r].append(piece)
            out = [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]
            if min(len(p) for p in out) >= self.min_size:
                return out
        raise ValueError(f"no Dirichlet({self.alpha:g}) draw of {len(y)} samples gave every one of {world} "
                         f"partitions {self.min_size} samples")

    def label_mixes(self, num_classes: int, world: int, seed: int, per_class: int = 1000) -> torch.Tensor:
        """Each partition's label distribution (world x num_classes) for a task whose classes are
        balanced: `indices()` over `per_class` samples of every class."""
        if self.kind == "iid":  # every partition a uniform sample of the whole: the whole's distribution
            return torch.full((world, num_classes), 1.0 / num_classes)
        labels = np.repeat(np.arange(num_classes), per_class)
        counts = np.stack([np.bincount(labels[i], minlength=num_classes) for i in self.indices(labels, world, seed)])
        sums = counts.sum(1, keepdims=True)
        mixes = np.where(sums > 0, counts / np.maximum(sums, 1), 1.0 / num_classes)  # an empty part draws uniformly
        return torch.from_numpy(mixes).to(torch.float32)
