"""UOTA weights against a literal transcription of the supplement's pseudo-code W() and of Ledoit and
Wolf's shrinkage; the degenerate setup the pseudo-code meets at the shipped batch sizes, and the
weights that spread on real features of the default config."""

from __future__ import annotations

import json

import pytest
import torch

from train.objectives.uota import degenerate, ledoit_wolf, uota_weights


def literal_W(multi_z, tau):
    """Supplement Sec. 2 pseudo-code, line by line (full (MN, MN) product, exact inverse)."""
    m, n, d = multi_z.shape
    z_mu = multi_z.mean(dim=0, keepdim=True)                      # Eq.(M.10): (1,N,D)
    z_delta = (multi_z - z_mu).reshape(-1, d).T                   # Eq.(M.10): (D,M*N)
    sigma = torch.mm(z_delta, z_delta.T) / n                      # Eq.(M.10): (D,D)
    tmp = torch.mm(z_delta.T, torch.inverse(sigma) / tau)
    # The pseudo-code's `.diagonal(-2, -1)` means the last two dims (positionally it would be an
    # offset), so keywords are spelled out here.
    w = torch.exp(-torch.mm(tmp, z_delta)).diagonal(dim1=-2, dim2=-1)   # Eq.(M.9): (M*N,)
    w = w / w.sum() * (m * n)                                     # Eq.(M.11): (M*N,)
    return w.reshape(m, n)


