"""UOTA weights against a literal transcription of the supplement's pseudo-code W()."""

from __future__ import annotations

import torch

from train.objectives.uota import uota_weights


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
    torch.manual_seed(0)
    z = torch.randn(4, 10, 3, dtype=torch.float64)
    torch.testing.assert_close(uota_weights(z, 2.0), literal_W(z, 2.0), rtol=1e-9, atol=1e-12)


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


def test_uota_weights_finite_when_sigma_is_rank_deficient():
    z = torch.randn(2, 3, 16)                                      # D > (M-1) N: singular Sigma
    w = uota_weights(z, 1.0)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
