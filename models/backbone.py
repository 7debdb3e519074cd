"""timm backbones by name, with a small-image stem for inputs of 64 px and below."""

from __future__ import annotations

import timm
import torch
from torch import Tensor, nn

SMALL_IMAGE_PX = 64   # at or below this input size the stem keeps full resolution


def apply_small_stem(model: nn.Module, name: str, image_px: int) -> nn.Module:
    """Swap a timm model's ImageNet stem for one that keeps small images at full resolution.

    ResNets: conv1 becomes a 3x3 stride-1 convolution and the max-pool is removed (the CIFAR stem of
    SimCLR and solo-learn). ViTs are instead built for the small size (see `build_backbone`).
    Applied to a fresh `timm.create_model(name, num_classes=0)` this yields exactly the module layout
    whose state dict `export_backbone_state` writes.
    """
    if image_px > SMALL_IMAGE_PX or not hasattr(model, "conv1"):
        return model
    width = model.conv1.out_channels
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_backbone(name: str, image_px: int) -> tuple[nn.Module, int]:
    """Build a randomly initialised timm backbone that maps images to pooled features.

    Args:
        name: a timm model name, e.g. "resnet18", "resnet50", "vit_small_patch16_224".
        image_px: side of the square inputs it will see.

    Returns:
        (module mapping (B, 3, H, W) float to (B, F), F).

    Raises:
        ValueError: unknown model name.
    """
    if name not in timm.list_models():
        raise ValueError(f"unknown backbone {name!r}; use a timm model name such as resnet18, "
                         f"resnet50 or vit_small_patch16_224")
    kwargs: dict = {}
    if name.startswith("vit") and image_px <= SMALL_IMAGE_PX:
        # 4-px patches give 16x16 tokens at 64 px (8x8 at 32 px), as ViTs on CIFAR use.
        kwargs = {"img_size": image_px, "patch_size": 4}
    elif name.startswith("vit"):
        kwargs = {"img_size": image_px}
    model = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    model = apply_small_stem(model, name, image_px)
    return model, int(model.num_features)


def export_backbone_state(backbone: nn.Module) -> dict[str, Tensor]:
    """The backbone's weights as a plain state dict (CPU tensors, no wrapper prefixes).

    `timm.create_model(name, num_classes=0)` loads it with no missing or unexpected keys (for a
    small-stem ResNet after `apply_small_stem`, since conv1 has a 3x3 kernel).
    """
    state = backbone.state_dict()
    return {k.removeprefix("module."): v.detach().cpu().clone() for k, v in state.items()}
