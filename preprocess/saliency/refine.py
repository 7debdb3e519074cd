"""DeepUSPS refinement of handcrafted pseudo-masks (Nguyen et al., NeurIPS 2019, "DeepUSPS: Deep Robust
Unsupervised Saliency Prediction With Self-Supervision"; RELICv2 arXiv:2201.05119v1, App. A.2 and D.1).

Stage I, per handcrafted method m, `rounds` rounds: a fresh `models.saliency.SaliencyNet` is trained on
the current targets (round 1: m's map thresholded at `first_threshold`; later rounds: the previous
round's moving average thresholded at 0.5). After each epoch past the first third, the network
predicts every training image in eval mode with flip test-time augmentation and the predictions are
folded into a per-image moving average, `keep`·old + (1 − `keep`)·new (DeepUSPS: 0.7 / 0.3, its
"inter-image consistency"); the round's refined labels are that average. The learning rate doubles
each round (DeepUSPS 1e-6, 2e-6, 5e-6; RELICv2 1e-5, 2e-5, 4e-5 for a pretrained ResNet; 1e-3 here
by default for a random or tiny network) and decays polynomially (power 0.9) within the round.

Stage II: one fresh network trained on every method's refined labels at once (the loss averaged over
the targets), `final_epochs` epochs.

Loss: DeepUSPS's soft F-measure (`soft_f_loss`, β² = 1 in stage I and 4 in stage II as in its code),
or binary cross-entropy with `loss="bce"`. Round-1 targets are the handcrafted maps thresholded low
(0.3; DeepUSPS uses 0.23-0.36 per method), later ones the moving average at 0.5.

Each prediction goes through DeepUSPS's dense CRF with its image (`crf.py`) before it is folded into
the moving average, as in DeepUSPS (`crf=False`, `--no-crf`: without; measured in docs/saliency.md).

The networks' maps go through the same CRF when they are scored and written (`NetStage`), as at
DeepUSPS's test time.

Deviations:
- The predictions are eval-mode and flip-averaged (DeepUSPS records the training forward's).
- Every round's network and the stage II network are candidate stages: `run.py` scores them with the
  handcrafted maps and uses the best, where DeepUSPS always uses stage II (on `synthetic` the best
  stage I round scores higher; docs/saliency.md).
- The moving average starts from the first averaged prediction rather than from zeros (DeepUSPS
  averages 25 epochs, so its zero start fades to 0.7^25; with a few epochs it would not) and
  skips the first third of the epochs (early, undertrained predictions made the labels drift).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from models.saliency import SaliencyNet, build_saliency_net, saliency_probabilities
from preprocess.saliency.crf import CrfPool
from preprocess.saliency.handcrafted import resize_map, resize_square

LOSSES = ("bce", "soft_f")


@dataclass(frozen=True)
class RefineSettings:
    rounds: int = 2                   # stage I self-training rounds per method; 0 skips refinement
    epochs: int = 10                  # epochs per stage I round
    final_epochs: int = 12            # epochs of the stage II network
    batch_size: int = 32
    lr: float = 1e-3                  # Adam, first round; doubled each round; poly decay within a round
    loss: str = "soft_f"              # "soft_f" (DeepUSPS's 1 - soft F-measure) or "bce"
    keep: float = 0.7                 # moving average: keep * old + (1 - keep) * new prediction
    first_threshold: float = 0.3      # round-1 targets: handcrafted map >= this (DeepUSPS: 0.23-0.36)
    backbone: str = "test_resnet"     # timm ResNet of the networks (ignored with init)
    init: str | None = None           # run folder or backbone.safetensors of a viewmill run
    net_px: int = 64                  # square input side of the networks, px (the CLI's 0: the images' side)
    crf: bool = True                  # DeepUSPS's dense CRF on the predictions (moving average) and the maps
    width: int = 32                   # decoder channels
    seed: int = 0


@dataclass
class Refinement:
    """What the refinement made: the networks by stage name, the refined labels of the training images
    by round, and seconds per stage."""

    nets: dict[str, SaliencyNet] = field(default_factory=dict)
    labels: dict[str, np.ndarray] = field(default_factory=dict)     # stage -> (N, px, px) float32 [0, 1]
    seconds: dict[str, float] = field(default_factory=dict)


def soft_f_loss(p: Tensor, y: Tensor, beta2: float = 1.0, eps: float = 1e-7) -> Tensor:
    """DeepUSPS's loss, 1 − soft F-measure of continuous predictions against a binary target:

    TP = Σ p·y, FP = Σ p·(1−y), FN = Σ (1−p)·y per image; prec = TP/(TP+FP+ε), rec = TP/(TP+FN+ε);
    L = 1 − (1+β²)·prec·rec / (β²·prec + rec + ε), averaged over the batch.

    Args:
        p: (B, H, W) predictions in [0, 1].
        y: (B, H, W) targets in {0, 1}.
        beta2: β², > 0.

    Returns:
        Scalar loss in [0, 1].
    """
    tp = (p * y).flatten(1).sum(1)
    fp = (p * (1 - y)).flatten(1).sum(1)
    fn = ((1 - p) * y).flatten(1).sum(1)
    prec, rec = tp / (tp + fp + eps), tp / (tp + fn + eps)
    return (1 - (1 + beta2) * prec * rec / (beta2 * prec + rec + eps)).mean()


def pixel_loss(logits: Tensor, targets: Tensor, kind: str, beta2: float) -> Tensor:
    """The mean over targets of the per-target loss. logits (B, H, W); targets (T, B, H, W) in {0, 1}."""
    if kind == "bce":      # the mean of BCEs over targets = BCE against their mean
        return F.binary_cross_entropy_with_logits(logits, targets.mean(0))
    p = torch.sigmoid(logits)
    return torch.stack([soft_f_loss(p, t, beta2) for t in targets]).mean()


def as_input(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """(N, H, W, 3) uint8 → (N, 3, H, W) float32, normalised with the dataset's mean and std."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255)   # (N, 3, H, W)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - m) / s


