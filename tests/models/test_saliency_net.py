"""The saliency network: a timm feature pyramid + FPN decoder, initialised from a viewmill backbone."""

from __future__ import annotations

import pytest
import torch

from models.backbone import build_backbone, save_backbone
from models.saliency import SaliencyNet, backbone_source, build_saliency_net, saliency_probabilities


@pytest.mark.parametrize("small_stem", [False, True])
def test_logits_have_the_input_size_and_the_small_stem_keeps_full_resolution(small_stem: bool) -> None:
    net = SaliencyNet("test_resnet", small_stem=small_stem).eval()
    with torch.no_grad():
        assert net(torch.randn(2, 3, 48, 40)).shape == (2, 1, 48, 40)
        finest = net.encoder(torch.randn(1, 3, 32, 32))[0]
    assert finest.shape[-1] == (32 if small_stem else 16)


@pytest.mark.parametrize("image_px", [32, 96])
def test_init_loads_every_encoder_weight_of_an_exported_backbone(tmp_path, image_px: int) -> None:
    torch.manual_seed(0)
    backbone, _ = build_backbone("test_resnet", image_px)
    path = save_backbone(backbone, tmp_path / "backbone.safetensors", "test_resnet", image_px)
    net = build_saliency_net("resnet50", init=tmp_path)        # a run folder; its backbone wins over the name
    assert net.backbone_name == "test_resnet" and net.small_stem == (image_px <= 64)
    want = backbone.state_dict()
    got = net.encoder.state_dict()
    assert set(got) <= set(want)
    for k, v in got.items():
        assert torch.equal(v, want[k]), k
    assert backbone_source(path)["image_px"] == str(image_px)


def test_bad_init_is_a_one_line_error_naming_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="backbone.safetensors"):
        backbone_source(tmp_path)                              # a folder without one
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="not checkpoint.pt"):
        backbone_source(tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="ResNet"):
        SaliencyNet("vit_small_patch16_224")


def test_flip_averaged_probabilities_are_flip_equivariant() -> None:
    torch.manual_seed(0)
    net = SaliencyNet("test_resnet").eval()
    x = torch.randn(2, 3, 32, 32)
    p = saliency_probabilities(net, x)
    assert p.shape == (2, 32, 32) and 0 <= float(p.min()) and float(p.max()) <= 1
    torch.testing.assert_close(saliency_probabilities(net, x.flip(-1)), p.flip(-1))
