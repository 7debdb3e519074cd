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
from dataclasses import fields as _fields
from pathlib import Path


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


# ------------------------------------------------------------------------------------------------
# Loading and validation (added with the recipe presets).
# ------------------------------------------------------------------------------------------------


RECIPE_DIR = Path(__file__).resolve().parent / "recipes"
PRESETS = ("byol", "relicv2", "rsa", "multicrop8", "plain")
INTERPOLATIONS = ("bilinear", "bicubic")
_GROUP_KEYS = tuple(f.name for f in _fields(ViewGroup))
_CROP_KEYS = ("size_px", "crop_p", "area", "ratio", "interpolation", "flip_p", "saliency_p")
_PROB_KEYS = ("crop_p", "flip_p", "jitter_p", "gray_p", "blur_p", "solarize_p", "saliency_p")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message is one line naming the problem and the fix."""


def dataset_sizes(image_px: int) -> tuple[int, int]:
    """(global_px, local_px) for a dataset of `image_px` images: 224/96 ImageNet-size, 32/16 CIFAR,
    otherwise the image side and half of it (64/32 for 64-px data)."""
    if image_px >= 224:
        return 224, 96
    return image_px, max(1, image_px // 2)


def _size(v, global_px: int, local_px: int, where: str) -> int:
    if v == "global":
        return int(global_px)
    if v == "local":
        return int(local_px)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RecipeError(f"{where}: size_px {v!r} must be a positive integer, 'global' or 'local'")
    return v


def _range(v, where: str, key: str, lo: float, hi: float) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v):
        raise RecipeError(f"{where}: {key} must be a pair [min, max] of numbers, got {v!r}")
    a, b = float(v[0]), float(v[1])
    if not (lo <= a <= b <= hi):
        raise RecipeError(f"{where}: {key} {[a, b]} must satisfy {lo} <= min <= max <= {hi}")
    return a, b


def validate_recipe(recipe: Recipe) -> Recipe:
    """Check a resolved recipe; returns it unchanged.

    Raises:
        RecipeError: duplicate names, probabilities outside [0, 1], bad ranges, unknown parent,
            staged group with its own crop parameters or a count different from its parent's, a
            parent that is itself staged, saliency on small crops, no groups.
    """
    if not recipe.groups:
        raise RecipeError(f"recipe {recipe.name!r} has no view groups; add at least one under `groups:`")
    names = [g.name for g in recipe.groups]
    by_name = {g.name: g for g in recipe.groups}
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise RecipeError(f"recipe {recipe.name!r}: duplicate group name(s) {dup}; names must be unique")
    default = ViewGroup(name="_")
    big = max(g.size_px for g in recipe.groups if g.parent is None) if any(g.parent is None for g in recipe.groups) else 0
    for g in recipe.groups:
        where = f"recipe {recipe.name!r} group {g.name!r}"
        if g.count < 1:
            raise RecipeError(f"{where}: count {g.count} must be >= 1")
        for k in _PROB_KEYS:
            p = getattr(g, k)
            if not 0.0 <= p <= 1.0:
                raise RecipeError(f"{where}: {k} {p} outside [0, 1]; use a probability")
        for k in ("brightness", "contrast", "saturation"):
            if getattr(g, k) < 0:
                raise RecipeError(f"{where}: {k} {getattr(g, k)} must be >= 0")
        if not 0 <= g.hue <= 0.5:
            raise RecipeError(f"{where}: hue {g.hue} must lie in [0, 0.5]")
        if not (0 < g.area[0] <= g.area[1] <= 1):
            raise RecipeError(f"{where}: area {list(g.area)} must satisfy 0 < min <= max <= 1")
        if not (0 < g.ratio[0] <= g.ratio[1]):
            raise RecipeError(f"{where}: ratio {list(g.ratio)} must satisfy 0 < min <= max")
        if not (0 < g.blur_sigma[0] <= g.blur_sigma[1]):
            raise RecipeError(f"{where}: blur_sigma {list(g.blur_sigma)} must satisfy 0 < min <= max")
        if g.interpolation not in INTERPOLATIONS:
            raise RecipeError(f"{where}: interpolation {g.interpolation!r}; use one of {', '.join(INTERPOLATIONS)}")
        if g.parent is not None:
            if g.parent not in by_name:
                raise RecipeError(f"{where}: unknown parent {g.parent!r}; use one of {', '.join(n for n in names if n != g.name)}")
            par = by_name[g.parent]
            if par.parent is not None:
                raise RecipeError(f"{where}: parent {par.name!r} is itself staged; stage on a cropping group")
            own = [k for k in _CROP_KEYS if k != "size_px" and getattr(g, k) != getattr(default, k)]
            if own or (g.size_px != par.size_px and g.size_px != default.size_px):
                raise RecipeError(f"{where}: a staged group has no crop of its own; remove {own or ['size_px']}")
            if g.count != par.count:
                raise RecipeError(f"{where}: count {g.count} differs from parent {par.name!r} count {par.count}; make them equal")
        elif g.saliency_p > 0 and g.size_px < big:
            raise RecipeError(f"{where}: saliency_p on a small crop ({g.size_px} px); saliency applies to large crops only")
    return recipe


def load_recipe(name_or_path: str, global_px: int, local_px: int) -> Recipe:
    """Load a preset (`byol`, `relicv2`, `rsa`, `multicrop8`, `plain`) or a YAML file, sizes resolved.

    YAML layout: `name: <str>` (optional) and `groups:` a list of mappings with the `ViewGroup`
    fields; `size_px` may be `global` or `local`. Staged groups take their parent's size.

    Raises:
        FileNotFoundError: neither a preset nor an existing file.
        RecipeError: invalid content (see `validate_recipe`).
    """
    import yaml

    path = Path(name_or_path)
    if name_or_path in PRESETS:
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    elif not path.is_file():
        raise FileNotFoundError(f"recipe {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path.name}: not valid YAML ({str(e).splitlines()[0]}); fix the syntax") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("groups"), list):
        raise RecipeError(f"recipe {path.name}: expected a mapping with a `groups:` list")
    unknown_top = sorted(set(raw) - {"name", "groups"})
    if unknown_top:
        raise RecipeError(f"recipe {path.name}: unknown key(s) {unknown_top}; valid: name, groups")
    name = str(raw.get("name", path.stem))
    items = []
    for i, g in enumerate(raw["groups"]):
        where = f"recipe {name!r} group #{i}"
        if not isinstance(g, dict) or "name" not in g:
            raise RecipeError(f"{where}: each group must be a mapping with a `name`")
        bad = sorted(set(g) - set(_GROUP_KEYS))
        if bad:
            raise RecipeError(f"{where} ({g['name']}): unknown key(s) {bad}; valid: {', '.join(_GROUP_KEYS)}")
        items.append(dict(g))
    by_name = {g["name"]: g for g in items}
    groups = []
    for i, g in enumerate(items):
        where = f"recipe {name!r} group {g['name']!r}"
        kw = dict(g)
        if "size_px" in kw:
            kw["size_px"] = _size(kw["size_px"], global_px, local_px, where)
        elif kw.get("parent") in by_name:
            kw["size_px"] = _size(by_name[kw["parent"]].get("size_px", "global"), global_px, local_px, where)
        else:
            kw["size_px"] = int(global_px)
        for key, lo, hi in (("area", 0.0, 1.0), ("ratio", 0.0, 1e9), ("blur_sigma", 0.0, 1e9)):
            if key in kw:
                kw[key] = _range(kw[key], where, key, lo, hi)
        for key in _PROB_KEYS + ("brightness", "contrast", "saturation", "hue"):
            if key in kw and (isinstance(kw[key], bool) or not isinstance(kw[key], (int, float))):
                raise RecipeError(f"{where}: {key} must be a number, got {kw[key]!r}")
        if "count" in kw and (isinstance(kw["count"], bool) or not isinstance(kw["count"], int)):
            raise RecipeError(f"{where}: count must be an integer, got {kw['count']!r}")
        groups.append(ViewGroup(**kw))
    return validate_recipe(Recipe(name=name, groups=tuple(groups)))


def recipe_for_dataset(name_or_path: str, image_px: int) -> Recipe:
    """`load_recipe` with the sizes of `dataset_sizes(image_px)`."""
    return load_recipe(name_or_path, *dataset_sizes(image_px))


__all__ = ["ViewGroup", "Recipe", "RecipeError", "load_recipe", "validate_recipe", "recipe_for_dataset",
           "dataset_sizes", "PRESETS"]
