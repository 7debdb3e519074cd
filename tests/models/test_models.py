"""Backbones, heads, the multi-crop forward, the EMA target and the timm export."""

from __future__ import annotations

import timm
import torch

from models.backbone import apply_small_stem, build_backbone, export_backbone_state
from models.ema import make_target
from models.multicrop import build_model


def test_small_stem_keeps_resolution_and_large_inputs_use_the_imagenet_stem() -> None:
    small, f = build_backbone("resnet18", 32)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, torch.nn.Identity)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, f) == (2, 512)
    large, _ = build_backbone("resnet18", 224)
    assert large.conv1.kernel_size == (7, 7)


def test_vit_small_builds_for_small_images() -> None:
    vit, f = build_backbone("vit_small_patch16_224", 32)
    assert vit(torch.randn(2, 3, 32, 32)).shape == (2, f)


def test_multicrop_forward_equals_a_separate_forward_per_group_and_calls_backbone_once_per_size() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", 32, proj_hidden=64, proj_out=16, pred_hidden=32).eval()
    calls: list[tuple[int, ...]] = []
    model.backbone.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    g = torch.randn(2, 3, 3, 32, 32)      # (V, B, 3, H, W)
    w = torch.randn(2, 3, 3, 32, 32)
    l = torch.randn(4, 3, 3, 16, 16)
    with torch.no_grad():
        outs = model([g, l, w])
        assert len(calls) == 2             # one call for 32 px (g and w together), one for 16 px
        for group, out in zip([g, l, w], outs):
            for v in range(group.shape[0]):
                h = model.backbone(group[v])
                z = model.projector(h)
                torch.testing.assert_close(out.h[v], h, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(out.z[v], z, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(out.p[v], model.predictor(z), rtol=1e-4, atol=1e-5)


def test_ema_update_follows_the_formula_and_copies_buffers() -> None:
    torch.manual_seed(0)
    online = build_model("resnet18", 32, 32, 16, 0)
    target = make_target(online)
    assert all(not p.requires_grad for p in target.parameters())
    with torch.no_grad():
        for p in online.parameters():
            p.add_(torch.randn_like(p))
        for b in online.buffers():
            if b.dtype.is_floating_point:
                b.add_(1.0)
    before = [p.clone() for p in target.parameters()]
    target.update_from(online, momentum=0.9)
    for t, t0, o in zip(target.parameters(), before, online.parameters()):
        torch.testing.assert_close(t, 0.9 * t0 + 0.1 * o)
    for tb, ob in zip(target.buffers(), online.buffers()):
        assert torch.equal(tb, ob)
    snapshot = [p.clone() for p in target.parameters()]
    target.update_from(online, momentum=1.0)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, target.parameters()))
    target.update_from(online, momentum=0.0)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), online.parameters()))


def test_exported_backbone_loads_in_timm_strictly_with_identical_features() -> None:
    torch.manual_seed(0)
    for name, px in [("resnet18", 32), ("resnet18", 96)]:
        model = build_model(name, px, 32, 16, 0).eval()
        state = export_backbone_state(model.backbone)
        fresh = apply_small_stem(timm.create_model(name, num_classes=0), name, px).eval()
        result = fresh.load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        x = torch.randn(2, 3, px, px)
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), model.backbone(x))
