"""The saliency network of the DeepUSPS-style refinement (RELICv2 arXiv:2201.05119v1, App. A.2):
a timm backbone as a feature pyramid (`features_only`) with a light FPN decoder, one logit per pixel.

DeepUSPS (Nguyen et al., NeurIPS 2019) uses a dilated ResNet with a 1x1 classifier and a fixed x8
bilinear upsampling; RELICv2 swaps its supervised Cityscapes weights for a self-supervised ResNet.
Here any timm ResNet works, initialised at random or from a viewmill `backbone.safetensors` (the
self-supervised backbone `make train` exports), which keeps the masks fully unsupervised. The
decoder is a top-down FPN: a 1x1 lateral convolution per pyramid level to `width` channels, each
coarser sum upsampled bilinearly and added to the next finer level, then a 3x3 convolution to one
logit, upsampled bilinearly to the input size. Saliency = sigmoid(logit).
"""

from __future__ import annotations

import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.backbone import SMALL_IMAGE_PX, apply_small_stem, is_resnet


class SaliencyNet(nn.Module):
    """A timm feature pyramid + FPN decoder mapping images to saliency logits.

    Args:
        backbone: a timm ResNet name (e.g. "test_resnet", "resnet18", "resnet50").
        small_stem: use the 3x3 stride-1 small-image stem of `models.backbone` (to load weights
            of a backbone trained at <= 64 px, whose conv1 has that shape).
        width: decoder channels.
    """

    def __init__(self, backbone: str, small_stem: bool = False, width: int = 32) -> None:
        super().__init__()
        import timm     # where a network is built (models.backbone)

        if not timm.is_model(backbone):
            raise ValueError(f"unknown backbone {backbone!r}; use a timm ResNet name such as test_resnet, "
                             "resnet18 or resnet50")
        self.encoder = timm.create_model(backbone, pretrained=False, features_only=True)
        if not is_resnet(self.encoder):
            raise ValueError(f"the saliency network needs a ResNet backbone, got {backbone!r}")
        if small_stem:
            apply_small_stem(self.encoder, backbone, SMALL_IMAGE_PX)
        self.backbone_name, self.small_stem = backbone, small_stem
        channels = self.encoder.feature_info.channels()
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, kernel_size=1) for c in channels)
        self.head = nn.Conv2d(width, 1, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        """(B, 3, H, W) normalised images → (B, 1, H, W) saliency logits."""
        feats = self.encoder(x)                                  # finest first, each (B, C_l, H_l, W_l)
        out = None
        for f, lateral in zip(reversed(feats), reversed(self.lateral)):
            z = lateral(f)                                       # (B, width, H_l, W_l)
            out = z if out is None else z + F.interpolate(out, size=z.shape[-2:], mode="bilinear",
                                                          align_corners=False)
        logits = self.head(out)                                  # (B, 1, H_0, W_0)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def backbone_source(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a `backbone.safetensors` that `make train` exported (`timm_model`,
    `image_px`, `small_stem`, ...), or of the one inside a run folder.

    Raises:
        ValueError: no such file, or a file without the trainer's metadata, with the fix.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "backbone.safetensors"
    if not path.is_file():
        raise ValueError(f"no backbone file {path}; pass a run folder or its backbone.safetensors, which "
                         "make train writes at the end of a run")
    if path.suffix != ".safetensors":
        raise ValueError(f"{path} is not a backbone.safetensors; pass the run folder or the backbone.safetensors "
                         "make train exported (not checkpoint.pt)")
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if "timm_model" not in meta:
        raise ValueError(f"{path} has no timm_model metadata; pass a backbone.safetensors written by make train")
    meta["path"] = str(path)
    return meta


def build_saliency_net(backbone: str, init: str | os.PathLike | None = None, width: int = 32) -> SaliencyNet:
    """A saliency network, its encoder randomly initialised or loaded from `init` (a run folder or
    its `backbone.safetensors`; then the backbone and stem are the file's, and `backbone` is ignored).

    Raises:
        ValueError: an unusable `init` or backbone name, with the fix.
    """
    if init is None:
        return SaliencyNet(backbone, small_stem=False, width=width)
    meta = backbone_source(init)
    net = SaliencyNet(meta["timm_model"], small_stem=meta.get("small_stem") == "true", width=width)
    state = safetensors.torch.load_file(meta["path"])
    missing, unexpected = net.encoder.load_state_dict(state, strict=False)
    if missing or [k for k in unexpected if not k.startswith("fc.")]:
        raise ValueError(f"{meta['path']} does not fit a {meta['timm_model']} feature pyramid "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return net


def saliency_probabilities(net: SaliencyNet, x: Tensor, flip: bool = True) -> Tensor:
    """Eval-mode saliency in [0, 1] of (B, 3, H, W) normalised images, averaged with the mirror
    image's prediction flipped back when `flip` (test-time augmentation). Returns (B, H, W)."""
    with torch.no_grad():
        p = torch.sigmoid(net(x))[:, 0]                          # (B, H, W)
        if flip:
            p = (p + torch.sigmoid(net(x.flip(-1)))[:, 0].flip(-1)) / 2
    return p
