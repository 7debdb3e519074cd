"""Comparing a vectorised loss with its literal transcription: values and gradients, in float64."""

from __future__ import annotations

import torch


def rn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def values_and_grads(fn, tensors):
    """fn(*tensors) and its gradient with respect to every input (zeros where it does not depend)."""
    xs = [t.clone().requires_grad_(True) for t in tensors]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)]


def assert_same_values_and_grads(fast, literal, tensors):
    """The two functions agree on value and on every input's gradient; returns fast's gradients."""
    v1, g1 = values_and_grads(fast, tensors)
    v2, g2 = values_and_grads(literal, tensors)
    torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    return g1
