"""The multi-crop forward: same numbers as a forward per view, one backbone call per resolution."""

from __future__ import annotations

import copy

import pytest
import torch

from models.multicrop import SSLModel, build_model


def _tiny(pred_hidden: int = 32) -> SSLModel:
    torch.manual_seed(0)
    return build_model("test_resnet", 16, proj_hidden=32, proj_out=16, pred_hidden=pred_hidden)


def _groups() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 2, 3, 16, 16, generator=g),    # (V, B, 3, H, W) global views
            torch.randn(3, 2, 3, 8, 8, generator=g),      # local views
            torch.randn(1, 2, 3, 16, 16, generator=g)]    # weak views, same size as global


def _count_backbone_calls(model: SSLModel) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    model.backbone.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    return calls


def test_eval_mode_multicrop_forward_equals_a_separate_forward_per_view() -> None:
    # In eval mode BatchNorm uses its running statistics, so each view's output cannot depend on
    # which other views share its backbone call: batching must change nothing.
    model = _tiny().eval()
    groups = _groups()
    with torch.no_grad():
        outs = model(groups)
        assert len(outs) == 3
        for group, out in zip(groups, outs):
            assert out.h.shape == (*group.shape[:2], model.feat_dim)
            assert out.z.shape == out.p.shape == (*group.shape[:2], 16)
            for v in range(group.shape[0]):
                h = model.backbone(group[v])                  # (B, F)
                z = model.projector(h)                        # (B, D)
                torch.testing.assert_close(out.h[v], h, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(out.z[v], z, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(out.p[v], model.predictor(z), rtol=1e-4, atol=1e-5)


def test_backbone_runs_once_per_resolution_with_every_view_of_that_resolution() -> None:
    model = _tiny().eval()
    calls = _count_backbone_calls(model)
    with torch.no_grad():
        model(_groups())
    # 16 px: 2 global + 1 weak view of 2 samples in one call; 8 px: 3 local views of 2 samples.
    assert calls == [(6, 3, 16, 16), (6, 3, 8, 8)]


def test_train_mode_batchnorm_sees_all_views_of_a_resolution_together() -> None:
    # In train mode BN normalises with batch statistics, so a per-view forward would give other
    # numbers by design. The documented semantics are one batch per resolution: compare with that,
    # outputs and BN running statistics both.
    model = _tiny()
    reference = copy.deepcopy(model)
    groups = _groups()
    outs = model(groups)
    big = torch.cat([groups[0].flatten(0, 1), groups[2].flatten(0, 1)])   # (6, 3, 16, 16)
    small = groups[1].flatten(0, 1)                                        # (6, 3, 8, 8)
    z_big = reference.projector(reference.backbone(big))                   # (6, D)
    z_small = reference.projector(reference.backbone(small))               # (6, D)
    p_big, p_small = reference.predictor(z_big), reference.predictor(z_small)
    torch.testing.assert_close(outs[0].z.flatten(0, 1), z_big[:4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[2].z.flatten(0, 1), z_big[4:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1].z.flatten(0, 1), z_small, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[2].p.flatten(0, 1), p_big[4:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1].p.flatten(0, 1), p_small, rtol=1e-4, atol=1e-5)
    for b_model, b_ref in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b_model, b_ref, rtol=1e-4, atol=1e-6)
    assert int(model.backbone.bn1.num_batches_tracked) == 2                 # once per resolution


def test_without_predictor_p_is_z_and_gradients_reach_every_group() -> None:
    model = _tiny(pred_hidden=0)
    assert model.predictor is None
    groups = [g.requires_grad_() for g in _groups()]
    outs = model(groups)
    assert all(out.p is out.z for out in outs)
    sum(out.z.square().sum() for out in outs).backward()
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in groups)


def test_a_group_that_is_not_five_dimensional_is_a_value_error() -> None:
    model = _tiny().eval()
    with pytest.raises(ValueError, match=r"view group 1 must be a \(V, B, 3, H, W\) tensor"):
        model([torch.randn(2, 2, 3, 16, 16), torch.randn(2, 3, 16, 16)])
    with pytest.raises(ValueError, match="skip None"):
        model([torch.randn(2, 2, 3, 16, 16), None])


def test_bn_per_view_normalises_each_view_with_its_own_statistics() -> None:
    """In train mode the shared forward mixes the views' BatchNorm statistics; `bn_per_view` gives
    exactly one forward per view (what the official BYOL / MoCo v3 / SDMP code runs)."""
    from models.multicrop import build_model

    torch.manual_seed(0)
    shared = build_model("test_resnet", 16, 32, 16, 32).train()
    per_view = build_model("test_resnet", 16, 32, 16, 32, bn_per_view=True).train()
    per_view.load_state_dict(shared.state_dict())
    g = torch.Generator().manual_seed(1)
    clean, mixed = torch.randn(2, 4, 3, 16, 16, generator=g), 3 + torch.randn(1, 4, 3, 16, 16, generator=g)
    got = per_view([clean, mixed])
    for v, x in ((0, clean[0]), (1, clean[1])):
        (alone,) = shared([x[None]])
        torch.testing.assert_close(got[0].p[v], alone.p[0])
    (alone,) = shared([mixed])
    torch.testing.assert_close(got[1].z[0], alone.z[0])
    (together,) = shared([torch.cat([clean, mixed])])
    assert not torch.allclose(together.z[0], got[0].z[0], atol=1e-3)


def test_moco_v3_resnet_heads_end_in_an_affine_free_batchnorm_each():
    """moco-v3's `MoCo_ResNet`: a 2-layer projector and a 2-layer predictor, both ending in
    BatchNorm1d(affine=False) after a bias-free Linear; SDMP's ResNet predictor has none."""
    from torch import nn

    def layout(head: nn.Module) -> list[str]:
        return [f"{type(m).__name__}{'' if not isinstance(m, nn.BatchNorm1d) else m.affine}" for m in head]

    moco = build_model("test_resnet", 16, 32, 16, 32, proj_layers=2, proj_last_bn=True, pred_last_bn=True)
    assert layout(moco.projector) == layout(moco.predictor) == ["Linear", "BatchNorm1dTrue", "ReLU", "Linear",
                                                                 "BatchNorm1dFalse"]
    assert moco.predictor[3].bias is None
    sdmp = build_model("test_resnet", 16, 32, 16, 32, proj_layers=2, proj_last_bn=True)
    assert layout(sdmp.predictor)[-1] == "Linear" and sdmp.predictor[-1].bias is not None
