"""View recipes: what views a training step sees, as data.

A recipe is a list of view groups, loaded from YAML (presets in `pipelines/recipes/`). Every sample
and every view draws its own random parameters; the recipe only fixes the laws they are drawn from.
Sizes in a recipe may be the words `global` or `local`, resolved per dataset (224/96 for ImageNet,
32/16 for CIFAR, 64/32 for 64-px data) by `load_recipe`.

Group roles:
- a group without `parent` crops the decoded image itself (a weak crop when some other group names
  it as parent, a large or small crop otherwise, by its size);
- a group with `parent: <name>` is staged (RSA): it takes each view of the parent group *after* the
  parent's ops and applies its own colour/blur/solarize ops on top; it has no crop of its own, so its
  crop fields must keep their defaults and its `count` equals the parent's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ViewGroup:
    """One group of views that share their laws of random parameters."""

    name: str                                   # unique within the recipe
    count: int = 1                              # views drawn per sample
    size_px: int = 224                          # square output side
    crop_p: float = 1.0                         # probability of a random crop; else the whole image, resized
    area: tuple[float, float] = (0.08, 1.0)     # crop area range, fraction of the image area
    ratio: tuple[float, float] = (3 / 4, 4 / 3) # aspect-ratio range (w/h), drawn log-uniformly
    interpolation: str = "bicubic"              # "bilinear" | "bicubic" (resize of the crop)
    flip_p: float = 0.5                         # horizontal flip probability
    jitter_p: float = 0.0                       # colour-jitter probability
    brightness: float = 0.0                     # max adjustment a: factor drawn in [1-a, 1+a]
    contrast: float = 0.0                       # same, contrast
    saturation: float = 0.0                     # same, saturation
    hue: float = 0.0                            # hue shift drawn in [-a, a], a <= 0.5 (turns)
    gray_p: float = 0.0                         # grayscale probability (0.2989 r + 0.5870 g + 0.1140 b)
    blur_p: float = 0.0                         # Gaussian-blur probability
    blur_sigma: tuple[float, float] = (0.1, 2.0)  # sigma range in px at size 224, drawn uniformly
    solarize_p: float = 0.0                     # solarize probability, threshold at half range
    saliency_p: float = 0.0                     # background-removal probability (large crops only)
    parent: str | None = None                   # staged group: name of the weak group it builds on

    @property
    def blur_kernel_px(self) -> int:
        """Odd Gaussian kernel side derived from the output size: 23 px at 224 (10 %)."""
        k = int(round(0.1 * self.size_px))
        return k if k % 2 == 1 else k + 1


@dataclass(frozen=True)
class Recipe:
    """An ordered list of view groups."""

    name: str
    groups: tuple[ViewGroup, ...] = field(default_factory=tuple)