def test_uota_weights_match_the_pseudo_code():
    """Without shrinkage, on the pseudo-code's Sigma / N: the pseudo-code; on the public code's
    Sigma / (M N): the pseudo-code at tau / M (the same tau M times sharper)."""
    torch.manual_seed(0)
    z = torch.randn(4, 10, 3, dtype=torch.float64)
    torch.testing.assert_close(uota_weights(z, 2.0, "none", "n"), literal_W(z, 2.0), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(uota_weights(z, 2.0, "none", "mn"), literal_W(z, 2.0 / 4), rtol=1e-9, atol=1e-12)


def literal_ledoit_wolf(x: torch.Tensor) -> torch.Tensor:
    """Ledoit & Wolf (2004), Lemma 3.1 / Sec. 3.3, with loops over the rows, in float64 (x centred)."""
    k, d = x.shape
    s = sum(torch.outer(x[i], x[i]) for i in range(k)) / k
    norm2 = lambda a: float(torch.trace(a @ a.T)) / d                         # noqa: E731
    m = float(torch.trace(s)) / d
    d2 = norm2(s - m * torch.eye(d, dtype=x.dtype))
    b2 = min(sum(norm2(torch.outer(x[i], x[i]) - s) for i in range(k)) / k ** 2, d2)
    return b2 / d2 * m * torch.eye(d, dtype=x.dtype) + (d2 - b2) / d2 * s


@pytest.mark.parametrize("k, d", [(40, 6), (12, 30), (8, 8)])
def test_ledoit_wolf_matches_the_paper(k: int, d: int):
    x = torch.randn(k, d, dtype=torch.float64, generator=torch.Generator().manual_seed(k + d))
    x = x - x.mean(0)
    got, alpha = ledoit_wolf(x)
    torch.testing.assert_close(got, literal_ledoit_wolf(x), rtol=1e-9, atol=1e-12)
    assert 0.0 < alpha <= 1.0


def test_the_pseudo_code_reweights_nothing_at_byol_s_shapes_and_shrinkage_does():
    """BYOL+UOTA: M = 2 views, a global batch N <= the width D (every shipped preset): the
    pseudo-inverse puts every deviation at one distance, so every weight is 1."""
    z = torch.randn(2, 64, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    z[:, 5] *= 3.0                                  # one sample whose two views lie far apart
    assert degenerate(2, 64, 128) and not degenerate(2, 256, 128) and not degenerate(8, 64, 128)
    assert float(uota_weights(z, 200.0, "none").std()) < 1e-6
    w = uota_weights(z, 200.0, "ledoit_wolf")
    assert float(w.std()) > 0.01 and float(w[:, 5].max()) == float(w.min()) < 0.9 * float(w.median())


@pytest.mark.slow
def test_the_default_config_spreads_its_weights_on_real_features(tiny_data_root, tmp_path):
    """The uota preset on synthetic (BYOL+UOTA, batch 64 against a 128-d predictor: the degenerate
    shape), trained a few steps past N_warm: uota/w_std in metrics.jsonl well above 0."""
    from train.config import load_config
    from train.launch import train

    cfg = load_config(["method=uota", "data=synthetic", f"data.root={tiny_data_root}", "data.backend=torch",
                       "data.num_workers=1", "optim.steps=5", "optim.warmup_steps=1", "run.log_every=1",
                       "run.max_eval_samples=16", f"run.out_dir={tmp_path}", "run.name=run"])
    assert (cfg.data.batch_size, cfg.model.proj_out, cfg.objective.shrinkage) == (64, 128, "ledoit_wolf")
    records = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert "uota/w_std" not in steps[0] and all("uota/w_std" in r for r in steps[1:])   # N_warm: 10 % of 5 steps
    assert min(r["uota/w_std"] for r in steps[1:]) > 0.05 and max(r["uota/w_max"] for r in steps[1:]) > 1.1


def test_uota_weights_average_one_and_carry_no_gradient():
    torch.manual_seed(1)
    z = torch.randn(8, 16, 5, dtype=torch.float64, requires_grad=True)
    w = uota_weights(z, 5.0)
    assert w.shape == (8, 16)
    assert not w.requires_grad
    torch.testing.assert_close(w.mean(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.all(w >= 0)


def test_uota_downweights_an_injected_outlier_view():
    torch.manual_seed(2)
    z = torch.randn(6, 20, 4, dtype=torch.float64) * 0.1 + torch.randn(1, 20, 4, dtype=torch.float64)
    z[3, 7] += 5.0                                                 # one view far from its siblings
    w = uota_weights(z, 10.0)
    assert w[3, 7] == w.min()
    assert w[3, 7] < 0.5 * w.median()


def test_uota_large_tau_gives_uniform_weights():
    z = torch.randn(4, 12, 3, dtype=torch.float64)
    torch.testing.assert_close(uota_weights(z, 1e9), torch.ones(4, 12, dtype=torch.float64))


@pytest.mark.parametrize("shrinkage", ["ledoit_wolf", "none"])
def test_uota_weights_finite_when_sigma_is_rank_deficient(shrinkage: str):
    z = torch.randn(2, 3, 16)                                      # D > (M-1) N: singular Sigma
    w = uota_weights(z, 1.0, shrinkage)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))


@pytest.mark.parametrize("data", ["synthetic", "cifar10", "cifar100", "imagenet"])
def test_mocov2star_queue_is_as_wide_as_the_projector_on_every_preset(data):
    """The README's MoCo-v2*+UOTA command on every data preset: the queue width follows the model
    (it was fixed at 128 and the first step failed where the preset's projector is 256 wide)."""
    from train.config import load_config

    mocov2 = ["method=uota", f"data={data}", "objective.base=mocov2star", "views.recipe=multicrop8", "model.pred_hidden=0"]
    assert load_config(mocov2).objective.dim == load_config(mocov2).model.proj_out
    assert load_config([*mocov2, "model.proj_out=128"]).objective.dim == 128


def test_a_degenerate_setup_without_shrinkage_is_a_one_line_error():
    from train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="every UOTA weight would be exactly 1; use objective.shrinkage=ledoit_wolf"):
        load_config(["method=uota", "data=synthetic", "objective.shrinkage=none"])
    cfg = load_config(["method=uota", "data=synthetic", "objective.shrinkage=none", "objective.base=mocov2star",
                       "views.recipe=multicrop8", "model.pred_hidden=0", "data.batch_size=64"])
    assert cfg.objective.shrinkage == "none"                  # 64 x 7 deviations > 256: not degenerate
