"""The laws of the intra-batch mixes (pipelines/mixing.py's docstring), checked from what an engine
outputs: mixes of constant-colour images, whose pasted boxes and noise kinds are read back from the
pixels. The torch reference (tests/pipelines/test_mixing.py) and the DALI graph
(tests/pipelines/test_dali_backend.py) run the same checks."""

from __future__ import annotations

import torch


def pasted_boxes(mixed: torch.Tensor, source: torch.Tensor, tol: float) -> torch.Tensor:
    """(V, B, 4) long (y0, x0, y1, x1): the bounding box of the pixels where a mix differs from its
    source (all zeros where none does).

    Args:
        mixed, source: (V, B, 3, S, S) pixel levels.
        tol: largest difference that still counts as unchanged (rounding).
    """
    changed = (mixed - source).abs().amax(2) > tol                              # (V, B, S, S)
    rows, cols = changed.any(3), changed.any(2)                                  # (V, B, S)
    idx = torch.arange(changed.shape[-1])
    big = changed.shape[-1]

    def first_last(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.where(m, idx, big).amin(-1)
        hi = torch.where(m, idx + 1, 0).amax(-1)
        return torch.where(m.any(-1), lo, 0), hi

    y0, y1 = first_last(rows)
    x0, x1 = first_last(cols)
    return torch.stack([y0, x0, y1, x1], -1)


def check_sdmp_laws(mixer: str, lam_drawn: torch.Tensor, lam: torch.Tensor, boxes: torch.Tensor,
                    partner: torch.Tensor, size: int) -> int:
    """SDMP: flip partner; the same lam and the same box for every view of a sample (Eq. 1); box side
    floor(sqrt(1 - lam) * S); CutMix clipped at the border with lam the kept fraction; ResizeMix's box
    inside the image with lam = 1 - side^2 / S^2.

    Args:
        lam_drawn: (B,) the Beta draws. lam: (V, B) the weights the engine reports.
        boxes: (V, B, 4) the pasted boxes read back from the pixels. partner: (V, B).

    Returns:
        How many CutMix boxes were clipped at the border (callers check that clipping happened).
    """
    v, b = lam.shape
    assert torch.equal(partner, torch.arange(b - 1, -1, -1).expand(v, b))
    assert torch.allclose(lam, lam[:1].expand(v, b), atol=1e-6)
    assert torch.equal(boxes, boxes[:1].expand(v, b, 4))
    side = torch.floor(torch.sqrt(1 - lam_drawn.double()) * size).long()        # (B,)
    h, w = boxes[0, :, 2] - boxes[0, :, 0], boxes[0, :, 3] - boxes[0, :, 1]
    area = (h * w).double() / size**2
    if mixer == "mixup":
        assert torch.allclose(lam[0].double(), lam_drawn.double(), atol=1e-6)
        return 0
    assert torch.allclose(lam[0].double(), 1 - area, atol=1e-5)                 # lam = the kept fraction
    if mixer == "resizemix":                                                     # fully inside, never clipped
        assert torch.equal(h, side) and torch.equal(w, side)
        return 0
    inner = (boxes[0, :, :2] > 0).all(1) & (boxes[0, :, 2:] < size).all(1)       # clipped only at the border
    assert (h <= side).all() and (w <= side).all()
    assert torch.equal(h[inner], side[inner]) and torch.equal(w[inner], side[inner])
    return int((~inner & (side > 0) & ((h < side) | (w < side))).sum())


NO_LAW, UNKNOWN = -2, -1     # noise_kinds' codes besides the indices of mixing.DACL_NOISES


def noise_kinds(mixed: torch.Tensor, source: torch.Tensor, partner: torch.Tensor, lam: torch.Tensor,
                tol: float) -> torch.Tensor:
    """(V, B) long: which DACL noise made each mix, as an index into `mixing.DACL_NOISES`, read back
    from the pixels: linear (Eq. 3) lam x + (1 - lam) x~, geometric (Eq. 5) x^lam x~^(1 - lam) on
    [0, 1] levels, binary (Eq. 6) every element x's or x~'s; UNKNOWN where more
    than one law fits (lam near 1, or x and x~ too alike), NO_LAW where none does.

    Args:
        mixed, source: (V, B, 3, H, W) pixel levels in [0, 255]; source: the views before mixing.
        partner: (V, B) each positive's partner in the batch. lam: (V, B) its reported lam.
        tol: largest difference that still counts as equal (rounding).
    """
    v = mixed.shape[0]
    other = torch.stack([source[k][partner[k]] for k in range(v)])              # (V, B, 3, H, W)
    lam5 = lam.view(*lam.shape, 1, 1, 1).to(mixed.dtype)
    linear = lam5 * source + (1 - lam5) * other
    geometric = (source / 255).clamp_min(0) ** lam5 * (other / 255).clamp_min(0) ** (1 - lam5) * 255

    def fits(want: torch.Tensor) -> torch.Tensor:
        return (mixed - want).abs().amax((2, 3, 4)) <= tol

    binary = (((mixed - source).abs() <= tol) | ((mixed - other).abs() <= tol)).flatten(2).all(2)
    laws = torch.stack([fits(linear), fits(geometric), binary], -1)             # (V, B, 3): DACL_NOISES order
    n = laws.sum(-1)
    return torch.where(n == 1, laws.long().argmax(-1), torch.where(n == 0, NO_LAW, UNKNOWN))


def check_dacl_laws(partner: torch.Tensor, lam: torch.Tensor, kinds: torch.Tensor, alpha: float,
                    own: torch.Tensor, noises: set[int], drawn: torch.Tensor | None = None) -> None:
    """DACL: a partner other than itself per positive, independent across positives; lam in
    [alpha, 1]; every mix made by one of the noises; one noise function per sample, shared by its
    positives (DACL+: "apply this function to create both of the positive samples").

    Args:
        partner, lam: (V, B). kinds: (V, B) `noise_kinds` of the mixes.
        own: (B,) each column's own position in its batch (columns may span several batches).
        noises: the indices into `mixing.DACL_NOISES` the spec lists; all of them must be seen.
        drawn: (B,) the noise each sample drew, as an index into `mixing.DACL_NOISES`, where the
            engine reports it: the law read from its pixels must be that one.
    """
    v, b = lam.shape
    assert not bool((partner == own).any())
    assert float(lam.min()) >= alpha - 1e-6 and float(lam.max()) <= 1 + 1e-6
    assert bool((partner[0] != partner[1]).any()), "positives share their partners"
    assert not bool((kinds == NO_LAW).any()), f"{int((kinds == NO_LAW).sum())} mixes follow none of the DACL laws"
    known = (kinds >= 0).all(0)                                                  # (B,) both positives told apart
    assert int(known.sum()) >= b // 2, "too few mixes told apart"
    assert torch.equal(kinds[0][known], kinds[1][known]), "the positives of a sample use different noises"
    assert set(kinds[0][known].tolist()) == set(noises), "not the listed noises"
    if drawn is not None:
        assert torch.equal(kinds[0][known], drawn[known]), "a mix follows another law than the noise drawn for it"
