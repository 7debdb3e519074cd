"""DALI view graph: the fused colour pass, the views on the device, channels-last outputs, and the mixes
against the laws and the torch reference (the view laws on every engine are test_view_laws.py's; the
Batch contract, sharding, seeds and resume test_contract.py's)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from pipelines import dali_backend, mixing  # noqa: E402
from pipelines.mixing import MixSpec, with_mix_source  # noqa: E402
from pipelines.spec import DatasetInfo, LoaderSpec  # noqa: E402
from pipelines.views import Recipe, ViewGroup  # noqa: E402
from preprocess.records import Record  # noqa: E402
from preprocess.write_dali import write_dali  # noqa: E402
from tests.devices import DEVICES, OnHost, on_host  # noqa: E402
from tests.pipelines import mix_laws  # noqa: E402

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
N = 48


def _colour(i: int) -> list[int]:
    """Record i's colour: never gray, unique, spread over the levels (mixes of two records tell
    DACL's linear and geometric laws apart)."""
    return [200, 20 + 4 * i, 90]


@dataclass
class _Split:
    """Constant-colour 32-px images whose left part (width 8..23 px) is foreground."""

    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = True

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Record:
        colour = np.array(_colour(i), dtype=np.uint8)
        img = np.broadcast_to(colour, (32, 32, 3)).copy()
        mask = np.zeros((32, 32), np.uint8)
        mask[:, : 8 + i % 16] = 255
        return Record(img, i % 4, i, mask)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The dataset facts of shards written without a manifest (the loader is built directly)."""
    root = tmp_path_factory.mktemp("dali")
    write_dali(_Split(), root / "train", shard_size=10)
    return DatasetInfo(dir=root, split="train", count=N, mean=MEAN, std=STD, has_masks=True)


def on_devices(cases: list, on_gpu: list) -> list:
    """A test's parameters, the device first: every case on the CPU, and on a GPU (`gpu`-marked) only
    `on_gpu`, so that the GPU check's short time runs the cases that differ there."""
    return [("cpu", *c) for c in cases] + [pytest.param("cuda", *c, marks=pytest.mark.gpu) for c in on_gpu]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Where the graph runs: every test below runs on the CPU graph and, on a GPU machine, the GPU graph."""
    return request.param


def _debug_loader(spec: LoaderSpec, info: DatasetInfo) -> OnHost:
    """A debug `DaliLoader` (its draws in `last_draws` and `last_debug`), batches checked and on the host; with
    `gpu_tail="torch"` on the CPU, the GPU graph's branches (where the torch tail runs)."""
    loader = dali_backend.DaliLoader(replace(spec, recipe=with_mix_source(spec.recipe, spec.mix)), info, debug=True,
                                     gpu_branches=spec.gpu_tail == "torch")
    return OnHost(loader, spec.device.split(":")[0])


