"""Every objective trains under bf16 autocast, as on a GPU, past every warm-up: the CPU autocast runs
the same mixed-precision casts (matmuls in bf16), so a float32 island that forgot to opt out of
autocast (UOTA's pseudo-inverse, covariance maths) fails here and not first on a user's GPU."""

from __future__ import annotations

import math

import pytest
import torch

from models.ema import make_target
from models.multicrop import build_model
from train.loop import train_step
from train.objectives import OBJECTIVES
from train.objectives.base import StepValues
from train.setup import Parts
from tests.train.test_objectives_modules import DIM, GLOBAL_PX, make_batch


class BF16Features(torch.nn.Module):
    """The backbone with its convolutions in float32 and its features handed on in bf16, as a GPU's
    autocast hands them to the heads: a CPU without bf16 instructions runs bf16 convolutions by
    im2col, 7x slower than float32 (1.4 s a relicv2 step at 16 px on 2 AVX2 cores, a fifth of the
    suite), and the heads and objectives, not the convolutions, are what this test is about."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            feats = self.backbone(x.float())
        return feats.to(torch.bfloat16) if torch.is_autocast_enabled("cpu") else feats


# Each objective with its warm-ups short enough to pass within the steps below.
WARMED = {"relicv2": {"num_negatives": 3}, "uota": {"queue_size": 24, "dim": DIM, "warmup_epochs": 1.0}}
EPOCHS = (0.0, 0.5, 1.0, 1.5, 2.0)      # one step per value: before, at and after every warm-up


def bf16_parts(name: str) -> Parts:
    cls = OBJECTIVES[name]
    objective = cls(cls.Config(**WARMED.get(name, {})))
    torch.manual_seed(0)
    online = build_model("test_resnet", GLOBAL_PX, proj_hidden=32, proj_out=DIM, pred_hidden=32)
    online.backbone = BF16Features(online.backbone)
    optimizer = torch.optim.SGD(list(online.parameters()) + list(objective.parameters()), lr=0.01)
    optimizer.param_groups[0]["wd_scale"] = 1.0           # what train.optim.build_optimizer sets
    return Parts(objective=objective, loader=None, online=online,
                 target=make_target(online) if objective.needs.target else None,
                 optimizer=optimizer,
                 scaler=torch.amp.GradScaler("cpu", enabled=False), device=torch.device("cpu"), amp=True,
                 clip=1.0, first_non_finite=torch.full((), -1, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_trains_under_bf16_autocast_past_its_warmups(name: str) -> None:
    parts = bf16_parts(name)
    losses, logs = [], []
    for step, epoch in enumerate(EPOCHS):
        s = StepValues(step=step, total_steps=len(EPOCHS), epoch=epoch, lr=0.01, weight_decay=0.0, ema=0.99)
        out = train_step(parts, make_batch(parts.objective.needs, seed=step), s)
        losses.append(out.loss.item())
        logs.append(set(out.logs))
    assert all(math.isfinite(x) for x in losses), losses
    assert int(parts.first_non_finite) == -1
    if name == "uota":                   # the reweighting ran (after its warm-up), not only the base
        assert "uota/w_min" not in logs[0] and "uota/w_min" in logs[-1]
