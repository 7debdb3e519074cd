"""Projector and predictor MLPs (BYOL / SimCLR style)."""

from __future__ import annotations

from torch import nn


def mlp(in_dim: int, hidden_dim: int, out_dim: int, num_layers: int = 2,
        last_bn: bool = False) -> nn.Sequential:
    """Linear-BN-ReLU blocks followed by a final Linear (and an affine-free BN if `last_bn`).

    Args:
        in_dim, hidden_dim, out_dim: feature sizes.
        num_layers: number of Linear layers, >= 1.
        last_bn: add BatchNorm1d(affine=False) after the last Linear (MoCo v3 projector).
    """
    if num_layers < 1:
        raise ValueError(f"mlp needs num_layers >= 1, got {num_layers}")
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(num_layers - 1):
        layers += [nn.Linear(dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True)]
        dim = hidden_dim
    layers.append(nn.Linear(dim, out_dim, bias=not last_bn))
    if last_bn:
        layers.append(nn.BatchNorm1d(out_dim, affine=False))
    return nn.Sequential(*layers)