def _drawn(loader) -> dict[str, np.ndarray]:
    """The last batch's draws under the names the tests read: per view its window (y0, x0, h, w, H, W),
    flip, gray, blur, solarize and jitter factors (b, c, s, hue); the mixes' drawn lam and box; and
    the graph's own draws (Binary Mixup masks)."""
    d, out = loader.last_draws, dict(loader.last_debug)
    b = d.hw.shape[0]
    for name, p in d.params.items():
        for v in range(p.flip.shape[0] // b):
            rows, tag = slice(v * b, (v + 1) * b), f"{name}/{v}"
            if name in d.boxes:
                out[f"{tag}/window"] = torch.cat([d.boxes[name][rows], d.hw], 1).numpy()
            for key in ("flip", "gray", "blur", "solarize"):
                out[f"{tag}/{key}"] = getattr(p, key)[rows].numpy()
            out[f"{tag}/jitter_factors"] = p.factors[rows].numpy()
    if d.mix is not None:
        out["mix/lam_drawn"] = d.mix.lam[0].numpy()
        if d.mix.boxes is not None:
            out[f"mix/{d.mix.mixer}_box"] = d.mix.boxes[0].numpy()
    return out


def _loader(shards, recipe, device: str = "cpu", **kw) -> OnHost:
    spec = LoaderSpec(root="", dataset="", split="train", recipe=recipe, batch_size=8, device=device, **kw)
    return _debug_loader(spec, shards)


RELIC = Recipe("relic", (
    ViewGroup("large", 2, 16, area=(0.14, 1.0), jitter_p=0.8, brightness=0.4, contrast=0.4, saturation=0.2,
              hue=0.1, gray_p=0.2, blur_p=0.5, solarize_p=0.2, saliency_p=0.1),
    ViewGroup("small", 2, 8, area=(0.05, 0.14), jitter_p=0.8, brightness=0.4)))
RSA = Recipe("rsa", (
    ViewGroup("weak", 2, 16, area=(0.2, 1.0)),
    ViewGroup("aggressive", 2, 16, parent="weak", jitter_p=0.8, brightness=0.4, contrast=0.4, saturation=0.4,
              hue=0.1, gray_p=0.2, blur_p=0.5)))


# ---- intra-batch mixes ------------------------------------------------------------------------

MIX_RECIPE = Recipe("mix", (ViewGroup("g", 2, 16, area=(0.3, 1.0)),))


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """Normalised views back to float pixels in [0, 255] (exact: std 0.25, mean 0.5)."""
    return (x * 0.25 + 0.5) * 255


def _first_batch(shards, mix, device):
    loader = _loader(shards, MIX_RECIPE, device, seed=11, mix=mix)
    b = next(iter(loader))
    return b, _drawn(loader)


@pytest.fixture(scope="module", params=DEVICES)
def mixed_batches(shards, request):
    out = {}
    for m in ("mixup", "cutmix", "resizemix"):
        out[m] = _first_batch(shards, MixSpec("sdmp", alpha=1.0, sdmp_mixers=(m,)), request.param)
    for m in ("linear", "geometric", "binary", "gaussian"):
        out[m] = _first_batch(shards, MixSpec("dacl", alpha=0.5, dacl_noises=(m,), gauss_scale=GAUSS), request.param)
    return out


GAUSS = 0.2                      # the Gaussian-noise baseline's alpha in the tests: noise well above rounding


def _expected(kind, x, xp, lam, box, mask, normal=None):
    """Numpy statement of the mixes (DESIGN.md §4) on float pixels (B, 3, S, S)."""
    lam4 = lam.view(-1, 1, 1, 1)
    if kind == "gaussian":                                               # DACL Sec. 4: x + alpha delta
        return (x + GAUSS * 255 * normal).clamp(0, 255)
    if kind in ("mixup", "linear"):
        return lam4 * x + (1 - lam4) * xp
    if kind == "geometric":
        return (x / 255) ** lam4 * (xp / 255) ** (1 - lam4) * 255
    if kind == "binary":
        return mask * x + (1 - mask) * xp
    y = x.clone()
    for i, (y0, x0, y1, x1) in enumerate(box.astype(int)):
        y[i, :, y0:y1, x0:x1] = xp[i, :, y0:y1, x0:x1]
    return y


@pytest.mark.parametrize("kind", ["mixup", "cutmix", "linear", "geometric", "binary", "gaussian"])
def test_mix_formula(mixed_batches, kind: str) -> None:
    b, dbg = mixed_batches[kind]
    for v in range(2):
        x = _pixels(b.global_views[v])
        xp = x[b.mix_partner[v]]
        box = dbg.get("mix/cutmix_box")
        mask = dbg.get(f"mix/{v}/binary_mask")
        mask = torch.from_numpy(mask).permute(0, 3, 1, 2) if mask is not None else None
        normal = dbg.get(f"mix/{v}/gauss_normal")
        normal = torch.from_numpy(normal).permute(0, 3, 1, 2) if normal is not None else None
        want = _expected(kind, x, xp, b.mix_lam[v], box, mask, normal)
        got = _pixels(b.mixed[v])
        assert (got - want).abs().max() <= 0.5 + 1e-3                    # uint8 rounding only
        if kind == "cutmix":                                             # lam = pixel fraction kept
            area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
            assert np.allclose(b.mix_lam[v].numpy(), 1 - area / 256, atol=1e-6)
    if kind == "gaussian":                                               # no partner: lam 1; delta ~ N(0, 1)
        assert torch.equal(b.mix_lam, torch.ones(2, 8))
        deltas = np.stack([dbg[f"mix/{v}/gauss_normal"] for v in range(2)])
        assert abs(deltas.mean()) < 0.05 and abs(deltas.std() - 1) < 0.05
        assert abs(np.corrcoef(deltas[0].ravel(), deltas[1].ravel())[0, 1]) < 0.05   # a delta per positive
    elif kind in ("linear", "geometric", "binary"):                      # DACL partner != itself
        assert not torch.any(b.mix_partner == torch.arange(8))
        assert float(b.mix_lam.min()) >= 0.5
    else:                                                                # SDMP flip partner, same lam
        assert torch.equal(b.mix_partner[0], torch.arange(7, -1, -1))
        if kind == "mixup":
            assert torch.equal(b.mix_lam[0], b.mix_lam[1])


def test_resizemix_pastes_partner_in_box(mixed_batches) -> None:
    b, dbg = mixed_batches["resizemix"]
    for v in range(2):
        x, got = _pixels(b.global_views[v]), _pixels(b.mixed[v])
        box = dbg["mix/resizemix_box"].astype(int)
        side = box[:, 2] - box[:, 0]
        assert np.allclose(b.mix_lam[v].numpy(), 1 - side ** 2 / 256, atol=1e-6)
        for i, (y0, x0, y1, x1) in enumerate(box):
            out = torch.ones(16, 16, dtype=torch.bool)
            out[y0:y1, x0:x1] = False
            assert (got[i][:, out] - x[i][:, out]).abs().max() <= 0.5 + 1e-3
            if side[i] > 0:                                              # constant-colour images
                partner = x[7 - i].mean((1, 2))
                assert (got[i][:, y0:y1, x0:x1].mean((1, 2)) - partner).abs().max() < 1.0


@pytest.mark.parametrize("kind", ["mixup", "cutmix", "resizemix", "linear", "geometric", "binary", "gaussian"])
def test_dali_mix_equals_torch_reference(mixed_batches, kind: str) -> None:

    b, dbg = mixed_batches[kind]
    for v in range(2):
        x = _pixels(b.global_views[v]) / 255                             # (B, 3, S, S) in [0, 1]
        p, lam = b.mix_partner[v], b.mix_lam[v]
        if kind == "mixup":
            want = mixing.mixup(x, lam, p)
        elif kind in ("cutmix", "resizemix"):
            boxes = torch.from_numpy(dbg[f"mix/{kind}_box"].astype(np.int64))
            want, want_lam = getattr(mixing, kind)(x, boxes, p)
            assert torch.allclose(want_lam.float(), lam, atol=1e-6)
        elif kind == "binary":
            mask = torch.from_numpy(dbg[f"mix/{v}/binary_mask"]).permute(0, 3, 1, 2)
            want = mixing.dacl_binary(x, p, mask)
        elif kind == "gaussian":
            normal = torch.from_numpy(dbg[f"mix/{v}/gauss_normal"]).permute(0, 3, 1, 2)
            want = mixing.dacl_gaussian(x, normal, GAUSS)
        else:
            want = getattr(mixing, f"dacl_{kind}")(x, p, lam)
        got = _pixels(b.mixed[v]) / 255
        tol = 0.5 / 255 + 1e-4 if kind != "resizemix" else 1 / 255      # uint8 rounding of the resized patch
        assert (got - want).abs().max() <= tol


def gpu_multi_paste(inputs: list[np.ndarray], in_anchors: np.ndarray, out_anchors: np.ndarray, shapes: np.ndarray,
                    size: int) -> np.ndarray:
    """One sample of DALI 2.4.0's GPU `multi_paste` as it ran on an H100 (the upstream bugs that
    `dali_graph` works around): every input is read with the shape of input 0 (its row pitch; past the
    end of a buffer: -1, never a pixel), and a region of zero area whose anchor lies inside the canvas
    pastes from there to the bottom-right corner. Where neither happens it is the CPU operator.

    Args:
        inputs: the regions' (H, W, 3) uint8 inputs. in_anchors, out_anchors, shapes: (regions, 2).

    Returns:
        (size, size, 3) int16 canvas.
    """
    out = np.zeros((size, size, 3), np.int16)
    h0, w0, c = inputs[0].shape
    for x, (iy, ix), (oy, ox), (h, w) in zip(inputs, in_anchors, out_anchors, shapes):
        flat = np.full(h0 * w0 * c, -1, np.int16)
        n = min(x.size, flat.size)
        flat[:n] = x.ravel()[:n]
        x = flat.reshape(h0, w0, c)
        if h * w == 0:
            if oy >= size or ox >= size:
                continue
            h, w = size - oy, size - ox                                  # opened, never closed
        out[oy:oy + h, ox:ox + w] = x[iy:iy + h, ix:ix + w]
    return out


@pytest.mark.parametrize("mixer", ["cutmix", "resizemix"])
def test_gpu_paste_rules_replayed_on_the_graphs_inputs_give_its_mixes(shards, device, mixer: str) -> None:
    """The inputs the graph gives `multi_paste` are ones DALI's GPU kernel pastes right: replayed with
    its rules (`gpu_multi_paste`), they give the graph's own mixes. That needs every input of the
    canvas's shape (ResizeMix's patch padded to it); the zero-area case is the next test's."""
    loader = _loader(shards, MIX_RECIPE, device, seed=4, mix=MixSpec("sdmp", alpha=0.1, sdmp_mixers=(mixer,)))
    for b in loader:
        inputs = loader.last_draws.inputs
        anchors, shapes = inputs[f"mix/{mixer}_anchor"], inputs[f"mix/{mixer}_shape"]
        for v in range(2):
            canvas, patch = loader.last_debug[f"mix/{v}/paste_in0"], loader.last_debug[f"mix/{v}/paste_in1"]
            got = _pixels(b.mixed[v]).round().permute(0, 2, 3, 1).numpy()                # (B, S, S, 3)
            for i in range(8):
                assert patch[i].shape == canvas[i].shape == (16, 16, 3)
                in_anchors = anchors[i] if mixer == "cutmix" else np.zeros_like(anchors[i])
                want = gpu_multi_paste([canvas[i], patch[i]], in_anchors, anchors[i], shapes[i], 16)
                assert np.array_equal(got[i], want), (mixer, v, i, anchors[i], shapes[i])


@pytest.mark.parametrize("mixer", ["cutmix", "resizemix"])
def test_a_box_of_side_zero_is_given_to_the_gpu_paste_where_it_pastes_nothing(mixer: str) -> None:
    """A box of side 0 (floor(sqrt(1 - lam) * side) with lam up to 0.9 at a view of 3 px or less) is an
    input DALI 2.4.0's GPU `multi_paste` opens and never closes; the graph's inputs for it
    (`dali_graph._mix_inputs`) paste nothing under the GPU rules, as the torch law does, while the
    other samples' boxes paste their region."""
    from pipelines.dali_graph import _mix_inputs

    size = 16
    boxes = torch.tensor([[5, 5, 5, 9], [2, 3, 10, 12], [0, 7, 4, 7], [4, 4, 12, 12]])          # (B, 4)
    d = mixing.MixDraw(partner=mixing.partner_index(4).expand(1, 4), lam=torch.full((1, 4), 0.5),
                       mixer=mixer, boxes=boxes.expand(1, 4, 4))
    inputs = _mix_inputs(MixSpec("sdmp", sdmp_mixers=(mixer,)), d, mixing.mix_lam(d, size, size), size)
    anchors, shapes = inputs[f"mix/{mixer}_anchor"], inputs[f"mix/{mixer}_shape"]
    rng = np.random.default_rng(0)
    for i, (y0, x0, y1, x1) in enumerate(boxes.tolist()):
        canvas, patch = (rng.integers(0, 256, (size, size, 3)).astype(np.int16) for _ in range(2))
        got = gpu_multi_paste([canvas, patch], anchors[i], anchors[i], shapes[i], size)
        want = canvas.copy()
        want[y0:y1, x0:x1] = patch[y0:y1, x0:x1]
        assert np.array_equal(got, want), (i, anchors[i], shapes[i])


@pytest.mark.parametrize("target", ["cpu", "cpu+gpu-branches", pytest.param("cuda", marks=pytest.mark.gpu),
                                    pytest.param("cuda+conditional-blur", marks=pytest.mark.gpu)])
def test_a_batch_where_no_sample_takes_a_branch_gives_the_views_without_it(shards, target: str) -> None:
    """Blur, solarize and the saliency composite drawn so rarely (p = 1e-6) that no sample of any
    view takes them: the views are those of the recipe without them, bit for bit (on the GPU, DALI 2.4
    left an operator in a branch that no sample takes without shape or layout; `gpu_blur="conditional"`
    puts the blur in such a branch)."""
    on = ViewGroup("v", 2, 16, area=(0.3, 1.0), jitter_p=0.8, brightness=0.4, contrast=0.4, blur_p=1e-6,
                   solarize_p=1e-6, saliency_p=1e-6)
    off = replace(on, blur_p=0.0, solarize_p=0.0, saliency_p=0.0)
    device, _, branches = target.partition("+")
    views = []
    for g in (on, off):
        spec = LoaderSpec(root="", dataset="", split="train", recipe=Recipe("rare", (g,)), batch_size=8, device=device,
                          seed=2, gpu_blur="conditional" if branches == "conditional-blur" else "gaussian")
        views.append([b.global_views for b in on_host(dali_backend.DaliLoader(
            spec, shards, gpu_branches=branches == "gpu-branches"), device)])
    assert len(views[0]) == N // 8
    assert all(torch.equal(a, b) for a, b in zip(*views))


# ---- through the real preprocessing and manifest ----------------------------------------------


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    from preprocess.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    prepare_dataset("synthetic", root, train_size=32, val_size=16, image_px=32, gt_masks_as_mask=True,
                    workers=1, shard_size=10)
    return root


def test_read_records_round_trip_through_manifest(synthetic_root) -> None:
    from tests.readers import read_dali_records

    dataset = synthetic_root / "synthetic"
    got = {}
    for rank in range(2):
        for imgs, labels, idx in read_dali_records(dataset, "train", rank=rank, world_size=2, batch_size=8):
            got.update({int(i): (im, int(lab)) for im, lab, i in zip(imgs, labels, idx)})
    assert sorted(got) == list(range(32))
    assert all(im.shape == (32, 32, 3) and im.dtype == np.uint8 for im, _ in got.values())


def test_the_source_sent_to_a_worker_does_not_grow_with_the_split(synthetic_root) -> None:
    """What a fork server's worker is sent (the pickled `BatchSource`): the reader's table path, the
    spec and the start, not the split's records, labels or mask flags (over 80 MB at ImageNet's 1.28 M
    records before the table); the source it unpickles makes the same batch."""
    import pickle

    from pipelines.shards import ShardReader
    from pipelines.views import load_recipe

    sent, sources = {}, {}
    for split, n in (("train", 32), ("val", 16)):
        info = DatasetInfo.read(synthetic_root, "synthetic", split)
        spec = LoaderSpec(root=str(synthetic_root), dataset="synthetic", split=split, batch_size=8,
                          recipe=load_recipe("relicv2", 32, 16))
        reader = ShardReader.open(info.dir / split, n)
        sources[split] = dali_backend.BatchSource(spec, reader, info.reads_masks(spec.recipe), gpu=False, start=(0, 0))
        sources[split].usable                                          # made on the loader's side too
        sent[split] = pickle.dumps(sources[split])
    assert len(sent["train"]) - len(sent["val"]) == 2 * (len("train") - len("val"))   # paths in spec and reader
    received = pickle.loads(sent["train"])
    for a, b in zip(received(_batch_info(1)), sources["train"](_batch_info(1))):
        assert np.array_equal(a, b)


def _batch_info(iteration: int):
    """The `BatchInfo` DALI passes a batch-mode parallel source (only its iteration is read)."""
    from types import SimpleNamespace

    return SimpleNamespace(iteration=iteration, epoch_idx=0)


def test_fused_jitter_matches_torchvision_sequence(shards, device) -> None:
    # Constant-colour images, so every crop is the colour itself: the fused pass must give
    # torchvision's brightness -> contrast -> saturation sequence (float, clamped per op) wherever no
    # intermediate value clips, and grayscale must give R = G = B.
    from torchvision.transforms import functional as tvf

    recipe = Recipe("jit", (ViewGroup("v", 2, 8, area=(0.3, 1.0), jitter_p=1.0, brightness=0.4, contrast=0.4,
                                      saturation=0.4, gray_p=0.3),))
    loader = _loader(shards, recipe, device, seed=5, shuffle=False)
    checked = grays = 0
    for b in loader:
        px = _pixels(b.global_views).round()                            # (2, B, 3, 8, 8)
        for v in range(2):
            fac = _drawn(loader)[f"v/{v}/jitter_factors"]          # (B, 4) b, c, s, theta
            gray = _drawn(loader)[f"v/{v}/gray"]
            for k, i in enumerate(b.index.tolist()):
                got = px[v, k].reshape(3, -1)
                assert torch.equal(got, got[:, :1].expand_as(got))      # still one colour
                if gray[k]:
                    assert got[0, 0] == got[1, 0] == got[2, 0]
                    grays += 1
                    continue
                x = torch.tensor(_colour(i), dtype=torch.float32).view(3, 1, 1) / 255
                seqs = []
                for order in ((0, 1, 2), (2, 1, 0)):
                    y = x
                    for op in order:
                        f = float(fac[k, op])
                        y = (tvf.adjust_brightness, tvf.adjust_contrast, tvf.adjust_saturation)[op](y, f)
                    seqs.append(y.view(3) * 255)
                if (seqs[0] - seqs[1]).abs().max() < 0.01:               # order (clipping) does not matter
                    assert (got[:, 0] - seqs[0]).abs().max() <= 1.0
                    checked += 1
    assert checked > 20 and grays > 5


@pytest.mark.parametrize(("device", "mixer", "tail"), on_devices(
    [(m, t) for m in ("mixup", "cutmix", "resizemix") for t in ("graph", "torch")],
    [(m, "graph") for m in ("mixup", "cutmix", "resizemix")] + [("resizemix", "torch")]))
def test_sdmp_laws_of_the_graph(shards, device, mixer: str, tail: str) -> None:
    """The laws of pipelines/mixing.py, read back from the graph's mixes of constant-colour views
    (the same checks as for the torch reference in test_mixing.py), made by the graph or by the torch
    tail (`gpu_tail="torch"`)."""
    recipe = Recipe("mix", (ViewGroup("g", 2, 16, area=(0.3, 1.0)),))
    loader = _loader(shards, recipe, device, seed=13, mix=MixSpec("sdmp", alpha=1.0, sdmp_mixers=(mixer,)),
                     gpu_tail=tail)
    clipped = 0
    for _ in range(2):
        for b in loader:
            boxes = mix_laws.pasted_boxes(_pixels(b.mixed), _pixels(b.global_views), tol=0.6)
            lam_drawn = torch.from_numpy(_drawn(loader)["mix/lam_drawn"]).view(-1)
            clipped += mix_laws.check_sdmp_laws(mixer, lam_drawn, b.mix_lam, boxes, b.mix_partner, 16)
    assert mixer != "cutmix" or clipped > 0


@pytest.mark.parametrize("tail", ["graph", "torch"])
def test_dacl_laws_of_the_graph(shards, device, tail: str) -> None:
    """DACL+'s laws (each sample's noise read back from its pixels: linear, geometric, binary), the
    per-pixel masks drawn by the graph itself or, with the torch tail, on the device from the batch's
    seeds."""
    recipe = Recipe("mix", (ViewGroup("g", 2, 16, area=(0.3, 1.0)),))
    loader = _loader(shards, recipe, device, seed=14, mix=MixSpec("dacl", alpha=0.5, dacl_noises=mixing.DACL_NOISES),
                     gpu_tail=tail)
    batches, drawn = [], []
    for _ in range(2):
        for b in loader:
            batches.append(b)
            drawn.append(loader.last_draws.mix.noise)
    kinds = torch.cat([mix_laws.noise_kinds(_pixels(b.mixed), _pixels(b.global_views), b.mix_partner, b.mix_lam, tol=0.6)
                       for b in batches], 1)
    mix_laws.check_dacl_laws(torch.cat([b.mix_partner for b in batches], 1), torch.cat([b.mix_lam for b in batches], 1),
                             kinds, 0.5, own=torch.arange(8).repeat(len(batches)), noises={0, 1, 2},
                             drawn=torch.cat(drawn).cpu())


def test_the_consumers_thread_never_reads_or_draws(shards, monkeypatch, tmp_path) -> None:
    """The training loop's thread only takes batches: the records are read and every parameter drawn in
    DALI's worker processes, each batch run through the pipeline and copied into the batch by the taker
    thread, and the batch's index, label, lam and partner come out of the pipeline
    with its views (equal to the draws made again here, on demand)."""
    calls = tmp_path / "calls"
    runs = []
    real_run = dali_backend.DaliLoader._run
    monkeypatch.setattr(dali_backend.DaliLoader, "_run",
                        lambda self, stream: runs.append(threading.get_ident()) or real_run(self, stream))

    def noted(real):
        def call(*args, **kwargs):
            with open(calls, "a") as f:
                f.write(f"{os.getpid()}\n")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(dali_backend, "draw_inputs", noted(dali_backend.draw_inputs))
    monkeypatch.setattr(dali_backend.ShardReader, "_read", noted(dali_backend.ShardReader._read))
    mix = MixSpec("sdmp", sdmp_mixers=("cutmix",))
    spec = LoaderSpec(root="", dataset="", split="train", recipe=with_mix_source(RELIC, mix), batch_size=8, mix=mix,
                      seed=3)
    loader = dali_backend.DaliLoader(spec, shards)
    batches = list(loader)
    last = batches[-1]
    callers = set(calls.read_text().split())
    assert callers and str(os.getpid()) not in callers               # read and drawn, never here
    loader._ahead.batch.result()                                        # the next epoch's first, made ahead
    assert len(runs) == len(batches) + 1
    assert threading.get_ident() not in runs
    d = loader.last_draws
    assert torch.equal(last.mix_lam, d.mix_lam) and torch.equal(last.mix_partner, d.mix.partner)
    assert torch.equal(last.label, last.index % 4)                   # _Split's labels


def test_graph_views_stay_on_the_device(shards, device, monkeypatch) -> None:
    """The graph's views reach the Batch without a detour: every output of the graph is a tensor list
    of the graph's device (GPU ones fed device to device into CUDA tensors; labels, lam and partners
    never enter the graph), nothing goes through the host copy of the debug outputs, and a
    channels-last spec gets channels-last views without a copy. The CPU case keeps this test's hook on
    `_feed` in step with its arguments, which only a GPU could show otherwise."""
    from nvidia.dali.backend import TensorListCPU, TensorListGPU

    kind = TensorListGPU if device == "cuda" else TensorListCPU
    fed, host = [], []
    real_feed, real_host = dali_backend._feed, dali_backend._host

    def feed(tls, dev, buffers, channels_last, stats=None):
        fed.extend(isinstance(tl, kind) for tl in tls)
        return real_feed(tls, dev, buffers, channels_last, stats)

    monkeypatch.setattr(dali_backend, "_feed", feed)
    monkeypatch.setattr(dali_backend, "_host", lambda tl: host.append(tl) or real_host(tl))
    spec = LoaderSpec(root="", dataset="", split="train", recipe=RELIC, batch_size=8, device=device,
                      mix=MixSpec("sdmp"), channels_last=True)
    loader = dali_backend.DaliLoader(replace(spec, recipe=with_mix_source(RELIC, spec.mix)), shards)
    batches = list(loader)
    on = torch.device(device).type
    assert len(batches) == N // 8 and all(t.device.type == on for b in batches for t in
                                          (b.global_views, b.local_views, b.mixed, b.mix_lam, b.index))
    assert all(b.global_views[0].is_contiguous(memory_format=torch.channels_last) for b in batches)
    # 2 + 2 views and 2 mixes a batch; the taker thread may have made the next epoch's first batch too
    assert len(fed) >= 6 * len(batches) and all(fed) and not host


