"""Handcrafted saliency maps over SLIC superpixels: Robust Background Detection (RBD; Zhu, Liang, Wei
and Sun, CVPR 2014), graph-based Manifold Ranking (MR; Yang, Zhang, Lu, Ruan and Yang, CVPR 2013), the
Absorbing Markov Chain (MC; Jiang, Zhang, Lu, Yang and Yang, ICCV 2013) and Dense and Sparse
Reconstruction (DSR, `dsr.py`): the pseudo-labels DeepUSPS refines (RELICv2 App. A.2.1 uses all four).

RBD, MR and MC work on one graph of superpixels (DSR segments the image at eight scales of its
own): SLIC with `sigma=1, compactness=20` (`superpixels.py`), the actual count checked against the
target; per superpixel its mean CIE-Lab colour, mean normalised position, its 4-connected neighbours
and the image sides it touches. Implemented from the papers' equations with the reference parameters
of the authors' demos; every map is min-max normalised to [0, 1] and filled back to pixels. Images
smaller than `work_px` are upsampled first (bicubic), larger than `max_work_px` shrunk (area), and
the map is resized back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from preprocess.saliency import dsr
from preprocess.saliency.superpixels import SIDES, SaliencyError, SlicParams, minmax, region_means, segment, touching

METHODS = ("rbd", "mr", "mc", "dsr")
# The methods `make saliency` fuses and refines unless told (docs/saliency.md): MC adds nothing to RBD and
# MR's refined stages on `synthetic` and fails on objects that touch the image's border; DSR gains about
# 0.01 IoU for five times the maps' cost (0.41 s an image at 128 px, 1.3 s at 500 x 375).
DEFAULT_METHODS = ("rbd", "mr")


@dataclass(frozen=True)
class Graph:
    """The superpixel graph of one image."""

    labels: np.ndarray      # (H, W) int, superpixel of each pixel, 0..n-1
    lab: np.ndarray         # (n, 3) mean CIE-Lab colour
    pos: np.ndarray         # (n, 2) mean (row, col) position / (H, W)
    adj: np.ndarray         # (n, n) bool, 4-connected neighbours (no self-loops)
    sides: dict             # side name -> (n,) bool, superpixels touching that image side

    @property
    def n(self) -> int:
        return len(self.lab)

    @property
    def boundary(self) -> np.ndarray:
        return np.logical_or.reduce([self.sides[s] for s in SIDES])

    def colour_distance(self) -> np.ndarray:
        """(n, n) Euclidean distance of the mean Lab colours, d_ij."""
        return np.linalg.norm(self.lab[:, None, :] - self.lab[None, :, :], axis=-1)


def _two_ring(adj: np.ndarray) -> np.ndarray:
    """Neighbours and neighbours of neighbours, without self-loops."""
    a = adj.astype(np.float32)
    ring = adj | ((a @ a) > 0)
    np.fill_diagonal(ring, False)
    return ring


def _edge_scaled(d: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """d̂: the colour distances min-max normalised over the graph's edges (MR's and MC's weights)."""
    de = d[edges]
    lo, hi = float(de.min()), float(de.max())
    return (d - lo) / (hi - lo) if hi > lo else np.zeros_like(d)


def build_graph(image: np.ndarray, slic: SlicParams = SlicParams()) -> Graph:
    """SLIC superpixels of an (H, W, 3) uint8 image and their graph.

    Raises:
        SaliencyError: SLIC returned fewer than `slic.min_fraction` of `slic.segments` superpixels.
    """
    from skimage.color import rgb2lab

    labels = segment(image, slic)
    n = int(labels.max()) + 1
    h, w = labels.shape
    rows, cols = np.mgrid[0:h, 0:w]
    lab_mean = region_means(labels, rgb2lab(image))
    pos = region_means(labels, np.stack([(rows + 0.5) / h, (cols + 0.5) / w], axis=-1))
    adj = np.zeros((n, n), dtype=bool)
    for a, b in ((labels[:-1], labels[1:]), (labels[:, :-1], labels[:, 1:])):
        diff = a != b
        adj[a[diff], b[diff]] = True
    adj |= adj.T
    np.fill_diagonal(adj, False)
    sides = touching(labels)
    return Graph(labels=labels, lab=lab_mean, pos=pos, adj=adj, sides=sides)


