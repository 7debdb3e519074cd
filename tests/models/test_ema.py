"""The EMA target: creation, the update formula on parameters, and the buffer policy."""

from __future__ import annotations

import pytest
import torch

from models.ema import ema_update_, make_target
from models.multicrop import SSLModel, build_model


def _pair() -> tuple[SSLModel, SSLModel]:
    """An online network whose parameters and buffers have moved away from a fresh target."""
    torch.manual_seed(0)
    online = build_model("test_resnet", 16, proj_hidden=32, proj_out=16, pred_hidden=32)
    target = make_target(online)
    with torch.no_grad():
        for p in online.parameters():
            p.add_(torch.randn_like(p))
    online([torch.randn(1, 4, 3, 16, 16)])          # train mode: BN running statistics move
    return online, target


def test_make_target_is_an_equal_frozen_copy_in_the_same_mode() -> None:
    online = build_model("test_resnet", 16, 32, 16, 0)
    target = make_target(online)
    assert target is not online and target.training
    assert all(not p.requires_grad for p in target.parameters())
    assert all(p.requires_grad for p in online.parameters())
    assert all(torch.equal(t, o) for t, o in zip(target.state_dict().values(), online.state_dict().values()))
    assert not make_target(online.eval()).training


def test_update_averages_parameters_and_copies_buffers() -> None:
    online, target = _pair()
    before = [p.clone() for p in target.parameters()]
    assert not all(torch.equal(t, o) for t, o in zip(target.buffers(), online.buffers()))
    target.update_from(online, momentum=0.9)
    for t, t0, o in zip(target.parameters(), before, online.parameters()):
        torch.testing.assert_close(t, 0.9 * t0 + 0.1 * o.detach())
        assert not t.requires_grad and t.grad_fn is None
    for (name, tb), ob in zip(target.named_buffers(), online.buffers()):
        assert torch.equal(tb, ob), name                    # running stats and batch counters
    assert int(target.backbone.bn1.num_batches_tracked) == 1


def test_momentum_one_keeps_the_target_and_zero_copies_online() -> None:
    online, target = _pair()
    params = [p.clone() for p in target.parameters()]
    ema_update_(target, online, momentum=1.0)
    assert all(torch.equal(a, b) for a, b in zip(params, target.parameters()))
    ema_update_(target, online, momentum=0.0)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), online.parameters()))


def test_online_gradients_are_untouched_and_bad_calls_are_value_errors() -> None:
    online, target = _pair()
    online([torch.randn(1, 2, 3, 16, 16)])[0].p.sum().backward()
    grads = [p.grad.clone() for p in online.parameters()]
    target.update_from(online, momentum=0.5)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, online.parameters()))
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\]"):
        target.update_from(online, momentum=1.5)
    other = build_model("test_resnet", 16, 32, 16, 0)          # no predictor: other structure
    with pytest.raises(ValueError, match="differ in structure"):
        ema_update_(target, other, momentum=0.5)
