"""UOTA weights against a literal transcription of the supplement's pseudo-code W() and of Ledoit and
Wolf's shrinkage (one draw per sample); the exact inverse wherever Sigma is well-posed, the degenerate
setup where it is not, one weight per sample at M = 2, and the weights that spread on real features
of the default config."""

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
    """The exact inverse on the pseudo-code's Sigma / N: the pseudo-code; on the public code's
    Sigma / (M N): the pseudo-code at tau / M (the same tau M times sharper). Where Sigma is
    well-posed the default is that exact inverse, and the mean squared distance is then rank(Sigma)
    = D on the M N scale."""
    torch.manual_seed(0)
    z = torch.randn(4, 10, 3, dtype=torch.float64)
    torch.testing.assert_close(uota_weights(z, 2.0, "none", "n").w, literal_W(z, 2.0), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(uota_weights(z, 2.0, "none", "mn").w, literal_W(z, 2.0 / 4), rtol=1e-9, atol=1e-12)
    default = uota_weights(z, 2.0)
    torch.testing.assert_close(default.w, literal_W(z, 2.0 / 4), rtol=1e-9, atol=1e-12)
    assert float(default.shrink) == 0.0 and float(default.d2) == pytest.approx(3.0, rel=1e-9)


def literal_ledoit_wolf(x: torch.Tensor) -> torch.Tensor:
    """Ledoit & Wolf (2004), Lemma 3.1 / Sec. 3.3, with loops over the draws, in float64: x is (M, N, D),
    draw i the scatter S_i = sum_j x_ij x_ij^T / M of sample i (M = 1: the paper's rows)."""
    m, n, d = x.shape
    s_i = [sum(torch.outer(x[j, i], x[j, i]) for j in range(m)) / m for i in range(n)]
    s = sum(s_i) / n
    norm2 = lambda a: float(torch.trace(a @ a.T)) / d                         # noqa: E731
    mu = float(torch.trace(s)) / d
    d2 = norm2(s - mu * torch.eye(d, dtype=x.dtype))
    b2 = min(sum(norm2(si - s) for si in s_i) / n ** 2, d2)
    return b2 / d2 * mu * torch.eye(d, dtype=x.dtype) + (d2 - b2) / d2 * s


@pytest.mark.parametrize("m, n, d", [(1, 40, 6), (1, 12, 30), (1, 8, 8), (3, 10, 6), (8, 4, 12)])
def test_ledoit_wolf_matches_the_paper(m: int, n: int, d: int):
    x = torch.randn(m, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(m + n + d))
    x = x - x.mean(0) if m > 1 else x - x.mean(1, keepdim=True)
    got, alpha = ledoit_wolf(x)
    torch.testing.assert_close(got, literal_ledoit_wolf(x), rtol=1e-9, atol=1e-12)
    assert 0.0 < float(alpha) <= 1.0


def test_ledoit_wolf_counts_a_sample_once_at_two_views():
    """M = 2: the rows d_i1 and d_i2 = -d_i1 are one draw, so the intensity is the N-row estimator's
    (counted as 2 N rows it came out half of it)."""
    d1 = torch.randn(1, 24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    d1 = d1 - d1.mean(1, keepdim=True)
    (s_pair, a_pair), (s_rows, a_rows) = ledoit_wolf(torch.cat([d1, -d1])), ledoit_wolf(d1)
    torch.testing.assert_close(a_pair, a_rows, rtol=1e-12, atol=0)
    torch.testing.assert_close(s_pair, s_rows, rtol=1e-12, atol=1e-15)
    _, a_as_rows = ledoit_wolf(torch.cat([d1, -d1], dim=1))       # 2 N rows taken as independent
    assert float(a_as_rows) == pytest.approx(float(a_rows) / 2, rel=1e-9)


@pytest.mark.parametrize("shrinkage", ["auto", "none", "ledoit_wolf"])
def test_two_views_of_a_sample_share_their_weight(shrinkage: str):
    """M = 2 (BYOL+UOTA): Delta_i2 = -Delta_i1, so both views of sample i get one weight."""
    z = torch.randn(2, 300, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    w = uota_weights(z, 20.0, shrinkage).w
    torch.testing.assert_close(w[0], w[1], rtol=1e-10, atol=0)
    assert float(w.std()) > 0.01


def test_the_pseudo_code_reweights_nothing_at_byol_s_shapes_and_shrinkage_does():
    """BYOL+UOTA: M = 2 views, a global batch N <= the width D (the synthetic preset, ImageNet on one
    GPU): the exact (pseudo-)inverse puts every deviation at one distance N, so every weight is 1;
    the default shrinks there, and a sample whose views lie far apart gets the smallest weight."""
    z = torch.randn(2, 64, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    z[:, 5] *= 3.0                                  # one sample whose two views lie far apart
    assert degenerate(2, 64, 128) and degenerate(2, 256, 256) and not degenerate(2, 512, 256)
    assert not degenerate(8, 64, 128)
    exact = uota_weights(z, 200.0, "none")
    assert float(exact.w.std()) < 1e-6 and float(exact.d2) == pytest.approx(64.0, rel=1e-6)
    default = uota_weights(z, 200.0)
    assert float(default.shrink) > 0
    w = default.w
    assert float(w.std()) > 0.01 and float(w[:, 5].max()) == float(w.min()) < 0.9 * float(w.median())


@pytest.mark.slow
def test_the_default_config_spreads_its_weights_on_real_features(tiny_data_root, tmp_path):
    """The uota preset on synthetic (BYOL+UOTA, batch 64 against a 128-d predictor: the degenerate
    shape, so Ledoit-Wolf), trained a few steps past N_warm: uota/w_std in metrics.jsonl well above 0."""
    from train.launch import train
    from train.resolve import load_config

    cfg = load_config(["method=uota", "data=synthetic", f"data.root={tiny_data_root}", "data.backend=torch",
                       "data.num_workers=1", "optim.steps=5", "optim.warmup_steps=1", "run.log_every=1",
                       "run.max_eval_samples=16", f"run.out_dir={tmp_path}", "run.name=run"])
    assert (cfg.data.batch_size, cfg.model.proj_out, cfg.objective.shrinkage) == (64, 128, "auto")
    records = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert "uota/w_std" not in steps[0] and all("uota/w_std" in r for r in steps[1:])   # N_warm: 10 % of 5 steps
    # Ledoit-Wolf's weights on the first steps' features (the pseudo-inverse's are all exactly 1). Over
    # run.seed 0-4 x 1 or 2 threads the least w_std of a run was 0.0297-0.0345 (mean 0.0323, spread 0.0017)
    # and its largest w_max 1.16-1.24 (1.20, 0.026): both bars over three spreads under.
    assert min(r["uota/w_std"] for r in steps[1:]) > 0.02 and max(r["uota/w_max"] for r in steps[1:]) > 1.1
    assert min(r["uota/shrink"] for r in steps[1:]) > 0


def test_uota_weights_average_one_and_carry_no_gradient():
    torch.manual_seed(1)
    z = torch.randn(8, 16, 5, dtype=torch.float64, requires_grad=True)
    w = uota_weights(z, 5.0).w
    assert w.shape == (8, 16)
    assert not w.requires_grad
    torch.testing.assert_close(w.mean(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.all(w >= 0)


def test_uota_downweights_an_injected_outlier_view():
    torch.manual_seed(2)
    z = torch.randn(6, 20, 4, dtype=torch.float64) * 0.1 + torch.randn(1, 20, 4, dtype=torch.float64)
    z[3, 7] += 5.0                                                 # one view far from its siblings
    w = uota_weights(z, 10.0).w
    assert w[3, 7] == w.min()
    assert w[3, 7] < 0.5 * w.median()


def test_uota_large_tau_gives_uniform_weights():
    z = torch.randn(4, 12, 3, dtype=torch.float64)
    torch.testing.assert_close(uota_weights(z, 1e9).w, torch.ones(4, 12, dtype=torch.float64))


@pytest.mark.parametrize("shrinkage", ["auto", "ledoit_wolf", "none"])
def test_uota_weights_finite_when_sigma_is_rank_deficient(shrinkage: str):
    z = torch.randn(2, 3, 16)                                      # D > (M-1) N: singular Sigma
    w = uota_weights(z, 1.0, shrinkage).w
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))


@pytest.mark.parametrize("data", ["synthetic", "cifar10", "cifar100", "imagenet"])
def test_mocov2star_queue_is_as_wide_as_the_projector_on_every_preset(data):
    """The README's MoCo-v2*+UOTA command on every data preset: the queue width follows the model
    (it was fixed at 128 and the first step failed where the preset's projector is 256 wide)."""
    from train.resolve import load_config

    mocov2 = ["method=uota", f"data={data}", "objective.base=mocov2star", "views.recipe=multicrop8", "model.pred_hidden=0"]
    assert load_config(mocov2).objective.dim == load_config(mocov2).model.proj_out
    assert load_config([*mocov2, "model.proj_out=128"]).objective.dim == 128


def test_a_degenerate_setup_without_shrinkage_is_a_one_line_error():
    from train.config import ConfigError
    from train.resolve import load_config

    with pytest.raises(ConfigError, match="every UOTA weight would be exactly 1; use objective.shrinkage=auto"):
        load_config(["method=uota", "data=synthetic", "objective.shrinkage=none"])
    cfg = load_config(["method=uota", "data=synthetic", "objective.shrinkage=none", "objective.base=mocov2star",
                       "views.recipe=multicrop8", "model.pred_hidden=0", "data.batch_size=64"])
    assert cfg.objective.shrinkage == "none"                  # 64 x 7 deviations > 128: not degenerate