# ----------------------------------------------------------------------------- RBD


@dataclass(frozen=True)
class RbdParams:
    """Reference parameters of Zhu et al. (their demo): σ_bndcon, σ_spa, μ, λ_bg."""

    sigma_bndcon: float = 1.0
    sigma_spa: float = 0.4
    mu: float = 0.1
    lambda_bg: float = 5.0


def rbd(g: Graph, p: RbdParams = RbdParams()) -> np.ndarray:
    """Saliency per superpixel, in [0, 1], by robust background detection.

    1. Geodesic distances on the graph of neighbours plus the boundary clique, edge weight
       max(0, d_ij − clip); soft area S(i, j) = exp(−d_geo²/(2σ_geo²)) (0 beyond 3σ_geo).
    2. Boundary connectivity BndCon(i) = Σ_{j∈B} S(i, j) / √(Σ_j S(i, j)); background probability
       w_bg(i) = 1 − exp(−BndCon²/(2σ_bndcon²)).
    3. Background-weighted contrast wCtr(i) = Σ_j d_ij · w_spa(i, j) · w_bg(j), zeroed below Otsu's
       threshold: the foreground weight.
    4. The optimisation of Eq. 9, min Σ w_bg s² + Σ w_fg (s − 1)² + Σ w_ij (s_i − s_j)², solved in
       closed form: (L + λ_bg·diag(w_bg) + diag(w_fg)) s = w_fg, with w_ij = exp(−d_ij²/(2σ_nei²))
       (+ μ between direct neighbours) on the 2-ring and boundary-clique edges.
    """
    from skimage.filters import threshold_otsu

    n, d, adj, bnd = g.n, g.colour_distance(), g.adj, g.boundary
    if n < 2:
        return np.zeros(n)
    ring = _two_ring(adj)
    big = np.inf
    m1 = float(np.mean(np.where(adj, d, big).min(axis=1, initial=big)[adj.any(axis=1)]))
    m2 = float(np.mean(np.where(ring, d, big).min(axis=1, initial=big)[ring.any(axis=1)]))
    pair = d[np.triu(adj, 1)]
    top = float(np.mean(np.sort(pair)[-max(1, len(pair) // 100):])) if len(pair) else 0.0
    clip = m2
    sigma_geo = max(min(10.0, 3 * m1, top / 10), 5.0)
    sigma_nei = max(min(3 * m1, 0.2 * top, 20.0), 1e-6)

    clique = np.outer(bnd, bnd)
    np.fill_diagonal(clique, False)
    edges = adj | clique
    weight = np.where(edges, np.maximum(d - clip, 0.0) + 1e-10, 0.0)     # sparse graphs drop exact zeros
    # Paths longer than 3 σ_geo have S = 0, so Dijkstra stops there (inf beyond): a third faster, the same S.
    geo = dijkstra(csr_matrix(weight), directed=False, limit=3 * sigma_geo)
    soft = np.exp(-geo ** 2 / (2 * sigma_geo ** 2))
    soft[geo > 3 * sigma_geo] = 0.0
    bndcon = soft[:, bnd].sum(axis=1) / np.sqrt(soft.sum(axis=1))
    w_bg = 1.0 - np.exp(-bndcon ** 2 / (2 * p.sigma_bndcon ** 2))

    dpos2 = ((g.pos[:, None, :] - g.pos[None, :, :]) ** 2).sum(axis=-1)
    w_spa = np.exp(-dpos2 / (2 * p.sigma_spa ** 2))
    w_spa[dpos2 > (3 * p.sigma_spa) ** 2] = 0.0
    w_fg = minmax((d * w_spa * w_bg[None, :]).sum(axis=1))
    if w_fg.max() > w_fg.min():
        w_fg[w_fg < threshold_otsu(w_fg)] = 0.0

    smooth_edges = ring | clique
    w = np.where(smooth_edges, np.exp(-d ** 2 / (2 * sigma_nei ** 2)), 0.0) + np.where(adj, p.mu, 0.0)
    laplacian = np.diag(w.sum(axis=1)) - w
    bg = p.lambda_bg * w_bg
    bg[bndcon > 3] = 1000.0                       # the reference code: certain background
    s = np.linalg.solve(laplacian + np.diag(bg) + np.diag(w_fg), w_fg)
    return minmax(s)


# ----------------------------------------------------------------------------- MR


@dataclass(frozen=True)
class MrParams:
    """α of the ranking and θ of the edge weights exp(−θ·d̂) (d̂: colour distance min-max normalised
    over the graph's edges)."""

    alpha: float = 0.99
    theta: float = 10.0


def mr(g: Graph, p: MrParams = MrParams()) -> np.ndarray:
    """Saliency per superpixel, in [0, 1], by manifold ranking on a close-loop graph.

    Graph: neighbours plus the boundary clique, then each node linked to its 2-ring on that graph;
    w_ij = exp(−θ·d̂_ij). Ranking f* = (D − αW)⁻¹ y (paper Eq. 3, unnormalised Laplacian), with the
    diagonal of the inverse set to 0. Stage 1 ranks against each side's superpixels as background
    queries: S_bq = Π_side (1 − minmax(A·y_side)); stage 2 ranks against the foreground queries
    S_bq ≥ mean(S_bq): S = minmax(A·y_fg).
    """
    n, d = g.n, g.colour_distance()
    if n < 2:
        return np.zeros(n)
    clique = np.outer(g.boundary, g.boundary)
    base = g.adj | clique
    np.fill_diagonal(base, False)
    edges = _two_ring(base)
    w = np.where(edges, np.exp(-p.theta * _edge_scaled(d, edges)), 0.0)
    rank = np.linalg.inv(np.diag(w.sum(axis=1)) - p.alpha * w)
    np.fill_diagonal(rank, 0.0)
    s_bq = np.ones(n)
    for side in SIDES:
        s_bq *= 1.0 - minmax(rank @ g.sides[side].astype(np.float64))
    s_bq = minmax(s_bq)
    return minmax(rank @ (s_bq >= s_bq.mean()).astype(np.float64))


# ----------------------------------------------------------------------------- MC


@dataclass(frozen=True)
class McParams:
    """θ of the edge weights exp(−θ·d̂) + ε (d̂: colour distance min-max normalised over the graph's
    edges; the authors' demo: θ = 10, ε = 1e-5), and the flatness from which a map is re-weighted
    by the equilibrium distribution (the authors' code: 2; `None`: never); a superpixel whose links
    sum to less than `isolated` (its self-loop's 1 included) is set aside, and salient when a neighbour
    scores above `salient_near` (the authors' code: 1.1 and 0.3; `isolated=0`: none set aside)."""

    theta: float = 10.0
    eps: float = 1e-5
    flat: float | None = 2.0
    isolated: float = 1.1
    salient_near: float = 0.3


def flatness(y: np.ndarray) -> float:
    """How far a [0, 1] map's values sit from both ends, the authors' "entropy": the values binned
    in tenths (1 in the top bin), each bin's share weighted by its distance in bins from the nearer
    end (1 for the outer bins, 5 for the middle two). A map of background near 0 and a few salient
    superpixels near 1 scores about 1; one spread over the middle, up to 5."""
    share = np.bincount(np.minimum((y * 10).astype(int), 9), minlength=10) / len(y)
    return float(share @ np.minimum(np.arange(1, 11), np.arange(10, 0, -1)))


def mc(g: Graph, p: McParams = McParams()) -> np.ndarray:
    """Saliency per superpixel, in [0, 1], as the time a random walk from it takes to be absorbed by
    the image's boundary.

    Graph: every superpixel a transient node linked to its 2-ring, the boundary superpixels
    linked to each other; w_ij = exp(−θ·d̂_ij) + ε, and a self-loop of weight 1 (W + I). Absorbing
    nodes are virtual copies of the boundary superpixels, each linked to the transient nodes with the
    weights of its original. With the transitions P = D⁻¹[W | W_B] (D the degrees over both blocks),
    Q = D⁻¹W is the transient block, the fundamental matrix N = (I − Q)⁻¹, and the absorbed time
    y = N·1 min-max normalised is the map. Where that map is flat (`flatness` ≥ `p.flat`: long
    times everywhere, as where the object is large or the background cluttered), the time is
    re-weighted by the equilibrium distribution π of the chain on W (π_i = d_i / Σ d, d_i = Σ_j W_ij):
    y = N·u with u_i ∝ 1/π_i, so that well-connected, background-like nodes count less.

    As the authors' code does, a superpixel with hardly any link (Σ_j w_ij < `p.isolated`, the
    self-loop's 1 included: a colour unlike all around it) is set aside before the chain, where its
    walk would hardly move and its time dwarf every other; it is then salient (1) if a neighbour
    scores above `p.salient_near`, else 0. Nothing is set aside when that would leave fewer than two
    superpixels or none on the boundary.
    """
    n, d = g.n, g.colour_distance()
    if n < 2:
        return np.zeros(n)
    clique = np.outer(g.boundary, g.boundary)
    edges = _two_ring(g.adj) | clique
    np.fill_diagonal(edges, False)
    w = np.where(edges, np.exp(-p.theta * _edge_scaled(d, edges)) + p.eps, 0.0) + np.eye(n)
    keep = w.sum(axis=1) >= p.isolated
    if keep.sum() < 2 or not g.boundary[keep].any():
        keep[:] = True
    y = np.zeros(n)
    y[keep] = _absorbed_time(w[np.ix_(keep, keep)], g.boundary[keep], p.flat)
    near_salient = (g.adj[~keep][:, keep] & (y[keep] > p.salient_near)).any(axis=1)
    y[~keep] = near_salient.astype(float)
    return y


def _absorbed_time(w: np.ndarray, boundary: np.ndarray, flat: float | None) -> np.ndarray:
    """`mc`'s min-max normalised absorbed time on the transient graph `w` (self-loops included), the
    `boundary` nodes copied as absorbing ones; re-weighted by the equilibrium distribution where flat."""
    within = w.sum(axis=1)                                           # d_i, the degree on W
    degree = within + w[:, boundary].sum(axis=1)                     # to transient and absorbing nodes
    fundamental_inv = np.eye(len(w)) - w / degree[:, None]          # I − Q
    y = minmax(np.linalg.solve(fundamental_inv, np.ones(len(w))))
    if flat is not None and flatness(y) >= flat:
        pi = within / within.sum()
        y = minmax(np.linalg.solve(fundamental_inv, (1 / pi) / (1 / pi).sum()))
    return y


# ----------------------------------------------------------------------------- images


def working_size(px: int, work_px: int, max_work_px: int) -> int:
    """The side the maps are computed at: the image's own, raised to `work_px` (small images are
    upsampled) and capped at `max_work_px` (SLIC's cost grows with the pixels: at ImageNet's 500 x 375
    RBD and MR took 0.67 s an image at its own size, 0.24 s at 256 px, one core)."""
    return min(max(px, work_px), max(max_work_px, work_px))


def segments_for(px: int, side: int) -> int:
    """Target superpixels of an image of side `px` worked at side `side`: px²/600, the reference RBD
    count for the image at its own size, at least 150 and at most 500, and superpixels of at least
    100 working pixels. The count follows the image, not the working side: on synthetic 512-px
    images worked at 256 px with 437 superpixels the fusion's IoU was 0.007 (± 0.006) under the
    image's own size, with 300 superpixels at 224 px 0.047 under it (150 images). On synthetic 64-px
    images upsampled to 128 px, 150 superpixels scored IoU 0.56 for the fusion against 0.47 with 80
    at 64 px (40 images)."""
    return min(max(150, round(px * px / 600)), MAX_SEGMENTS, side * side // 100)


WORK_PX = 128
MAX_WORK_PX = 256
MAX_SEGMENTS = 500
FUSION = "fusion"


def resize_square(image: np.ndarray, side: int) -> np.ndarray:
    """An (H, W, 3) uint8 image as (side, side, 3): area resampling down, bicubic up (not
    aspect-preserving)."""
    import cv2

    if image.shape[:2] == (side, side):
        return image
    shrink = side < max(image.shape[:2])
    return cv2.resize(image, (side, side), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)


def resize_map(p: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A float map resized bilinearly to (H, W) = `shape` (returned as is when it already has it)."""
    import cv2

    return p if p.shape == tuple(shape) else cv2.resize(p, (shape[1], shape[0]), interpolation=cv2.INTER_LINEAR)


def maps(image: np.ndarray, methods: tuple[str, ...] = DEFAULT_METHODS, work_px: int = WORK_PX,
         size: tuple[int, int] | None = None, max_work_px: int = MAX_WORK_PX) -> dict[str, np.ndarray]:
    """Each method's saliency map of an (H, W, 3) uint8 image: float32 in [0, 1], of the image's
    (H, W) or of `size`.

    The image is resized to a square of side `working_size(max(H, W), work_px, max_work_px)` (bicubic
    up, area down) and segmented into the superpixel count of its own size (`segments_for`); the
    maps are computed there, once on the image and once on its mirror image (flipped back), averaged,
    and resized back (bilinear, OpenCV). SLIC's seed grid is not mirror-symmetric, so a single pass differs from
    its mirror by ~0.03-0.05 MAE on synthetic images; the average is exactly flip-equivariant.

    Raises:
        SaliencyError: an unknown method, or SLIC failed to make enough superpixels.
    """
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SaliencyError(f"unknown saliency method {bad[0]!r}; choose from {', '.join(METHODS)}")
    h, w = image.shape[:2]
    side = working_size(max(h, w), work_px, max_work_px)
    slic = SlicParams(segments=segments_for(max(h, w, work_px), side))
    work = resize_square(image, side)
    views = [_per_pixel(work, methods, slic),
             {m: v[:, ::-1] for m, v in _per_pixel(work[:, ::-1], methods, slic).items()}]
    out = {}
    size = size or (h, w)
    for m in methods:
        full = resize_map(((views[0][m] + views[1][m]) / 2).astype(np.float32), size)
        out[m] = np.clip(full, 0.0, 1.0)
    return out


def _per_pixel(work: np.ndarray, methods: tuple[str, ...], slic: SlicParams) -> dict[str, np.ndarray]:
    """One pass: every graph method on one superpixel graph, filled back to the working image's pixels,
    and DSR on its own segmentations."""
    work = np.ascontiguousarray(work)
    g = build_graph(work, slic)
    if float(np.ptp(g.lab, axis=0).max()) < 1e-3:      # one colour everywhere: nothing stands out
        return {m: np.zeros(work.shape[:2]) for m in methods}
    return {m: _METHOD_MAPS[m](work, g) for m in methods}


_METHOD_MAPS = {                    # a method's per-pixel map of one pass, from the working image and its graph
    "rbd": lambda work, g: rbd(g)[g.labels],
    "mr": lambda work, g: mr(g)[g.labels],
    "mc": lambda work, g: mc(g)[g.labels],
    "dsr": lambda work, g: dsr.dsr(work),        # its own eight segmentations
}


def fuse(per_method: dict[str, np.ndarray]) -> np.ndarray:
    """The handcrafted fusion: the mean of the methods' maps."""
    return np.mean(np.stack(list(per_method.values())), axis=0).astype(np.float32)


def maps_and_fusion(image: np.ndarray, methods: tuple[str, ...] = DEFAULT_METHODS, work_px: int = WORK_PX,
                    size: tuple[int, int] | None = None, max_work_px: int = MAX_WORK_PX) -> dict[str, np.ndarray]:
    """`maps` plus their fusion under the `FUSION` key: every handcrafted stage of one image."""
    per = maps(image, methods, work_px=work_px, size=size, max_work_px=max_work_px)
    per[FUSION] = fuse(per)
    return per