def test_plain_dacl_is_linear_mixup_alone(shards, device) -> None:
    """The default DACL noises (Algorithm 1): the graph's positives are linear mixes only."""
    b, _ = _first_batch(shards, MixSpec("dacl", alpha=0.5), device)
    for v in range(2):
        x = _pixels(b.global_views[v])
        want = _expected("linear", x, x[b.mix_partner[v]], b.mix_lam[v], None, None)
        assert (_pixels(b.mixed[v]) - want).abs().max() <= 0.5 + 1e-3


def test_channels_last_views_are_the_same_views_laid_out_for_the_network(shards, device) -> None:
    """With `channels_last` the graph writes HWC and the Batch holds a view of that memory: each view is
    a channels-last (B, 3, S, S) tensor with the values of the CHW run, without a copy."""
    kw = dict(recipe=RSA, batch_size=8, device=device, seed=6)
    chw = list(on_host(dali_backend.DaliLoader(LoaderSpec(root="", dataset="", split="train", **kw), shards), device))
    hwc_loader = dali_backend.DaliLoader(LoaderSpec(root="", dataset="", split="train", channels_last=True, **kw), shards)
    for a, b in zip(chw, hwc_loader):
        assert b.global_views.permute(0, 1, 3, 4, 2).is_contiguous()                # (V, B, S, S, 3) memory
        assert all(b.global_views[v].is_contiguous(memory_format=torch.channels_last) for v in range(2))
        assert torch.equal(a.global_views, b.global_views.cpu()) and torch.equal(a.weak_views, b.weak_views.cpu())


