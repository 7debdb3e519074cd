"""Projector and predictor MLPs (SimCLR / BYOL / MoCo v3 style)."""

from __future__ import annotations

from torch import nn


def mlp(in_dim: int, hidden_dim: int, out_dim: int, num_layers: int = 2,
        last_bn: bool = False) -> nn.Sequential:
    """Linear-BN-ReLU blocks followed by a final Linear (and an affine-free BN if `last_bn`).

    With num_layers=2 this is the BYOL projector/predictor (arXiv:2006.07733v3, Sec. 3.3); with
    last_bn=True MoCo v3's heads (BN also on the output): 2 layers for the projector and the predictor
    on a ResNet, 3 for the projector on a ViT (`moco/builder.py` of facebookresearch/moco-v3). Hidden
    Linears have no bias because the BatchNorm after them has one.

    Args:
        in_dim: input features, > 0.
        hidden_dim: width of the hidden layers, > 0 (unused when num_layers = 1).
        out_dim: output features, > 0.
        num_layers: number of Linear layers, >= 1.
        last_bn: add BatchNorm1d(out_dim, affine=False) after the last Linear.

    Returns:
        nn.Sequential mapping (N, in_dim) to (N, out_dim).

    Raises:
        ValueError: a size or layer count out of range.
    """
    if num_layers < 1:
        raise ValueError(f"mlp needs num_layers >= 1, got {num_layers}")
    if min(in_dim, out_dim) < 1 or (num_layers > 1 and hidden_dim < 1):
        raise ValueError(f"mlp sizes must be positive, got in={in_dim} hidden={hidden_dim} "
                         f"out={out_dim}; set model.proj_hidden / model.proj_out")
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(num_layers - 1):
        layers += [nn.Linear(dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim),
                   nn.ReLU(inplace=True)]
        dim = hidden_dim
    layers.append(nn.Linear(dim, out_dim, bias=not last_bn))
    if last_bn:
        layers.append(nn.BatchNorm1d(out_dim, affine=False))
    return nn.Sequential(*layers)
