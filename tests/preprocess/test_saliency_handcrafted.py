"""The handcrafted saliency maps (RBD, MR, MC over SLIC superpixels; DSR, every method here and its
terms in test_saliency_dsr.py) and the quality scores."""

from __future__ import annotations

import numpy as np
import pytest

from preprocess.saliency import handcrafted as hc
from preprocess.saliency import quality


def disc_image(h: int = 64, w: int = 64, centre=(30, 24), radius: int = 14):
    """A blue disc on a flat light background, and its mask."""
    img = np.full((h, w, 3), (200, 200, 190), np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    disc = (yy - centre[0]) ** 2 + (xx - centre[1]) ** 2 < radius ** 2
    img[disc] = (30, 90, 200)
    return img, disc.astype(np.uint8) * 255


@pytest.mark.parametrize("method", hc.METHODS)
def test_each_method_finds_a_disc_on_a_flat_background(method) -> None:
    img, gt = disc_image()
    sal = hc.maps(img, methods=(method,))[method]
    assert sal.dtype == np.float32 and sal.shape == (64, 64)
    assert sal.min() >= 0.0 and sal.max() <= 1.0
    assert quality.iou(sal, gt) >= 0.9


def test_maps_keep_the_image_shape_of_a_non_square_image() -> None:
    img, gt = disc_image(48, 80, centre=(24, 50), radius=12)
    out = hc.maps(img, hc.METHODS)
    assert set(out) == set(hc.METHODS) and set(hc.maps(img)) == set(hc.DEFAULT_METHODS)
    for sal in out.values():
        assert sal.shape == (48, 80) and 0.0 <= sal.min() and sal.max() <= 1.0
        assert quality.iou(sal, gt) >= 0.8


def test_a_large_image_is_worked_at_the_capped_side_with_its_own_superpixel_count(monkeypatch) -> None:
    """An image larger than `max_work_px` is shrunk before SLIC (its cost grows with the pixels), and
    the superpixel count still follows its own size (H·W/600 of the reference RBD code, capped at
    500); the maps come back at the image's shape and still find the object."""
    seen = []
    build = hc.build_graph
    monkeypatch.setattr(hc, "build_graph", lambda image, slic: seen.append((image.shape, slic.segments))
                        or build(image, slic))
    img, gt = disc_image(300, 400, centre=(150, 240), radius=80)
    out = hc.maps(img, ("rbd", "mr"), work_px=64, max_work_px=192)
    assert seen == [((192, 192, 3), round(400 * 400 / 600))] * 2           # the image and its mirror image
    assert all(v.shape == (300, 400) and quality.iou(v, gt) >= 0.9 for v in out.values())
    seen.clear()
    hc.maps(np.tile(img, (4, 4, 1)), ("rbd",), work_px=64, max_work_px=256)  # 1200 x 1600: 4,267 at its own size
    assert seen == [((256, 256, 3), hc.MAX_SEGMENTS)] * 2
    seen.clear()
    hc.maps(img[:100, :100], ("rbd",), work_px=128, max_work_px=192)        # small: upsampled, 150 superpixels
    assert seen == [((128, 128, 3), 150)] * 2


def test_maps_are_deterministic_and_flip_equivariant() -> None:
    from preprocess.synthetic import SyntheticSplit

    img = SyntheticSplit(4, seed=3)[2].image           # clutter, distractors, texture
    a, b = hc.maps(img, hc.METHODS), hc.maps(img, hc.METHODS)
    mirrored = hc.maps(img[:, ::-1].copy(), hc.METHODS)
    for m in hc.METHODS:
        assert np.array_equal(a[m], b[m])
        np.testing.assert_allclose(mirrored[m], a[m][:, ::-1], atol=1e-6)


def test_a_uniform_image_has_no_salient_pixel() -> None:
    out = hc.maps(np.full((64, 64, 3), 120, np.uint8), hc.METHODS)
    assert all(np.array_equal(v, np.zeros((64, 64), np.float32)) for v in out.values())


def test_too_few_superpixels_and_unknown_methods_are_errors() -> None:
    img, _ = disc_image(16, 16, centre=(8, 8), radius=5)
    with pytest.raises(hc.SaliencyError, match="SLIC made .* superpixels for a target of 2000"):
        hc.build_graph(img, hc.SlicParams(segments=2000))
    with pytest.raises(hc.SaliencyError, match="unknown saliency method 'hs'; choose from rbd, mr, mc, dsr"):
        hc.maps(img, methods=("hs",))


def test_the_graph_records_neighbours_and_image_sides() -> None:
    img, _ = disc_image()
    g = hc.build_graph(img, hc.SlicParams(segments=150))
    labels = g.labels
    assert g.n == labels.max() + 1 and np.array_equal(g.adj, g.adj.T) and not g.adj.diagonal().any()
    # Two superpixels that share a horizontal pixel edge are neighbours.
    a, b = labels[:, :-1].ravel(), labels[:, 1:].ravel()
    assert all(g.adj[i, j] for i, j in zip(a, b) if i != j)
    assert np.array_equal(np.flatnonzero(g.sides["top"]), np.unique(labels[0]))
    assert np.array_equal(np.flatnonzero(g.boundary), np.unique(np.concatenate(
        [labels[0], labels[-1], labels[:, 0], labels[:, -1]])))


def absorbed_time_by_the_paper(g: hc.Graph, theta: float = 10.0, eps: float = 1e-5) -> np.ndarray:
    """Jiang et al. (ICCV 2013), transcribed node by node: an edge between superpixels that are
    neighbours, neighbours of neighbours, or both on the boundary, weighted exp(-theta * d / range) +
    eps on the colour distance d normalised over the edges, and a self-loop of 1. A superpixel whose
    weights sum to less than 1.1 is set aside (the authors' code). Over the others: transient nodes
    (every superpixel kept), absorbing nodes (a virtual copy of each kept boundary superpixel, linked
    to the transient nodes as its original); P in canonical form [[Q, R], [0, I]]; N = (I - Q)^-1; the
    absorbed time y = N c, c = 1, min-max normalised; where it is flat, the same chain's time
    re-weighted by the equilibrium distribution (the paper's refinement; the flatness test of the
    authors' code). A superpixel set aside is then 1 if a neighbour's time is above 0.3, else 0."""
    n = g.n
    lab = g.lab
    near = {i: set(np.flatnonzero(g.adj[i])) for i in range(n)}
    linked = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            two_ring = j in near[i] or any(j in near[k] for k in near[i])
            linked[i, j] = i != j and (two_ring or (g.boundary[i] and g.boundary[j]))
    dist = {(i, j): float(np.sqrt(((lab[i] - lab[j]) ** 2).sum())) for i in range(n) for j in range(n) if linked[i, j]}
    lo, hi = min(dist.values()), max(dist.values())
    full = np.zeros((n, n))
    for (i, j), d in dist.items():
        full[i, j] = np.exp(-theta * (d - lo) / (hi - lo)) + eps
    for i in range(n):
        full[i, i] = 1.0
    kept = [i for i in range(n) if full[i].sum() >= 1.1]
    if len(kept) < 2 or not any(g.boundary[i] for i in kept):
        kept = list(range(n))
    m = len(kept)
    copies = [k for k, i in enumerate(kept) if g.boundary[i]]
    size = m + len(copies)
    weight = np.zeros((size, size))
    for a, i in enumerate(kept):
        for b, j in enumerate(kept):
            weight[a, b] = full[i, j]
    for k, b in enumerate(copies):
        weight[:m, m + k] = weight[:m, b]
    p = np.zeros((size, size))
    for i in range(m):
        p[i] = weight[i] / weight[i].sum()
    for k in range(len(copies)):
        p[m + k, m + k] = 1.0                                    # absorbing
    q = p[:m, :m]
    fundamental = np.linalg.inv(np.eye(m) - q)
    y = fundamental @ np.ones(m)
    y = (y - y.min()) / (y.max() - y.min())
    # A flat map (the authors' "entropy" >= 2: the share of each tenth of [0, 1], 1.0 in the tenth,
    # times the tenth's distance from the nearer end, 1 to 5) is re-weighted by the equilibrium
    # distribution of the chain on the transient graph: y = N u, u_i = 1 / pi_i, normalised to sum 1.
    entropy = 0.0
    for tenth in range(1, 11):
        share = sum(1 for v in y if min(int(np.floor(v * 10)) + 1, 10) == tenth) / m
        entropy += share * min(tenth, 11 - tenth)
    if entropy >= 2:
        degree = [sum(weight[i, j] for j in range(m)) for i in range(m)]
        pi = [d / sum(degree) for d in degree]
        u = np.array([1 / x for x in pi])
        y = fundamental @ (u / u.sum())
        y = (y - y.min()) / (y.max() - y.min())
    out = np.zeros(n)
    for a, i in enumerate(kept):
        out[i] = y[a]
    for i in set(range(n)) - set(kept):
        out[i] = 1.0 if any(j in kept and out[j] > 0.3 for j in near[i]) else 0.0
    return out


def test_mc_is_the_absorbed_time_of_the_papers_chain() -> None:
    from preprocess.synthetic import SyntheticSplit

    flatness, set_aside = [], []
    for img in (disc_image()[0], SyntheticSplit(4, seed=3)[2].image, SyntheticSplit(8, seed=3)[5].image):
        g = hc.build_graph(img, hc.SlicParams(segments=60))
        np.testing.assert_allclose(hc.mc(g), absorbed_time_by_the_paper(g), atol=1e-9)
        flatness.append(hc.flatness(hc.mc(g, hc.McParams(flat=None))))
        set_aside.append(not np.allclose(hc.mc(g), hc.mc(g, hc.McParams(isolated=0))))
    assert min(flatness) < 2 <= max(flatness)           # both branches: the plain time and the re-weighted one
    assert set_aside == [False, True, False]            # and a graph with superpixels set aside
    assert not np.allclose(hc.mc(g), hc.mc(g, hc.McParams(flat=None)), atol=0.05)
    img, gt = disc_image()
    g = hc.build_graph(img, hc.SlicParams(segments=60))
    inside = np.bincount(g.labels.ravel(), weights=(gt > 0).ravel(), minlength=g.n) / np.bincount(g.labels.ravel())
    y = hc.mc(g)
    assert y[inside > 0.9].min() > y[inside < 0.1].max()        # the disc is absorbed last


def test_quality_scores_follow_their_definitions() -> None:
    gt = np.zeros((4, 4), np.uint8)
    gt[:2, :2] = 255                                      # 4 positives
    pred = np.zeros((4, 4), np.float32)
    pred[:2, :3] = 0.8                                    # 6 predicted: 4 true, 2 false
    precision, recall = 4 / 6, 4 / 4
    assert quality.f_beta(pred, gt) == pytest.approx(1.3 * precision * recall / (0.3 * precision + recall))
    assert quality.iou(pred, gt) == pytest.approx(4 / 6)
    assert quality.mae(pred, gt) == pytest.approx((4 * 0.2 + 2 * 0.8) / 16)
    assert quality.max_f(pred, gt) == pytest.approx(quality.f_beta(pred, gt, 0.5))
    # Nothing predicted: precision counts as 1, recall 0, F = 0.
    assert quality.f_beta(np.zeros((4, 4)), gt) == 0.0


def test_labelled_cases_are_deterministic_with_masks_that_match_the_drawn_object() -> None:
    from preprocess.saliency import cases

    for case in cases.CASES:
        img, mask = cases.make(case, 3)
        again, mask_again = cases.make(case, 3)
        assert np.array_equal(img, again) and np.array_equal(mask, mask_again)
        assert img.shape == (64, 64, 3) and set(np.unique(mask)) == {0, 255}
        inside = img[mask == 255].astype(float).mean(0)
        outside = img[mask == 0].astype(float).mean(0)
        assert np.abs(inside - outside).max() > 10             # the object differs from the background
    _, border = cases.make("border", 0)
    assert border[0].any() or border[-1].any() or border[:, 0].any() or border[:, -1].any()
    _, thin = cases.make("thin", 0)
    assert thin.mean() / 255 < 0.08                            # a bar, not a blob