@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_views_normalised_on_the_device_are_the_graph_s_normalised_views(shards, device, channels_last) -> None:
    """`graph_dtype="uint8"`: the graph hands its views (and mixes) out as uint8 and the loader normalises
    them with `batch.normalize` on the training device: the float32 run's values (up to float rounding
    of the same formula), in the layout the network takes, every field, batch after batch."""
    mix = MixSpec("sdmp", alpha=1.0)
    kw = dict(recipe=Recipe("both", RSA.groups + RELIC.groups[1:]), batch_size=8, device=device, seed=6,
              mix=mix, channels_last=channels_last)
    ref = list(on_host(dali_backend.DaliLoader(LoaderSpec(root="", dataset="", split="train", **kw), shards), device))
    raw = dali_backend.DaliLoader(LoaderSpec(root="", dataset="", split="train", graph_dtype="uint8", **kw), shards)
    n = 0
    for a, b in zip(ref, raw, strict=True):
        for f in ("global_views", "weak_views", "local_views", "mixed"):
            x, y = getattr(a, f), getattr(b, f)
            assert y.dtype == torch.float32 and y.device.type == torch.device(device).type
            assert torch.allclose(x, y.cpu(), atol=1e-5, rtol=0), f
            if channels_last:
                assert all(y[v].is_contiguous(memory_format=torch.channels_last) for v in range(y.shape[0]))
        assert torch.equal(a.mix_lam, b.mix_lam.cpu()) and torch.equal(a.index, b.index.cpu())
        n += 1
    assert n == len(raw) > 1


