"""A sharded replica's checkpoints: torch's distributed checkpoint, one directory per step that
every rank of the replica writes its chunks into, kept in the one `CheckpointStore`."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from starling.protocols.outer_sync import OuterState
    from starling.runtime.shard_sync import ShardedModel

__all__ = ["ShardedCheckpoints"]


def _outer_state(proto: Any) -> OuterState | None:
    """The protocol's outer state (DiLoCo's `outer_state()`), or None for one that keeps none."""
    read = getattr(proto, "outer_state", None)
    return read() if callable(read) else None


class ShardedCheckpoints:
    """A replica's checkpoints when its ranks each sync their own shard: torch's distributed
    checkpoint (`torch.distributed.checkpoint`), one directory per step that every rank writes
    its chunks into, so that a replica of another rank count can load it (DCP reshards).

    What goes in, per parameter and as a DTensor sharded like it: the model, the outer
    parameters and momentum (the protocol's `outer_state()`, laid out per parameter), the
    inner optimizer's per-parameter state; and the step and fragment versions. Error-feedback
    residuals and rounds in flight are not kept (they belong to one layout): a resumed replica
    starts its rounds afresh from the saved outer state. The directories live in the one
    `CheckpointStore`: rank 0 seals each once every rank's part is on disk (a manifest with
    every file's digest, naming the swarm that wrote it), prunes, and checks every byte before
    a resume."""

    def __init__(self, directory: str, keep: int, sharded: ShardedModel) -> None:
        from starling.runtime.checkpoint import CheckpointStore

        self.store = CheckpointStore(directory, keep)
        self.sharded = sharded

    # ------------------------------------------------------------------ layout
    def _names(self) -> list[str]:
        return [name for name, _ in self.sharded.view.named_parameters()]

    def _dtensor(self, local: torch.Tensor, like: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.sharded.mesh, [Shard(0)], run_check=False, shape=like.shape,
                                  stride=like.stride())

    def _per_parameter(self, held: OuterState | None, flats: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Chunks shaped like the view's parameters, holding `flats` (one per fragment of `held`),
        or zeros; none without an outer state."""
        if held is None:
            return []
        locals_ = [torch.zeros_like(v, dtype=torch.float32) for _, v in self.sharded.pairs]
        if flats is not None:
            held.scatter(flats, locals_)
        return locals_

    # ------------------------------------------------------------------ save
    def save(self, proto: Any, spec: Mapping[str, Any], count: int) -> str:
        """Every rank calls this at the same step (a collective); returns the directory."""
        import torch.distributed.checkpoint as dcp

        path = self.store.directory_for(count)
        state: dict[str, Any] = {}
        held = _outer_state(proto)
        outer = self._per_parameter(held, held.outer if held else None)
        momentum = self._per_parameter(held, held.momentum if held else None)
        for i, (name, (p, v)) in enumerate(zip(self._names(), self.sharded.pairs)):
            state[f"model.{name}"] = p
            if held is not None:
                state[f"outer.{name}"] = self._dtensor(outer[i], p)
                state[f"momentum.{name}"] = self._dtensor(momentum[i], p)
            for key, value in proto.optimizer.state.get(v, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"optim.{name}.{key}"] = self._dtensor(value, p) if value.shape == v.shape and value.dim() \
                        else value
        versions = list(held.versions) if held else []
        state["meta"] = torch.tensor([proto.step_count, *versions], dtype=torch.int64)
        dcp.save(state, checkpoint_id=str(path))
        if self.sharded.group.rank == 0:  # dcp.save returns once every rank's files are written
            self.store.seal(count, {"step": proto.step_count, "count": count, "ranks": self.sharded.group.size,
                                    "swarm": dict(spec)})
        dist.barrier()
        return str(path)

    # ------------------------------------------------------------------ load
    def latest(self) -> tuple[str, dict[str, Any]] | None:
        """The newest sealed checkpoint whose bytes verify, as (directory, its manifest's metadata)
        (rank 0 looks; every rank gets its answer: a collective)."""
        found: list[Any] = [None]
        if self.sharded.group.rank == 0:
            checkpoint = self.store.latest_directory()
            found[0] = None if checkpoint is None else (str(checkpoint.state_path), dict(checkpoint.meta))
        dist.broadcast_object_list(found, 0)
        return found[0]

    def load(self, path: str, proto: Any) -> int:
        """Load the checkpoint at `path` into this rank's chunks, whatever rank count wrote it
        (a collective). Returns the step it was written at."""
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state: dict[str, Any] = {}
        held = _outer_state(proto)  # its layout: where each fragment's values sit in the parameters
        outer = self._per_parameter(held, None)
        momentum = self._per_parameter(held, None)
        optim: dict[int, dict[str, torch.Tensor]] = {}
        for i, (name, (p, v)) in enumerate(zip(self._names(), self.sharded.pairs)):
            if f"model.{name}" not in metadata:
                raise ValueError(f"{path} holds no parameter {name!r}: a checkpoint of another model")
            state[f"model.{name}"] = p
            if held is not None:
                state[f"outer.{name}"] = self._dtensor(outer[i], p)
                state[f"momentum.{name}"] = self._dtensor(momentum[i], p)
            prefix = f"optim.{name}."
            for key, meta in metadata.items():
                if not key.startswith(prefix) or not hasattr(meta, "size"):
                    continue
                size, dtype = tuple(meta.size), meta.properties.dtype
                if size == tuple(p.shape) and len(size):
                    local = torch.zeros_like(v, dtype=dtype)
                    state[key] = self._dtensor(local, p)
                else:
                    local = state[key] = torch.zeros(size, dtype=dtype, device=v.device)
                optim.setdefault(i, {})[key[len(prefix):]] = local
        meta_size = tuple(metadata["meta"].size)
        state["meta"] = torch.zeros(meta_size, dtype=torch.int64)
        dcp.load(state, checkpoint_id=path)
        views = [v for _, v in self.sharded.pairs]
        for i, saved in optim.items():
            proto.optimizer.state[views[i]] = saved
        step, *versions = (int(x) for x in state["meta"].tolist())
        if held is not None:
            proto.load_outer_state(dataclasses.replace(held, step=step, versions=tuple(versions),
                                                       outer=held.gather(outer), momentum=held.gather(momentum)))
        else:
            proto.step_count = step
        return step
