"""The SSL network: backbone + projector (+ predictor), with a multi-crop forward.

Multi-crop forward (as in DINO / SwAV): all views of one resolution, across groups, go through
the backbone and the heads as ONE batch; outputs are split back per group, in order. In train
mode BatchNorm therefore normalises with statistics over every view of that resolution (not per
view), and its running statistics are updated once per resolution. In eval mode the result is
exactly a separate forward per view.

`bn_per_view=True` (`model.bn_per_view`) runs one backbone call per view in train mode instead, as
the official BYOL, MoCo v3 and SDMP code do: each view, clean or mixed, is normalised with its own
batch statistics. On `synthetic` (SDMP, 300 steps) it changed kNN / linear top-1 by +0.8 / −0.4
points, within run-to-run spread (docs/benchmarks.md, "BatchNorm per view"), so the default stays
the shared batch: one backbone call per resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from models.backbone import build_backbone
from models.ema import ema_update_
from models.heads import mlp


@dataclass
class ViewEmbeddings:
    """Outputs for one group of views."""

    h: Tensor   # (V, B, F) backbone features
    z: Tensor   # (V, B, D) projector outputs
    p: Tensor   # (V, B, D) predictor outputs (z itself when there is no predictor)


class SSLModel(nn.Module):
    """Backbone, projector and optional predictor.

    Attributes:
        backbone: (N, 3, H, W) -> (N, feat_dim) pooled features.
        projector: (N, feat_dim) -> (N, D).
        predictor: (N, D) -> (N, D), or None.
        feat_dim: F, the backbone feature size.
    """

    def __init__(self, backbone: nn.Module, feat_dim: int, projector: nn.Module,
                 predictor: nn.Module | None, bn_per_view: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.feat_dim = feat_dim
        self.projector = projector
        self.predictor = predictor
        self.bn_per_view = bn_per_view

    def forward(self, groups: Sequence[Tensor]) -> list[ViewEmbeddings]:
        """Embed groups of views, running the backbone once per distinct resolution.

        Args:
            groups: (V, B, 3, H, W) float tensors, e.g. [batch.global_views, batch.local_views];
                V and B may differ between groups.

        Returns:
            One ViewEmbeddings per group, in the order of `groups`.

        Raises:
            ValueError: a group that is not a (V, B, 3, H, W) tensor.
        """
        for i, g in enumerate(groups):
            if not isinstance(g, Tensor) or g.dim() != 5 or g.shape[2] != 3:
                shape = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
                raise ValueError(f"view group {i} must be a (V, B, 3, H, W) tensor, got {shape}; "
                                 f"pass only the groups the batch has (skip None)")
        if self.bn_per_view and self.training:                            # one BN batch per view
            return [_cat_views([self._embed([g[v:v + 1]])[0] for v in range(g.shape[0])]) for g in groups]
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, g in enumerate(groups):
            by_size.setdefault((g.shape[-2], g.shape[-1]), []).append(i)
        out: list[ViewEmbeddings | None] = [None] * len(groups)
        for members in by_size.values():
            for i, emb in zip(members, self._embed([groups[i] for i in members])):
                out[i] = emb
        return out  # type: ignore[return-value]

    def _embed(self, groups: Sequence[Tensor]) -> list[ViewEmbeddings]:
        """Groups of one resolution through the backbone and the heads as one batch, split back."""
        x = torch.cat([g.flatten(0, 1) for g in groups])                  # (sum V*B, 3, H, W)
        h = self.backbone(x)                                              # (sum V*B, F)
        z = self.projector(h)                                             # (sum V*B, D)
        p = self.predictor(z) if self.predictor is not None else z        # (sum V*B, D)
        out, start = [], 0
        for g in groups:
            v, b = g.shape[:2]
            rows = slice(start, start + v * b)
            z_g = z[rows].unflatten(0, (v, b))                            # (V, B, D)
            out.append(ViewEmbeddings(h=h[rows].unflatten(0, (v, b)),     # (V, B, F)
                                      z=z_g,
                                      p=z_g if self.predictor is None
                                      else p[rows].unflatten(0, (v, b))))  # (V, B, D)
            start += v * b
        return out

    def update_from(self, online: "SSLModel", momentum: float) -> None:
        """EMA update of this (target) network from `online`, called after optimizer.step().

        param <- momentum * param + (1 - momentum) * online_param without grad; buffers copied
        from online (models/ema.py).

        Args:
            online: the online network, unwrapped from DDP.
            momentum: in [0, 1].
        """
        ema_update_(self, online, momentum)


def _cat_views(embs: list[ViewEmbeddings]) -> ViewEmbeddings:
    """Per-view embeddings, (1, B, ...) each, back into one (V, B, ...) group."""
    return ViewEmbeddings(h=torch.cat([e.h for e in embs]), z=torch.cat([e.z for e in embs]),
                          p=torch.cat([e.p for e in embs]))


def build_model(backbone: str, image_px: int, proj_hidden: int, proj_out: int, pred_hidden: int,
                proj_layers: int = 2, bn_per_view: bool = False, proj_last_bn: bool = False,
                pred_last_bn: bool = False) -> SSLModel:
    """Build an online network with randomly initialised weights.

    Args:
        backbone: timm model name (resnet18, resnet50, vit_small_patch16_224, ...).
        image_px: global-view side in px (<= 64 selects the small-image stem).
        proj_hidden: projector hidden width.
        proj_out: projector output size D (also the predictor's input and output).
        pred_hidden: predictor hidden width; 0 means no predictor.
        proj_layers: number of Linear layers of the projector, >= 1.
        bn_per_view: one backbone call per view in train mode (module docstring).
        proj_last_bn: an affine-free BatchNorm on the projector's output (MoCo v3's projector).
        pred_last_bn: an affine-free BatchNorm on the predictor's output (MoCo v3's ResNet predictor).

    Returns:
        The SSLModel, in train mode.
    """
    net, feat_dim = build_backbone(backbone, image_px)
    projector = mlp(feat_dim, proj_hidden, proj_out, num_layers=proj_layers, last_bn=proj_last_bn)
    predictor = (mlp(proj_out, pred_hidden, proj_out, num_layers=2, last_bn=pred_last_bn) if pred_hidden > 0
                 else None)
    return SSLModel(net, feat_dim, projector, predictor, bn_per_view)