def test_a_batch_made_ahead_is_dropped_when_the_position_jumps(shards) -> None:
    """The taker thread makes the next batch while the last one is used; a resume or a jump to another
    epoch in between drops it and rebuilds the pipeline there: the batches are those of the new
    position, equal to a fresh loader's."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe=RELIC, batch_size=8, seed=5)

    def fresh(epoch: int = 0, state: dict | None = None) -> list:
        loader = dali_backend.DaliLoader(spec, shards)
        loader.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)
        return [b.index for b in loader]

    loader = dali_backend.DaliLoader(spec, shards)
    it = iter(loader)
    next(it)
    state = loader.state_dict()                     # before batch 1
    next(it), next(it)                              # batch 3 is being made ahead
    assert loader._ahead is not None
    loader.load_state_dict(state)
    resumed = [b.index for b in loader]
    assert len(resumed) == len(loader) - 1
    assert all(torch.equal(a, b) for a, b in zip(resumed, fresh(state=state), strict=True))
    loader.set_epoch(4)                             # the ahead batch is epoch 1's first
    jumped = [b.index for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(jumped, fresh(4), strict=True))


def test_a_graph_that_draws_itself_is_run_ahead_and_resumes_at_the_batch_handed_out(shards, monkeypatch) -> None:
    """Binary Mixup draws its masks in the graph, so a resume needs DALI's checkpoint: the taker thread
    runs the next batch too, and a state dict taken after that batch was run (the pipeline's own state
    then one batch ahead) still names the batch handed out: a loader resumed from it gives the same
    batches and the same drawn masks as the uninterrupted one."""
    runs = []
    real_run = dali_backend.DaliLoader._run
    monkeypatch.setattr(dali_backend.DaliLoader, "_run",
                        lambda self, stream: runs.append(threading.get_ident()) or real_run(self, stream))
    mix = MixSpec("dacl", alpha=0.5, dacl_noises=("binary",))
    spec = LoaderSpec(root="", dataset="", split="train", recipe=with_mix_source(MIX_RECIPE, mix), batch_size=8,
                      mix=mix, seed=7)

    def taken(loader, it) -> tuple[torch.Tensor, np.ndarray]:
        b = next(it)
        return b.mixed, loader.last_debug["mix/0/binary_mask"]

    loader = dali_backend.DaliLoader(spec, shards, debug=True)
    assert loader.draws_in_graph
    it = iter(loader)
    taken(loader, it)
    loader._ahead.batch.result()                        # batch 1 run: DALI's state is past it now
    state = loader.state_dict()
    rest = [taken(loader, it) for _ in range(3)]
    assert runs and threading.get_ident() not in runs
    resumed = dali_backend.DaliLoader(spec, shards, debug=True)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for mixed, mask in rest:
        b_mixed, b_mask = taken(resumed, again)
        assert torch.equal(b_mixed, mixed) and np.array_equal(b_mask, mask)


@pytest.mark.parametrize(("device", "case"), on_devices(
    [(c,) for c in ("relic+sdmp", "rsa", "channels-last", "torch-tail", "torch-tail+dacl+")],
    [(c,) for c in ("relic+sdmp", "rsa", "channels-last", "torch-tail+dacl+")]))
def test_a_graph_run_of_several_training_batches_hands_out_the_batches_of_runs_of_one(shards, device, case) -> None:
    """`graph_batches=3` (one run of the graph makes 3 training batches, its operators' set-up paid once):
    the same batches as runs of one, bit for bit, over two epochs whose batches (6) the runs straddle,
    the mixes' partners moved to each batch's place in the run (SDMP), staged views (RSA), each view
    channels-last and contiguous as a run of one gives it, the views finished by the torch tail
    (`gpu_tail="torch"`, its parameters passed through with the crops), DACL+'s mixes made by it (each
    training batch of a run with its own draws and per-pixel seeds: a graph that draws itself refuses
    runs of several); then a resume and a close in the middle of a run, and a jump to another epoch,
    as a loader of runs of one."""
    recipe = {"relic+sdmp": RELIC, "rsa": RSA, "channels-last": RSA, "torch-tail": RELIC,
              "torch-tail+dacl+": MIX_RECIPE}[case]
    mix = {"relic+sdmp": MixSpec("sdmp", alpha=1.0),
           "torch-tail+dacl+": MixSpec("dacl", alpha=0.5, dacl_noises=mixing.DACL_NOISES)}.get(case, MixSpec())
    tail = case.startswith("torch-tail")
    spec = LoaderSpec(root="", dataset="", split="train", recipe=with_mix_source(recipe, mix), batch_size=8,
                      device=device, seed=4, mix=mix, channels_last=case == "channels-last",
                      gpu_tail="torch" if tail else "graph")
    one = dali_backend.DaliLoader(spec, shards, gpu_branches=tail)
    three = dali_backend.DaliLoader(replace(spec, graph_batches=3), shards, gpu_branches=tail)
    assert one.tail == three.tail == tail

    # The torch tail on a GPU: batched kernels (the colour product, the means, the blur's convolution) may
    # sum in another order for a run of another size, so its views are the same up to float rounding there.
    close = tail and device == "cuda"

    def same(a, b) -> None:
        for f in ("global_views", "local_views", "weak_views", "mixed", "mix_lam", "mix_partner", "index", "label"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                assert x.shape == y.shape, f
                if close and x.is_floating_point():
                    assert torch.allclose(x.cpu(), y.cpu(), atol=1e-4, rtol=0), f
                else:
                    assert torch.equal(x.cpu(), y.cpu()), f
                if x.ndim == 5:
                    assert all(y[v].is_contiguous(memory_format=torch.channels_last if spec.channels_last else
                                                  torch.contiguous_format) for v in range(y.shape[0])), f

    for epoch in range(2):
        one.set_epoch(epoch)
        three.set_epoch(epoch)
        pairs = list(zip(one, three, strict=True))
        assert len(pairs) == N // 8 == 6
        for a, b in pairs:
            same(a, b)
    one.set_epoch(2)
    want = list(one)
    three.set_epoch(2)
    it = iter(three)
    got = [next(it) for _ in range(4)]                       # the second run's first batch handed out
    state = three.state_dict()
    resumed = dali_backend.DaliLoader(replace(spec, graph_batches=3), shards, gpu_branches=tail)
    resumed.load_state_dict(state)
    got += list(resumed)
    three.close()                                            # its second run's last batch not handed out
    assert [b.index.tolist() for b in list(three)] == [b.index.tolist() for b in want[4:]]
    for a, b in zip(want, got, strict=True):
        same(a, b)
    one.set_epoch(7)
    three.set_epoch(7)
    for a, b in zip(one, three, strict=True):
        same(a, b)


@pytest.mark.parametrize(("device", "recipe", "channels_last"), on_devices(
    [(r, c) for r in ("relic", "rsa") for c in (False, True)], [("relic", True)]))
def test_the_torch_tail_finishes_the_crops_as_the_graph_does(shards, device, recipe, channels_last) -> None:
    """`gpu_tail="torch"`: the graph hands out its crops as uint8 and batched torch ops finish them on the
    training device (pipelines/dali_tail.py): the batches of the graph's own tail (the GPU graph's, on
    the CPU graph its branches), every view within one level (the graph rounds to uint8 between its
    ops, the tail stays float), over two epochs: the saliency composite before the colour (RELIC, its
    masks), staged views from their parents (RSA), in the layout the network takes."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe={"relic": RELIC, "rsa": RSA}[recipe], batch_size=8,
                      device=device, seed=8, channels_last=channels_last)
    n = 0
    for a, b in _beside_the_graph(spec, shards, device):
        assert torch.equal(a.index, b.index) and torch.equal(a.label, b.label)
        for f in ("global_views", "local_views", "weak_views", "mixed"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                assert y.dtype == torch.float32 and x.shape == y.shape
                assert float((_pixels(x) - _pixels(y)).abs().max()) <= TAIL_LEVELS, f
                if channels_last:
                    assert all(y[v].is_contiguous(memory_format=torch.channels_last) for v in range(len(y)))
        n += 1
    assert n == 2 * (N // 8)


# The torch tail beside the graph's own: the graph rounds to uint8 after its colour pass, its blur and its
# mixes, the tail stays float (at most 0.99 of a level apart on the CPU graph, 29 Nov 2026).
TAIL_LEVELS = 2.0


def _beside_the_graph(spec: LoaderSpec, shards, device: str, epochs: int = 2):
    """Pairs of batches of `spec` on the host, (the graph's own tail, the torch tail), over `epochs` epochs;
    on the CPU both take the GPU graph's branches (where the torch tail runs)."""
    on_cpu = device == "cpu"
    graph = dali_backend.DaliLoader(spec, shards, gpu_branches=on_cpu)
    tail = dali_backend.DaliLoader(replace(spec, gpu_tail="torch"), shards, gpu_branches=on_cpu)
    assert tail.tail and not graph.tail
    for epoch in range(epochs):
        graph.set_epoch(epoch)
        tail.set_epoch(epoch)
        yield from zip(on_host(graph, device), on_host(tail, device), strict=True)


@pytest.mark.parametrize(("device", "kind"), on_devices(
    [(k,) for k in ("mixup", "cutmix", "resizemix", "linear")], [("cutmix",), ("linear",)]))
def test_the_torch_tail_mixes_as_the_graph_does(shards, device, kind: str) -> None:
    """With a mix the torch tail makes the mixes too (the reference's `mixing.MIXES[kind].apply` on its
    finished views, from the draws the batch's source made): the graph's partners and lams exactly, and
    its mixes within one level (the graph mixes uint8 views and rounds), over two epochs."""
    mix = (MixSpec("sdmp", alpha=1.0, sdmp_mixers=(kind,)) if kind != "linear" else
           MixSpec("dacl", alpha=0.5, dacl_noises=("linear",)))
    spec = LoaderSpec(root="", dataset="", split="train", recipe=with_mix_source(MIX_RECIPE, mix), batch_size=8,
                      device=device, seed=9, mix=mix)
    n = 0
    for a, b in _beside_the_graph(spec, shards, device):
        assert torch.equal(a.mix_partner, b.mix_partner) and torch.equal(a.mix_lam, b.mix_lam)
        assert float((_pixels(a.mixed) - _pixels(b.mixed)).abs().max()) <= TAIL_LEVELS
        n += 1
    assert n == 2 * (N // 8)


@pytest.mark.parametrize("noise", ["binary", "gaussian"])
def test_the_torch_tail_draws_dacl_s_pixels_from_the_batch_s_seeds(shards, device, noise: str) -> None:
    """DACL's per-pixel draws, which the graph makes itself (a DALI checkpoint to resume), the torch tail
    makes on the device from the seeds the batch's source drew (`mixing.dacl_pixel_draws`): its mixes
    are Eq. (6)'s / the Gaussian-noise baseline's on its own views with those draws, batch after
    batch, and a resumed loader needs no DALI state."""
    mix = MixSpec("dacl", alpha=0.5, dacl_noises=(noise,), gauss_scale=GAUSS)
    loader = _loader(shards, MIX_RECIPE, device, seed=15, mix=mix, gpu_tail="torch")
    assert not loader.draws_in_graph
    n = 0
    for b in loader:
        d = loader.last_draws.mix                      # drawn on the host; the pixels on the loader's device
        d = replace(d, partner=d.partner.to(device), lam=d.lam.to(device), noise=d.noise.to(device))
        d = mixing.dacl_pixel_draws(d, mix, 16, 16, device)
        x = (_pixels(b.global_views) / 255).to(device)                                   # (2, B, 3, S, S)
        want, _ = mixing.MIXES["dacl"].apply(x, d, mix)
        assert torch.allclose(_pixels(b.mixed), want.cpu() * 255, atol=1e-3), n
        n += 1
    assert n == N // 8


def test_the_torch_tail_is_refused_with_uint8_views(shards) -> None:
    """The torch tail normalises the views itself: uint8 views out of the graph are refused in one line
    that names the setting to change."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe=MIX_RECIPE, batch_size=8, gpu_tail="torch",
                      graph_dtype="uint8")
    with pytest.raises(dali_backend.LoaderError, match="use graph_dtype=float32") as e:
        dali_backend.DaliLoader(spec, shards)
    assert "\n" not in str(e.value)


def test_a_graph_run_of_several_training_batches_is_refused_where_the_graph_draws_itself(shards) -> None:
    """DACL's Binary Mixup draws its masks in the graph, whose state resumes at a run's start only: with
    `graph_batches` above 1 the loader is refused in one line that says what to use."""
    mix = MixSpec("dacl", alpha=0.5, dacl_noises=("binary",))
    spec = LoaderSpec(root="", dataset="", split="train", recipe=with_mix_source(MIX_RECIPE, mix), batch_size=8,
                      mix=mix, graph_batches=2)
    with pytest.raises(dali_backend.LoaderError, match="use graph_batches=1") as e:
        dali_backend.DaliLoader(spec, shards)
    assert "\n" not in str(e.value)


def _dali_shared_memory(pids: list[int]) -> int:
    """Bytes of the DALI shared-memory chunks these processes hold (each file counted once)."""
    seen = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if "nvidia_dali" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    seen[st.st_dev, st.st_ino] = st.st_size
            except OSError:
                continue
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("batch_size, graph_batches", [(128, 1), (64, 2)])
def test_the_shared_memory_estimate_bounds_what_dali_s_workers_hold(tmp_path, batch_size, graph_batches) -> None:
    """`shared_memory_bytes` (what the run checks /dev/shm against) is an upper bound of the chunks DALI's
    workers and pipeline hold after epochs of batches larger than DALI's smallest chunk, and within 4x;
    a run of the graph that makes 2 training batches holds what their samples take."""
    from pipelines.loader import build_loader, shared_memory_bytes
    from pipelines.processes import descendants
    from pipelines.views import load_recipe
    from preprocess.prepare import prepare_dataset

    prepare_dataset("synthetic", tmp_path, workers=1, train_size=256, val_size=2, image_px=64, seed=0)
    spec = LoaderSpec(root=str(tmp_path), dataset="synthetic", split="train", recipe=load_recipe("byol", 32, 16),
                      batch_size=batch_size, num_workers=8, graph_batches=graph_batches)
    estimate = shared_memory_bytes("dali", spec)
    loader = build_loader("dali", spec)
    peak = 0
    for _ in range(3):
        for _batch in loader:
            peak = max(peak, _dali_shared_memory([os.getpid()] + [p for p, _ in descendants(os.getpid())]))
    loader.close()
    assert 2 * dali_backend.MIN_CHUNK_BYTES < peak <= estimate <= 4 * peak, (peak, estimate)


def _build_output(device: str) -> str:
    """The code of a process that builds one DALI loader of the tiny dataset, reads a batch and prints the
    codecs' log level."""
    code = ("import sys, os; from pipelines.loader import build_loader; from pipelines.spec import LoaderSpec; "
            "from pipelines.views import load_recipe; "
            f"spec = LoaderSpec(root=sys.argv[1], dataset='synthetic', split='train', recipe=load_recipe('byol', 32, 16), "
            f"batch_size=8, num_workers=1, device={device!r}); next(iter(build_loader('dali', spec))); "
            "print('level', os.environ.get('DALI_NVIMGCODEC_LOG_LEVEL'))")
    return code


@pytest.mark.slow
@pytest.mark.parametrize("user_level", [None, "3"])
def test_the_image_codecs_log_fatal_errors_only_unless_the_user_says(tiny_data_root, user_level) -> None:
    """nvImageCodec's "Failed to load" lines for codecs viewmill never reads are kept off the console
    (`DALI_NVIMGCODEC_LOG_LEVEL` 1); a level the user set is left as it is."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DALI_NVIMGCODEC_LOG_LEVEL"}
    if user_level:
        env["DALI_NVIMGCODEC_LOG_LEVEL"] = user_level
    done = subprocess.run([sys.executable, "-c", _build_output("cpu"), str(tiny_data_root)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"level {user_level or 1}" in done.stdout


@pytest.mark.gpu
def test_a_gpu_pipeline_prints_no_codec_load_failures(tiny_data_root) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DALI_NVIMGCODEC_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", _build_output("cuda"), str(tiny_data_root)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Failed to load" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
