"""A gradient-leakage attack on sketched updates (Song et al., ICML 2023, section on
vulnerability): an observer who knows the public model, the public sketch map R_t and one
peer's release y = R_t g(x, label) reconstructs the training sample x.

The observer is any peer of the swarm: R_t comes from the swarm seed and the round, the
parameters are the replicas everyone holds, and the release is what the peer sends.

    g0 = R_t^T y                                  # unsketch: a noisy estimate of the gradient
    x0 = g0_W1^T g0_b1 / |g0_b1|^2                # first layer W1 x + b1: dL/dW1 = delta x^T and
                                                  #   dL/db1 = delta, so x = W1-row / b1-entry
    for each candidate label (most likely first, from the last bias' estimate):
        for x_start in (x0, a few random points):
            x = argmin 1 - cos(R_t grad L(x, label), y)   # gradient matching through R_t (L-BFGS),
                                                          #   first on softplus copies of the model
    keep the (x, label) that matches best (stop at a perfect match)

The cosine makes the match blind to the clipping factor. Without noise the release pins
the sample down (s equations for a handful of unknowns) and the attack recovers it; with
the DP noise of sketch-dp (std sigma * C per coordinate, against a signal of norm <= C)
the match is fitted to noise and the reconstruction is no better than a guess.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from starling.compressors import GaussianSketch
from starling.protocols.privacy import BoundParams

_SMOOTHING = (4.0, 32.0)  # softplus sharpness of the warm-up surrogates
_EXACT = 1e-6  # a mismatch this small is the sample (up to float error): stop searching
LossOfBatch = Callable[[Any, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Reconstruction:
    sample: torch.Tensor  # the attacker's estimate of x
    label: int
    match: float  # final 1 - cos(R g(estimate), release); 0 is a perfect match

    def relative_error(self, truth: torch.Tensor) -> float:
        return float((self.sample - truth).norm() / truth.norm())


class _Sketched(torch.autograd.Function):
    """y = R g with the sketch map's own operations; the backward pass is R^T."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, sketch: Callable, transpose: Callable) -> torch.Tensor:
        ctx.transpose = transpose
        return sketch(g)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.transpose(grad_out), None, None


def reconstruct_sample(model: nn.Module, loss: LossOfBatch, release: torch.Tensor, sketches: Any, seed: int,
                       input_dim: int, num_classes: int, *, labels_to_try: int = 3, restarts: int = 2,
                       steps: int = 150) -> Reconstruction:
    """Invert one peer's release of round seed `seed` (`sketches`: a sketch_dp.SketchMap)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    sketch, transpose = _operators(sketches, seed)
    estimate = transpose(release)
    x0 = _first_layer_inversion(estimate, params, input_dim)
    label_order = _label_order(estimate, params, num_classes)[:labels_to_try]

    def mismatch_of(net: nn.Module) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def mismatch(x: torch.Tensor, label: int) -> torch.Tensor:
            theta = [p.clone().requires_grad_(True) for p in params]
            out = loss(BoundParams(net, dict(zip(names, theta))), (x.unsqueeze(0), torch.tensor([label])))
            grads = torch.autograd.grad(out, theta, create_graph=True)
            y = _Sketched.apply(torch.cat([g.reshape(-1) for g in grads]), sketch, transpose)
            return 1.0 - torch.nn.functional.cosine_similarity(y, release, dim=0)
        return mismatch

    exact = mismatch_of(model)
    smooth = [mismatch_of(_smoothed(model, beta)) for beta in _SMOOTHING]
    starts = [x0] + [torch.randn(input_dim, generator=torch.Generator().manual_seed(i)) for i in range(restarts)]
    best: Reconstruction | None = None
    for label in label_order:
        for start in starts:
            for surrogate in smooth:  # a path through softplus models avoids many ReLU local minima
                start = _match(surrogate, start, label, steps // 2).sample
            found = _match(exact, start, label, steps)
            if best is None or found.match < best.match:
                best = found
            if best.match < _EXACT:
                return best
    assert best is not None
    return best


def _match(mismatch: Callable[[torch.Tensor, int], torch.Tensor], start: torch.Tensor, label: int,
           steps: int) -> Reconstruction:
    """L-BFGS on the gradient mismatch from one starting point (ReLU models have local minima:
    the caller tries a few)."""
    x = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-10, tolerance_change=1e-12)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = mismatch(x, label)
        value.backward()
        return value

    opt.step(closure)
    return Reconstruction(x.detach().clone(), label, float(mismatch(x.detach(), label).detach()))


def _smoothed(model: nn.Module, beta: float) -> nn.Module:
    """A copy of the model with every ReLU replaced by softplus(beta) (ReLU as beta -> inf)."""
    smooth = copy.deepcopy(model)
    for parent in smooth.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ReLU):
                setattr(parent, name, nn.Softplus(beta=beta))
    return smooth


def _operators(sketches: Any, seed: int) -> tuple[Callable, Callable]:
    """R and R^T as functions; a Gaussian R is built once and applied as a matrix."""
    codec = sketches.codec
    if isinstance(codec, GaussianSketch) and codec.kind == "gauss":
        r = codec.matrix(sketches.numel, seed)
        return (lambda g: r @ g), (lambda y: r.T @ y)
    def sketch(g: torch.Tensor) -> torch.Tensor:
        return sketches.sketch(g.detach().unsqueeze(0), seed)[0]

    def transpose(y: torch.Tensor) -> torch.Tensor:
        if isinstance(codec, GaussianSketch):  # SRHT: unsketch is R^T
            return sketches.unsketch(y.detach(), seed)
        return codec.transpose(y.detach().view(codec.size), sketches.numel, seed)  # count sketch: mean of rows

    return sketch, transpose


def _first_layer_inversion(estimate: torch.Tensor, params: list[torch.Tensor], input_dim: int) -> torch.Tensor:
    """x from the first Linear layer's gradient blocks (a zero guess if the model starts otherwise)."""
    if len(params) < 2 or params[0].shape[-1:] != (input_dim,) or params[1].shape != params[0].shape[:1]:
        return torch.zeros(input_dim)
    hidden = params[0].shape[0]
    g_w = estimate[: hidden * input_dim].view(hidden, input_dim)
    g_b = estimate[hidden * input_dim : hidden * input_dim + hidden]
    return (g_w.T @ g_b) / g_b.square().sum().clamp_min(1e-12)


def _label_order(estimate: torch.Tensor, params: list[torch.Tensor], num_classes: int) -> list[int]:
    """Cross-entropy's last bias gradient is softmax - onehot: the true label's entry is the
    only negative one. Order labels by the (noisy) estimate of that block."""
    if params[-1].shape != (num_classes,):
        return list(range(num_classes))
    return torch.argsort(estimate[-num_classes:]).tolist()
