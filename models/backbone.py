"""timm backbones by name, with a small-image stem for inputs of 64 px and below.

The small-image stem (inputs <= `SMALL_IMAGE_PX`):
- ResNets (any timm `ResNet`, e.g. resnet18, resnet50): conv1 becomes one 3x3 stride-1 padding-1
  convolution without bias and the max-pool becomes `nn.Identity`, the CIFAR stem of SimCLR
  (arXiv:2002.05709v3, CIFAR-10 appendix) and solo-learn. A 32 px image then reaches layer1 at 32x32
  instead of 8x8.
- ViTs (`vit_*`): built with `img_size=image_px` and `patch_size=image_px // 8`, so that the
  global view is always an 8x8 grid of 64 tokens: 4 px patches at 32 px (the usual CIFAR ViT),
  8 px patches at 64 px. Patch embedding and position embedding therefore change shape.
ViTs are always built with `dynamic_img_size=True`, so local crops of another size interpolate
the position embedding (DINO-style multi-crop); this changes no weight.

`backbone_kwargs` + `apply_small_stem` are the whole recipe: a fresh
`apply_small_stem(timm.create_model(name, num_classes=0, **backbone_kwargs(name, px)), name, px)`
has exactly the layout whose weights `export_backbone_state` writes. Above 64 px both are no-ops
for ResNets (and for ViTs at their native size, e.g. 224 px), so plain
`timm.create_model(name, num_classes=0)` loads the export with no missing or unexpected keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors
import safetensors.torch
from torch import Tensor, nn

# timm is imported where a network is built or read, not here: importing it (torchvision and
# torch._dynamo with it) costs about 5 CPU-seconds, which every process importing the training code
# would pay, the launcher of a multi-process run and a refused command included.

SMALL_IMAGE_PX = 64      # at or below this input side the small-image stem is used
VIT_TOKENS_PER_SIDE = 8  # small ViTs see an 8x8 token grid at the global-view size


def _is_vit(name: str) -> bool:
    return name.startswith("vit_")


def backbone_kwargs(name: str, image_px: int) -> dict:
    """Extra `timm.create_model` arguments of a backbone for `image_px` inputs.

    Args:
        name: timm model name.
        image_px: side of the square global views, in px, > 0.

    Returns:
        {} for non-ViTs; for ViTs img_size, dynamic_img_size and (at <= 64 px) patch_size.

    Raises:
        ValueError: a small ViT whose image side is not a multiple of 8.
    """
    if not _is_vit(name):
        return {}
    if image_px > SMALL_IMAGE_PX:
        return {"img_size": image_px, "dynamic_img_size": True}
    if image_px % VIT_TOKENS_PER_SIDE:
        raise ValueError(f"a small-image ViT needs image_px divisible by {VIT_TOKENS_PER_SIDE} "
                         f"(8x8 patches grid), got {image_px}; use 16, 32, 48 or 64")
    return {"img_size": image_px, "patch_size": image_px // VIT_TOKENS_PER_SIDE,
            "dynamic_img_size": True}


def is_resnet(model: nn.Module) -> bool:
    """A timm ResNet, or its `features_only` pyramid (a FeatureListNet of the same named modules)."""
    from timm.models.resnet import ResNet

    return isinstance(model, ResNet) or all(hasattr(model, k) for k in ("conv1", "bn1", "maxpool", "layer1"))


def apply_small_stem(model: nn.Module, name: str, image_px: int) -> nn.Module:
    """Swap a timm ResNet's ImageNet stem for one that keeps small images at full resolution.

    conv1 (a single conv or the deep stem of the "d" variants) becomes a 3x3 stride-1 conv with
    the same output width and the max-pool is removed. Does nothing above `SMALL_IMAGE_PX` or for
    ViTs (whose small stem is chosen at construction, see `backbone_kwargs`).

    Args:
        model: a fresh timm model built with num_classes=0 (or features_only=True, for a ResNet).
        name: its timm name (for the error message).
        image_px: side of the square global views, in px.

    Returns:
        The same module, modified in place.

    Raises:
        ValueError: the model has no small-image stem defined (neither ResNet nor ViT).
    """
    if image_px > SMALL_IMAGE_PX:
        return model
    if is_resnet(model):
        width = model.bn1.num_features                 # conv1's output width, also for deep stems
        model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    if type(model).__name__ == "VisionTransformer":
        return model
    raise ValueError(f"no small-image stem for {name!r} ({type(model).__name__}) at {image_px} px; use a "
                     f"resnet* or vit_* backbone, or images larger than {SMALL_IMAGE_PX} px")


def build_backbone(name: str, image_px: int) -> tuple[nn.Module, int]:
    """Build a randomly initialised timm backbone that maps images to pooled features.

    Never downloads: `pretrained=False`.

    Args:
        name: a timm model name, e.g. "resnet18", "resnet50", "vit_small_patch16_224".
        image_px: side of the square global views, in px (<= 64 selects the small-image stem).

    Returns:
        (module mapping (B, 3, H, W) float to (B, F) pooled features, F).

    Raises:
        ValueError: unknown model name, bad image size, or no small stem for this family.
    """
    import timm

    if not timm.is_model(name):
        raise ValueError(f"unknown backbone {name!r}; use a timm model name such as resnet18, "
                         f"resnet50 or vit_small_patch16_224")
    if image_px < 1:
        raise ValueError(f"image_px must be a positive number of pixels, got {image_px}")
    model = timm.create_model(name, pretrained=False, num_classes=0, **backbone_kwargs(name, image_px))
    model = apply_small_stem(model, name, image_px)
    return model, int(model.num_features)


def export_backbone_state(backbone: nn.Module) -> dict[str, Tensor]:
    """The backbone's weights as a plain state dict: contiguous CPU tensors, no wrapper prefixes.

    Loads with no missing or unexpected keys into `timm.create_model(name, num_classes=0)` above
    64 px (ResNets), and into `apply_small_stem(timm.create_model(name, num_classes=0,
    **backbone_kwargs(name, px)), name, px)` for the small-image stem (whose conv1 is 3x3).

    Args:
        backbone: the backbone, possibly wrapped by DDP ("module.") or torch.compile ("_orig_mod.").

    Returns:
        {parameter or buffer name: tensor}.
    """
    state = backbone.state_dict()
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        out[key] = value.detach().cpu().contiguous().clone()
    return out


def save_backbone(backbone: nn.Module, path: str | os.PathLike, name: str, image_px: int,
                  metadata: dict[str, str] | None = None) -> Path:
    """Write the backbone's weights (`export_backbone_state`) as a safetensors file, atomically.

    The file's metadata records what rebuilds the network: `timm_model` (the timm name),
    `image_px` (global-view side it was trained at), `small_stem` ("true" when the 3x3 stride-1
    ResNet stem or the 8x8-token ViT of this module replaced timm's stem) and `timm_kwargs` (JSON
    of `backbone_kwargs`), plus `metadata` (e.g. method, git commit).

    Without the small stem the file loads with timm alone:
    `timm.create_model(name, pretrained=True, num_classes=0, pretrained_cfg_overlay={"file": path},
    **json.loads(timm_kwargs))`. With it, timm has no such stem: use `load_backbone(path)`.

    Returns:
        `path`.
    """
    path = Path(path)
    meta = {"timm_model": name, "image_px": str(image_px),
            "small_stem": str(image_px <= SMALL_IMAGE_PX).lower(),
            "timm_kwargs": json.dumps(backbone_kwargs(name, image_px)), **(metadata or {})}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    safetensors.torch.save_file(export_backbone_state(backbone), str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def load_backbone(path: str | os.PathLike) -> nn.Module:
    """Rebuild the timm backbone a `save_backbone` file describes and load its weights (strict).

    Raises:
        ValueError: the file lacks the `timm_model` / `image_px` metadata of `save_backbone`.
    """
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "timm_model" not in meta or "image_px" not in meta:
        raise ValueError(f"{path} has no timm_model / image_px metadata; pass a backbone.safetensors "
                         "written by the trainer")
    model, _ = build_backbone(meta["timm_model"], int(meta["image_px"]))
    model.load_state_dict(safetensors.torch.load_file(str(path)))
    return model


def init_weights(path: str | os.PathLike, backbone: nn.Module, name: str, image_px: int) -> dict[str, Tensor]:
    """The weights in `path` for `backbone` (built by `build_backbone(name, image_px)`), checked to fit it
    exactly: the same keys and shapes, for `backbone.load_state_dict`.

    Two kinds of file:
    - a `save_backbone` file (`backbone.safetensors` of a finished run): its metadata must name the same
      timm model, stem and timm arguments as `name` at `image_px`;
    - a timm checkpoint: a state dict in a .pth / .pt / .bin / .safetensors file, possibly nested under
      `state_dict` or `model`, read with timm's conventions (`timm.models.load_state_dict`: its EMA
      weights when it has them, DDP and torch.compile prefixes removed); the classifier's keys
      (`pretrained_cfg["classifier"]`) are dropped, as the backbone is built with num_classes=0.

    Args:
        path: the weights file.
        backbone: the network the weights are for (its keys and shapes are the reference).
        name: its timm name.
        image_px: the global-view side it is built for, in px.

    Returns:
        {parameter or buffer name: tensor} with exactly the keys and shapes of `backbone.state_dict()`.

    Raises:
        ValueError: no such file, one that does not read, or weights of another network (another timm
            model or stem, keys missing or left over, other shapes), naming the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no file {path}; pass a backbone.safetensors of a finished run or a timm checkpoint file")
    meta = {}
    if path.suffix == ".safetensors":
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # safetensors raises its own types for a damaged header
            raise ValueError(f"cannot read {path} ({e}); pass a backbone.safetensors or a timm checkpoint") from None
    small_stem = str(image_px <= SMALL_IMAGE_PX).lower()
    if "timm_model" in meta:
        saved = (meta["timm_model"], meta.get("small_stem"), meta.get("timm_kwargs"))
        if saved != (name, small_stem, json.dumps(backbone_kwargs(name, image_px))):
            raise ValueError(f"{path} holds a {meta['timm_model']} backbone trained at {meta.get('image_px')} px "
                             f"(small_stem {meta.get('small_stem')}) but this run builds {name} at {image_px} px "
                             f"(small_stem {small_stem}); set model.backbone={meta['timm_model']} "
                             f"views.global_px={meta.get('image_px')}, or pass weights of {name}")
        state = safetensors.torch.load_file(str(path))
    else:
        import timm.models

        try:
            state = timm.models.load_state_dict(str(path))
        except Exception as e:  # torch and safetensors raise several types for a damaged or foreign file
            raise ValueError(f"cannot read {path} as a timm checkpoint ({e}); pass a backbone.safetensors "
                             "or a state dict saved with torch.save / safetensors") from None
        if isinstance(state, dict) and "online" in state and "config" in state:
            raise ValueError(f"{path} is a training checkpoint; run.resume={path} continues that run, and the "
                             "backbone.safetensors its finished run exported starts a new one")
        heads = (getattr(backbone, "pretrained_cfg", None) or {}).get("classifier") or ()
        heads = (heads,) if isinstance(heads, str) else tuple(heads)
        state = {k: v for k, v in state.items() if not any(k.startswith(f"{h}.") for h in heads)}
    ours = backbone.state_dict()
    for key in ours:                        # a BatchNorm counter, absent from older (torchvision) files
        if key.endswith("num_batches_tracked") and key not in state:
            state[key] = ours[key]
    missing = [k for k in ours if k not in state]
    unexpected = [k for k in state if k not in ours]
    shapes = [f"{k} {_shape(state[k])} (needs {_shape(ours[k])})" for k in ours
              if k in state and _shape(state[k]) != _shape(ours[k])]
    if missing or unexpected or shapes:
        found = [f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes:", shapes))
                 if keys]
        stem = (f"; at {image_px} px a ResNet has the small-image stem (3x3 conv1): views.global_px above "
                f"{SMALL_IMAGE_PX} keeps timm's" if small_stem == "true" and is_resnet(backbone) else "")
        raise ValueError(f"{path} does not fit a {name} backbone at {image_px} px ({'; '.join(found)}); "
                         f"pass weights of {name}, or set model.backbone to the network they are for{stem}")
    return state


def _shape(value) -> str:
    """A tensor's shape as text, e.g. "(64, 3, 3, 3)" (a value that is no tensor: its type)."""
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__
