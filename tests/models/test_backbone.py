"""Backbones: small-image stem shapes, bad names, the timm-loadable export, and the weights `model.init`
reads."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from models.backbone import (apply_small_stem, backbone_kwargs, build_backbone, export_backbone_state,
                             init_weights, load_backbone, save_backbone)


def test_resnet_small_stem_keeps_full_resolution_and_large_inputs_keep_the_imagenet_stem() -> None:
    small, f = build_backbone("resnet18", 16)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, nn.Identity)
    seen: list[tuple[int, ...]] = []
    small.layer1.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        assert small(torch.randn(2, 3, 16, 16)).shape == (2, f) == (2, 512)
    assert seen == [(2, 64, 16, 16)]          # the ImageNet stem would give 4x4 here
    large, _ = build_backbone("resnet18", 72)
    assert large.conv1.kernel_size == (7, 7) and isinstance(large.maxpool, nn.MaxPool2d)


def test_resnet50_small_stem_feature_size() -> None:
    net, f = build_backbone("resnet50", 16)
    assert f == 2048 and net.conv1.kernel_size == (3, 3)
    with torch.no_grad():
        assert net(torch.randn(2, 3, 16, 16)).shape == (2, 2048)


@pytest.mark.parametrize("px, patch", [(32, 4), (64, 8)])
def test_small_vit_sees_an_8x8_token_grid_and_accepts_local_crops(px: int, patch: int) -> None:
    vit, f = build_backbone("vit_small_patch16_224", px)
    assert vit.patch_embed.proj.kernel_size == (patch, patch)
    assert vit.pos_embed.shape[1] == 1 + 8 * 8                 # cls token + 64 patches
    with torch.no_grad():
        assert vit(torch.randn(1, 3, px, px)).shape == (1, f) == (1, 384)
        assert vit(torch.randn(1, 3, px // 2, px // 2)).shape == (1, 384)   # local crop size


def test_bad_backbone_requests_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'resnet_nope'"):
        build_backbone("resnet_nope", 32)
    with pytest.raises(ValueError, match="divisible by 8"):
        build_backbone("vit_small_patch16_224", 36)
    with pytest.raises(ValueError, match="no small-image stem"):
        build_backbone("mobilenetv3_small_050", 32)


def _with_trained_bn_stats(net: nn.Module, px: int) -> nn.Module:
    """A few train-mode forwards so that BatchNorm buffers differ from their initial values."""
    net.train()
    with torch.no_grad():
        net(torch.randn(2, 3, px, px) * 3 + 1)
    return net.eval()


# vit_tiny shares vit_small's code path (VisionTransformer) at a quarter of the CPU time.
@pytest.mark.parametrize("name, px", [("resnet18", 16), ("resnet50", 16), ("vit_tiny_patch16_224", 32)])
def test_small_stem_export_loads_strictly_into_timm_with_the_documented_stem(name: str, px: int) -> None:
    torch.manual_seed(0)
    net, _ = build_backbone(name, px)
    net = _with_trained_bn_stats(net, px)
    state = export_backbone_state(nn.ModuleDict({"module": net})["module"])
    if name.startswith("resnet"):
        assert state["conv1.weight"].shape[-2:] == (3, 3)
    fresh = timm.create_model(name, num_classes=0, **backbone_kwargs(name, px))
    fresh = apply_small_stem(fresh, name, px).eval()
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 3, px, px)
    with torch.no_grad():
        assert torch.equal(fresh(x), net(x))


def test_large_image_export_loads_into_plain_timm_and_small_stem_export_does_not() -> None:
    torch.manual_seed(0)
    net = _with_trained_bn_stats(build_backbone("resnet18", 72)[0], 72)
    plain = timm.create_model("resnet18", num_classes=0).eval()
    result = plain.load_state_dict(export_backbone_state(net), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 3, 72, 72)
    with torch.no_grad():
        assert torch.equal(plain(x), net(x))
    small_state = export_backbone_state(build_backbone("resnet18", 16)[0])
    with pytest.raises(RuntimeError, match="conv1.weight"):   # 3x3 kernel vs the 7x7 stem
        timm.create_model("resnet18", num_classes=0).load_state_dict(small_state, strict=True)


def test_export_strips_wrapper_prefixes_and_returns_detached_cpu_copies() -> None:
    net, _ = build_backbone("resnet18", 16)

    class Wrapper(nn.Module):   # the key layout DDP ("module.") and torch.compile ("_orig_mod.") give
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Module()
            self.module._orig_mod = net

    state = export_backbone_state(Wrapper())
    assert set(state) == set(net.state_dict())
    assert all(not v.requires_grad and v.device.type == "cpu" for v in state.values())
    state["conv1.weight"].zero_()
    assert net.conv1.weight.abs().sum() > 0                    # a copy, not a view


def test_safetensors_export_loads_with_one_timm_call_and_records_the_small_stem(tmp_path) -> None:
    """Above 64 px, timm alone rebuilds the backbone from the file (README's call); at 64 px and below
    the file says small_stem and `load_backbone` rebuilds the 3x3 stem timm has no option for."""
    import json

    from safetensors import safe_open

    x = torch.randn(2, 3, 96, 96)
    big, _ = build_backbone("resnet18", 96)
    path = save_backbone(big, tmp_path / "big.safetensors", "resnet18", 96, {"method": "byol"})
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert (meta["timm_model"], meta["small_stem"], meta["method"]) == ("resnet18", "false", "byol")
    loaded = timm.create_model(meta["timm_model"], pretrained=True, num_classes=0,
                               pretrained_cfg_overlay={"file": str(path)}, **json.loads(meta["timm_kwargs"]))
    assert torch.allclose(loaded.eval()(x), big.eval()(x))

    small, _ = build_backbone("resnet18", 32)
    path = save_backbone(small, tmp_path / "small.safetensors", "resnet18", 32)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["small_stem"] == "true"
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(load_backbone(path).eval()(x), small.eval()(x))
    with pytest.raises(RuntimeError, match="size mismatch"):       # timm's 7x7 stem cannot take it
        timm.create_model("resnet18", pretrained=True, num_classes=0, pretrained_cfg_overlay={"file": str(path)})


def test_init_weights_read_timm_checkpoints_by_timm_conventions_and_refuse_other_networks(tmp_path) -> None:
    """`init_weights`: a timm state dict nested under `state_dict` with DDP prefixes (its EMA weights
    when present), or a plain safetensors file, gives the backbone without the classifier; missing keys,
    another stem and a trainer's backbone.safetensors of another model are one-line ValueErrors."""
    import safetensors.torch

    backbone, _ = build_backbone("test_resnet", 96)              # timm's own stem above 64 px
    trained = timm.create_model("test_resnet", pretrained=False, num_classes=10).state_dict()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in trained.items()}
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in trained.items()}}, tmp_path / "a.pth")
    torch.save({"state_dict": trained, "state_dict_ema": ema}, tmp_path / "ema.pth.tar")
    safetensors.torch.save_file(trained, str(tmp_path / "model.safetensors"))
    for name, expected in (("a.pth", trained), ("ema.pth.tar", ema), ("model.safetensors", trained)):
        weights = init_weights(tmp_path / name, backbone, "test_resnet", 96)
        assert weights.keys() == backbone.state_dict().keys() and "fc.weight" in expected
        assert all(torch.equal(v, expected[k]) for k, v in weights.items()), name
        backbone.load_state_dict(weights)

    del trained["layer1.0.conv1.weight"]
    torch.save(trained, tmp_path / "missing.bin")
    with pytest.raises(ValueError, match=r"does not fit a test_resnet backbone at 96 px \(missing layer1.0.conv1"):
        init_weights(tmp_path / "missing.bin", backbone, "test_resnet", 96)
    small, _ = build_backbone("test_resnet", 32)
    with pytest.raises(ValueError, match=r"other shapes: conv1.weight|unexpected conv1.0.weight"):
        init_weights(tmp_path / "a.pth", small, "test_resnet", 32)
    other = save_backbone(build_backbone("resnet18", 96)[0], tmp_path / "backbone.safetensors", "resnet18", 96)
    with pytest.raises(ValueError, match=r"holds a resnet18 backbone .* set model.backbone=resnet18"):
        init_weights(other, backbone, "test_resnet", 96)
