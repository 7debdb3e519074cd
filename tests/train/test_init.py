"""`model.init`: a new run (step 0, fresh optimiser) whose online and target backbones start from the
weights of a `backbone.safetensors`; the loop loads them, a resumed run does not need them."""

from __future__ import annotations

import safetensors.torch
import torch

from models.backbone import build_backbone, save_backbone
from train import checkpoint
from train.resolve import load_config
from train.setup import build_parts


def saved_backbone(path, seed: int = 123):
    """A test_resnet backbone at 32 px with weights of its own seed, exported as `make train` does."""
    torch.manual_seed(seed)
    backbone, _ = build_backbone("test_resnet", 32)
    for m in backbone.modules():                # BatchNorm statistics of its own too
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return save_backbone(backbone, path, "test_resnet", 32, {"method": "simclr"})


def test_model_init_gives_online_and_target_the_saved_backbone_at_step_0(tiny_args, tmp_path) -> None:
    path = saved_backbone(tmp_path / "backbone.safetensors")
    weights = safetensors.torch.load_file(str(path))
    cfg = load_config(tiny_args("byol", tmp_path / "runs", f"model.init={path}"))
    parts = build_parts(cfg, torch.device("cpu"), "torch")
    random = build_parts(load_config(tiny_args("byol", tmp_path / "runs")), torch.device("cpu"), "torch")
    for network in (parts.online, parts.target):
        state = network.backbone.state_dict()
        assert state.keys() == weights.keys()
        for key, tensor in weights.items():
            assert torch.equal(state[key], tensor), key
    assert not torch.equal(random.online.backbone.state_dict()["conv1.weight"], weights["conv1.weight"])
    projector = random.online.projector.state_dict()    # the heads stay those of the seed
    assert all(torch.equal(v, projector[k]) for k, v in parts.online.projector.state_dict().items())
    assert not parts.optimizer.state


def test_the_loop_starts_from_model_init(tiny_args, tmp_path, capsys) -> None:
    """One step at learning rate 0 keeps the backbone's parameters: the checkpoint holds the file's."""
    from train.launch import train

    path = saved_backbone(tmp_path / "backbone.safetensors")
    weights = safetensors.torch.load_file(str(path))
    run = train(load_config(tiny_args("byol", tmp_path / "runs", f"model.init={path}", "optim.lr=0.0",
                                      "run.stop_after_steps=1")))
    assert f"backbone initialised from {path}" in capsys.readouterr().out
    state = checkpoint.load(run / "checkpoint.pt")
    assert state["step"] == 1
    for network in ("online", "target"):
        for name, _ in build_backbone("test_resnet", 32)[0].named_parameters():
            assert torch.equal(state[network][f"backbone.{name}"], weights[name]), (network, name)
