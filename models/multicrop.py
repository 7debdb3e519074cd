"""The SSL network: backbone + projector (+ predictor), with a multi-crop forward."""

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
    """Backbone, projector and optional predictor."""

    def __init__(self, backbone: nn.Module, feat_dim: int, projector: nn.Module,
                 predictor: nn.Module | None) -> None:
        super().__init__()
        self.backbone = backbone
        self.feat_dim = feat_dim
        self.projector = projector
        self.predictor = predictor

    def forward(self, groups: Sequence[Tensor]) -> list[ViewEmbeddings]:
        """Embed groups of views, running the backbone once per distinct resolution.

        Args:
            groups: (V, B, 3, H, W) tensors, e.g. [batch.global_views, batch.local_views].

        Returns:
            One ViewEmbeddings per group, in order.
        """
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, g in enumerate(groups):
            by_size.setdefault(tuple(g.shape[-2:]), []).append(i)
        out: list[ViewEmbeddings | None] = [None] * len(groups)
        for members in by_size.values():
            xs = [groups[i].flatten(0, 1) for i in members]        # (V*B, 3, H, W) each
            h = self.backbone(torch.cat(xs))                         # (sum V*B, F)
            z = self.projector(h)                                    # (sum V*B, D)
            p = self.predictor(z) if self.predictor is not None else z
            start = 0
            for i in members:
                v, b = groups[i].shape[:2]
                sl = slice(start, start + v * b)
                out[i] = ViewEmbeddings(h=h[sl].unflatten(0, (v, b)),   # (V, B, F)
                                        z=z[sl].unflatten(0, (v, b)),   # (V, B, D)
                                        p=p[sl].unflatten(0, (v, b)))   # (V, B, D)
                start += v * b
        return out  # type: ignore[return-value]

    def update_from(self, online: "SSLModel", momentum: float) -> None:
        """EMA update of this (target) network from `online`; see models/ema.py."""
        ema_update_(self, online, momentum)


def build_model(backbone: str, image_px: int, proj_hidden: int, proj_out: int, pred_hidden: int,
                proj_layers: int = 2) -> SSLModel:
    """Build an online network.

    Args:
        backbone: timm model name.
        image_px: input side in px (<= 64 selects the small-image stem).
        proj_hidden, proj_out: projector sizes.
        pred_hidden: predictor hidden size; 0 means no predictor.
        proj_layers: number of Linear layers of the projector.
    """
    net, feat_dim = build_backbone(backbone, image_px)
    projector = mlp(feat_dim, proj_hidden, proj_out, num_layers=proj_layers)
    predictor = mlp(proj_out, pred_hidden, proj_out, num_layers=2) if pred_hidden > 0 else None
    return SSLModel(net, feat_dim, projector, predictor)