def predict(net: SaliencyNet, x: Tensor, batch_size: int = 128) -> np.ndarray:
    """Eval-mode flip-averaged saliency of (N, 3, H, W) inputs: (N, H, W) float32 in [0, 1]."""
    was = net.training
    net.eval()
    out = [saliency_probabilities(net, x[a:a + batch_size]).numpy() for a in range(0, len(x), batch_size)]
    net.train(was)
    return np.concatenate(out) if out else np.zeros((0, *x.shape[-2:]), np.float32)


def train_net(x: Tensor, targets: Tensor, epochs: int, lr: float, s: RefineSettings, seed: int,
              beta2: float = 1.0, on_epoch=None, partial: Path | None = None, kept: dict | None = None) -> SaliencyNet:
    """Train a fresh network on `targets` (T, N, H, W) {0, 1} for inputs `x` (N, 3, H, W), with
    random horizontal flips, Adam and a poly-decayed learning rate; `on_epoch(net, epoch)` after
    each epoch.

    With `partial`, where the training is after each epoch (network, optimiser, random states and the
    arrays of `kept`, the state `on_epoch` builds) is saved, and a training killed between two epochs
    continues from there when it starts again (`kept` filled in place); the file is the caller's to
    remove once the stage is saved."""
    torch.manual_seed(seed)
    net = build_saliency_net(s.backbone, s.init, s.width)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = max(1, math.ceil(len(x) / s.batch_size))
    total = epochs * steps_per_epoch
    step = first = 0
    if partial is not None and partial.exists():
        saved = torch.load(partial, map_location="cpu", weights_only=True)
        net.load_state_dict(saved["net"])
        opt.load_state_dict(saved["opt"])
        gen.set_state(saved["gen"])
        torch.set_rng_state(saved["rng"])
        step, first = saved["step"], saved["epoch"] + 1
        if kept is not None:
            kept.update({k: v.numpy() for k, v in saved["kept"].items()})
    net.train()
    for epoch in range(first, epochs):
        order = torch.randperm(len(x), generator=gen)
        for a in range(0, len(x), s.batch_size):
            idx = order[a:a + s.batch_size]
            xb, tb = x[idx], targets[:, idx]                                  # (b, 3, H, W), (T, b, H, W)
            flip = torch.rand(len(idx), generator=gen) < 0.5
            xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(-1), xb)
            tb = torch.where(flip.view(1, -1, 1, 1), tb.flip(-1), tb)
            for g in opt.param_groups:
                g["lr"] = lr * (1 - step / total) ** 0.9
            loss = pixel_loss(net(xb)[:, 0], tb, s.loss, beta2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        if on_epoch is not None:
            on_epoch(net, epoch)
        if partial is not None:
            _save_whole({"net": net.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                         "rng": torch.get_rng_state(), "step": step, "epoch": epoch,
                         "kept": {k: torch.from_numpy(v) for k, v in (kept or {}).items()}}, partial)
    net.eval()
    return net


def _kept(checkpoints: Path | None, stage: str,
          s: RefineSettings) -> tuple[SaliencyNet, np.ndarray | None, float] | None:
    """A stage an earlier run of the same refinement saved in `checkpoints` (network, labels, seconds)."""
    if checkpoints is None or not (checkpoints / f"{stage}.pt").exists():
        return None
    saved = torch.load(checkpoints / f"{stage}.pt", map_location="cpu", weights_only=True)
    net = build_saliency_net(s.backbone, s.init, s.width)
    net.load_state_dict(saved["state"])
    net.eval()
    labels = np.load(checkpoints / f"{stage}.labels.npy") if (checkpoints / f"{stage}.labels.npy").exists() else None
    return net, labels, float(saved["seconds"])


def _keep(checkpoints: Path | None, stage: str, net: SaliencyNet, labels: np.ndarray | None, seconds: float) -> None:
    """Save a finished stage into `checkpoints`: its labels first, the network last (its file is what
    `_kept` looks for), each written whole under a temporary name."""
    if checkpoints is None:
        return
    if labels is not None:
        tmp = checkpoints / f"{stage}.labels.tmp.npy"
        np.save(tmp, labels)
        tmp.replace(checkpoints / f"{stage}.labels.npy")
    _save_whole({"state": net.state_dict(), "seconds": seconds}, checkpoints / f"{stage}.pt")
    _partial(checkpoints, stage).unlink(missing_ok=True)


def _save_whole(obj: dict, path: Path) -> None:
    """`torch.save` under a temporary name, then renamed: a kill leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _partial(checkpoints: Path | None, stage: str) -> Path | None:
    """Where a stage's training is saved after each epoch (`train_net`), until the stage is kept."""
    return None if checkpoints is None else checkpoints / f"{stage}.partial.pt"


def refine(x: Tensor, handcrafted: dict[str, np.ndarray], s: RefineSettings, log=print,
           images: np.ndarray | None = None, crf: CrfPool | None = None,
           checkpoints: Path | None = None) -> Refinement:
    """Stage I for every method, then stage II.

    Args:
        x: (N, 3, px, px) normalised training images (the subset).
        handcrafted: method -> (N, px, px) float maps in [0, 1] of the same images.
        s: settings.
        log: receives one line per round.
        images: (N, px, px, 3) uint8, the same images unnormalised (needed with `s.crf`).
        crf: the dense CRF's processes (with `s.crf`; None: in this process).
        checkpoints: a folder where every finished stage is saved, and from which the stages an
            earlier run of the same refinement (the caller's to ensure) finished are taken instead
            of trained again; a stage's training is saved there after each epoch too, and a stage
            killed while it trained continues from its last epoch.

    Returns:
        The `Refinement`: nets "<method>-r<k>" for each round and "final" (stage II); labels
        "<method>-r<k>" (the round's moving average).
    """
    if s.loss not in LOSSES:
        raise ValueError(f"unknown saliency loss {s.loss!r}; choose from {', '.join(LOSSES)}")
    if s.crf and (images is None or images.shape[:3] != (len(x), *x.shape[-2:])):
        raise ValueError("the dense CRF needs the subset's uint8 images at the networks' side")
    crf = crf or CrfPool(1)
    out = Refinement()
    skip = s.epochs // 3
    for mi, (method, maps) in enumerate(handcrafted.items()):
        target = maps >= s.first_threshold
        for r in range(1, s.rounds + 1):
            stage = f"{method}-r{r}"
            if (kept := _kept(checkpoints, stage, s)) is not None:
                out.nets[stage], out.labels[stage], out.seconds[stage] = kept
                target = out.labels[stage] >= 0.5
                log(f"  {stage}: kept from an earlier run")
                continue
            t0 = time.perf_counter()
            state: dict[str, np.ndarray] = {}

            def fold(net, epoch, state=state):
                if epoch < skip:
                    return
                p = predict(net, x)
                if s.crf:
                    p = crf(p, images)
                state["mva"] = p if "mva" not in state else s.keep * state["mva"] + (1 - s.keep) * p

            net = train_net(x, torch.from_numpy(target[None].astype(np.float32)), s.epochs, s.lr * 2 ** (r - 1),
                            s, seed=s.seed + 100 * mi + r, beta2=1.0, on_epoch=fold,
                            partial=_partial(checkpoints, stage), kept=state)
            out.nets[stage], out.labels[stage] = net, state["mva"].astype(np.float32)
            target = state["mva"] >= 0.5
            out.seconds[stage] = time.perf_counter() - t0
            _keep(checkpoints, stage, net, out.labels[stage], out.seconds[stage])
            log(f"  {stage}: {s.epochs} epochs on {len(x)} images in {out.seconds[stage]:.1f} s")
    if s.rounds and (kept := _kept(checkpoints, "final", s)) is not None:
        out.nets["final"], _, out.seconds["final"] = kept
        log("  final: kept from an earlier run")
    elif s.rounds:
        t0 = time.perf_counter()
        last = [out.labels[f"{m}-r{s.rounds}"] >= 0.5 for m in handcrafted]
        out.nets["final"] = train_net(x, torch.from_numpy(np.stack(last).astype(np.float32)), s.final_epochs, s.lr,
                                      s, seed=s.seed + 99, beta2=4.0, partial=_partial(checkpoints, "final"))
        out.seconds["final"] = time.perf_counter() - t0
        _keep(checkpoints, "final", out.nets["final"], None, out.seconds["final"])
        log(f"  final: {s.final_epochs} epochs on {len(x)} images and {len(last)} refined targets in "
            f"{out.seconds['final']:.1f} s")
    return out


@dataclass(frozen=True)
class NetStage:
    """A trained saliency network as a map function, like a handcrafted method: images of any size
    in, [0, 1] maps out; with `crf`, each map through the dense CRF with its image, as DeepUSPS's
    test time."""

    net: SaliencyNet
    px: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crf: CrfPool | None = None

    def maps(self, images) -> np.ndarray:
        """(N, px, px) float32 maps of a sequence of (H, W, 3) uint8 images, at the network's side
        (resized to a square as DeepUSPS feeds its network, not aspect-preserving)."""
        square = np.stack([resize_square(im, self.px) for im in images])
        p = predict(self.net, as_input(square, self.mean, self.std))
        return self.crf(p, square) if self.crf is not None else p

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """The (H, W) float32 map of one (H, W, 3) uint8 image, at the image's size."""
        return resize_map(self.maps([image])[0], image.shape[:2])
