"""View recipes: what views a training step sees, as data, and the role of every view.

A recipe is a list of view groups, loaded from YAML (presets in `pipelines/recipes/`). Every sample
and every view draws its own random parameters; the recipe only fixes the laws they are drawn from
(`pipelines/augment.py` holds the laws and the reference ops).

Sizes in a recipe may be the words `global` or `local`, resolved per dataset (224/96 for ImageNet,
32/16 for CIFAR, 64/32 for 64-px data) by `load_recipe`.

Roles. Every group's role is decided here, once, when a `Recipe` is made; backends and the
trainer read `Recipe.fields` and `ViewGroup.role`, and nothing else decides it:

- `staged` — a group with `parent: <name>` (RSA): it takes each view of the parent group *after*
  the parent's ops and applies its own colour/blur/solarize ops on top; it has no crop of its own,
  so its crop fields keep their defaults, its size and count are the parent's;
- `weak` — a group that another group names as its parent;
- `global` / `local` — any other group that crops the image: the word of its `size_px` (or an
  explicit `role:`) when the YAML gives one, otherwise `global` for the largest crop size of the
  recipe and `local` for smaller ones;
- `image` — the whole image resized to the global size, no ops: the source of DACL's mixes with
  `mix.source=image` (`pipelines.mixing.with_mix_source` adds it); no `Batch` field of its own.

`Batch` fields, in this order: `global_views` = the staged groups, then the global groups (each in
recipe order), so that objectives reading `global_views[:2]` get the aggressive views of a staged
recipe; `local_views` = the local groups; `weak_views` = the weak groups (their order matches the
staged views built on them when each weak group has one staged child).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from dataclasses import fields as _fields
from pathlib import Path

ROLES = ("global", "local", "weak", "staged", "image")
FIELDS = ("global_views", "local_views", "weak_views")


@dataclass(frozen=True)
class ViewGroup:
    """One group of views that share their laws of random parameters."""

    name: str                                   # unique within the recipe
    count: int = 1                              # views drawn per sample
    size_px: int = 224                          # square output side
    crop_p: float = 1.0                         # probability of a random crop; else the whole image, resized
    centre_crop: float = 0.0                    # > 0: no draw, the central square of this share of the shorter
                                                # side (evaluation: resize to 256, crop 224 is 224/256 = 0.875)
    area: tuple[float, float] = (0.08, 1.0)     # crop area range, fraction of the image area
    ratio: tuple[float, float] = (3 / 4, 4 / 3) # aspect-ratio range (w/h), drawn log-uniformly
    interpolation: str = "bicubic"              # "bilinear" | "bicubic" (resize of the crop)
    flip_p: float = 0.5                         # horizontal flip probability
    jitter_p: float = 0.0                       # colour-jitter probability
    brightness: float = 0.0                     # max adjustment a: factor drawn in [1-a, 1+a]
    contrast: float = 0.0                       # same, contrast
    saturation: float = 0.0                     # same, saturation
    hue: float = 0.0                            # hue shift drawn in [-a, a], a <= 0.5 (turns)
    gray_p: float = 0.0                         # grayscale probability (augment.GRAY_WEIGHTS)
    blur_p: float = 0.0                         # Gaussian-blur probability
    blur_sigma: tuple[float, float] = (0.1, 2.0)  # sigma range in px, drawn uniformly; px of what: blur_sigma_at
    blur_sigma_at: str = "reference"            # "reference": px of a view of blur_reference_px, scaled to
                                                # this view; "view": px of the view itself, whatever its size
    blur_reference_px: int = 0                  # the view side blur_sigma is given at; 0: augment.BLUR_REFERENCE_PX
    blur_kernel_px: int = 0                     # blur window side where sigma is given, scaled like it; 0: augment's rule
    solarize_p: float = 0.0                     # solarize probability, threshold at half range
    saliency_p: float = 0.0                     # background-removal probability (global crops only)
    parent: str | None = None                   # staged group: name of the weak group it builds on
    role: str | None = None                     # one of ROLES; None: decided by `Recipe` (module docstring)

    @property
    def crops(self) -> bool:
        """Whether the group crops the decoded image itself (every role but `staged`)."""
        return self.parent is None


@dataclass(frozen=True)
class Recipe:
    """An ordered list of view groups, each with its role resolved and the whole recipe validated.

    Raises:
        RecipeError: an invalid recipe (see `validate_recipe`).
    """

    name: str
    groups: tuple[ViewGroup, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", _resolve_roles(self.name, tuple(self.groups)))
        validate_recipe(self)

    def by_role(self, *roles: str) -> tuple[ViewGroup, ...]:
        """The groups of `roles`, in recipe order within each role, roles in the order given."""
        return tuple(g for r in roles for g in self.groups if g.role == r)

    @property
    def fields(self) -> dict[str, tuple[ViewGroup, ...]]:
        """{`Batch` field: its groups, in field order}; the one mapping every backend uses."""
        return {"global_views": self.by_role("staged", "global"), "local_views": self.by_role("local"),
                "weak_views": self.by_role("weak")}

    @property
    def crop_groups(self) -> tuple[ViewGroup, ...]:
        """Groups that crop the image (all but staged), in recipe order."""
        return tuple(g for g in self.groups if g.crops)

    @property
    def global_px(self) -> int:
        """Side of `Batch.global_views`."""
        return self.fields["global_views"][0].size_px

    def group(self, name: str) -> ViewGroup:
        return next(g for g in self.groups if g.name == name)


# ------------------------------------------------------------------------------------------------
# Roles and validation.
# ------------------------------------------------------------------------------------------------


RECIPE_DIR = Path(__file__).resolve().parent / "recipes"
PRESETS = ("byol", "relicv2", "rsa", "multicrop8", "plain")
# Presets that change only a parameter of one of the PRESETS families (the backends' contract runs the
# families; a crop range is a parameter every backend reads): name -> its family.
VARIANTS = {"mocov3": "byol"}
INTERPOLATIONS = ("bilinear", "bicubic")
BLUR_SIGMA_AT = ("reference", "view")
_GROUP_KEYS = tuple(f.name for f in _fields(ViewGroup))
_CROP_KEYS = ("size_px", "crop_p", "centre_crop", "area", "ratio", "interpolation", "flip_p", "saliency_p")
_PROB_KEYS = ("crop_p", "flip_p", "jitter_p", "gray_p", "blur_p", "solarize_p", "saliency_p")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message is one line naming the problem and the fix."""


def _resolve_roles(name: str, groups: tuple[ViewGroup, ...]) -> tuple[ViewGroup, ...]:
    """Every group with its role (module docstring); staged groups take their parent's size."""
    by_name = {g.name: g for g in groups}
    parents = {g.parent for g in groups if g.parent is not None}
    free = [g for g in groups if g.parent is None and g.role is None and g.name not in parents]
    largest = max((g.size_px for g in groups if g.parent is None and g.role != "image"), default=0)
    out = []
    for g in groups:
        if g.role is not None and g.role not in ROLES:
            raise RecipeError(f"recipe {name!r} group {g.name!r}: role {g.role!r}; use one of {', '.join(ROLES)}")
        if g.parent is not None:
            par = by_name.get(g.parent)
            size = par.size_px if par is not None else g.size_px
            if g.size_px not in (size, ViewGroup.size_px):
                raise RecipeError(f"recipe {name!r} group {g.name!r}: a staged group has no crop of its own "
                                  f"(it takes the size of {g.parent!r}); remove ['size_px']")
            out.append(replace(g, role="staged", size_px=size))
        elif g.name in parents:
            out.append(replace(g, role="weak"))
        elif g in free:
            out.append(replace(g, role="global" if g.size_px == largest else "local"))
        else:
            out.append(g)
    return tuple(out)


def validate_recipe(recipe: Recipe) -> Recipe:
    """Check a recipe whose roles are resolved; returns it unchanged.

    Raises:
        RecipeError: no groups, duplicate names, probabilities outside [0, 1], bad ranges, unknown
            parent, a staged group with its own crop parameters or a count different from its
            parent's, a parent that is itself staged, a role that contradicts the group, saliency
            outside the global crops, no global view, or groups of one `Batch` field at different
            sizes.
    """
    if not recipe.groups:
        raise RecipeError(f"recipe {recipe.name!r} has no view groups; add at least one under `groups:`")
    names = [g.name for g in recipe.groups]
    by_name = {g.name: g for g in recipe.groups}
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise RecipeError(f"recipe {recipe.name!r}: duplicate group name(s) {dup}; names must be unique")
    default = ViewGroup(name="_")
    parents = {g.parent for g in recipe.groups if g.parent is not None}
    for g in recipe.groups:
        where = f"recipe {recipe.name!r} group {g.name!r}"
        if g.count < 1:
            raise RecipeError(f"{where}: count {g.count} must be >= 1")
        if g.size_px < 1:
            raise RecipeError(f"{where}: size_px {g.size_px} must be >= 1")
        for k in _PROB_KEYS:
            p = getattr(g, k)
            if not 0.0 <= p <= 1.0:
                raise RecipeError(f"{where}: {k} {p} outside [0, 1]; use a probability")
        for k in ("brightness", "contrast", "saturation"):
            if getattr(g, k) < 0:
                raise RecipeError(f"{where}: {k} {getattr(g, k)} must be >= 0")
        if not 0 <= g.hue <= 0.5:
            raise RecipeError(f"{where}: hue {g.hue} must lie in [0, 0.5]")
        if not 0.0 <= g.centre_crop <= 1.0:
            raise RecipeError(f"{where}: centre_crop {g.centre_crop} outside [0, 1]; give the share of the shorter "
                              "side (0.875 for a 224 crop of a 256 resize), or 0 for the random crop")
        if not (0 < g.area[0] <= g.area[1] <= 1):
            raise RecipeError(f"{where}: area {list(g.area)} must satisfy 0 < min <= max <= 1")
        if not (0 < g.ratio[0] <= g.ratio[1]):
            raise RecipeError(f"{where}: ratio {list(g.ratio)} must satisfy 0 < min <= max")
        if not (0 < g.blur_sigma[0] <= g.blur_sigma[1]):
            raise RecipeError(f"{where}: blur_sigma {list(g.blur_sigma)} must satisfy 0 < min <= max")
        if g.blur_kernel_px < 0 or g.blur_reference_px < 0:
            raise RecipeError(f"{where}: blur_kernel_px and blur_reference_px must be >= 0 (0: the default rule), "
                              f"got {g.blur_kernel_px} and {g.blur_reference_px}")
        if g.blur_sigma_at not in BLUR_SIGMA_AT:
            raise RecipeError(f"{where}: blur_sigma_at {g.blur_sigma_at!r}; use one of {', '.join(BLUR_SIGMA_AT)}")
        if g.interpolation not in INTERPOLATIONS:
            raise RecipeError(f"{where}: interpolation {g.interpolation!r}; use one of {', '.join(INTERPOLATIONS)}")
        if g.parent is not None:
            if g.parent not in by_name:
                raise RecipeError(f"{where}: unknown parent {g.parent!r}; use one of {', '.join(n for n in names if n != g.name)}")
            par = by_name[g.parent]
            if par.parent is not None:
                raise RecipeError(f"{where}: parent {par.name!r} is itself staged; stage on a cropping group")
            own = [k for k in _CROP_KEYS if k != "size_px" and getattr(g, k) != getattr(default, k)]
            if own:
                raise RecipeError(f"{where}: a staged group has no crop of its own; remove {own}")
            if g.count != par.count:
                raise RecipeError(f"{where}: count {g.count} differs from parent {par.name!r} count {par.count}; make them equal")
        elif g.role == "staged" or (g.role == "weak" and g.name not in parents):
            raise RecipeError(f"{where}: role {g.role!r} is decided by `parent`; remove the role")
        if g.saliency_p > 0 and g.role != "global":
            raise RecipeError(f"{where}: saliency_p on a {g.role} group ({g.size_px} px); saliency applies to "
                              "global crops only")
    fields = recipe.fields
    if not fields["global_views"]:
        raise RecipeError(f"recipe {recipe.name!r} has no global view; give one group size_px: global")
    for name, groups in fields.items():
        sizes = sorted({g.size_px for g in groups})
        if len(sizes) > 1:
            raise RecipeError(f"recipe {recipe.name!r}: the {name} groups {[g.name for g in groups]} have sizes "
                              f"{sizes} px; one Batch field holds one size, so make them equal")
    return recipe


# ------------------------------------------------------------------------------------------------
# Loading.
# ------------------------------------------------------------------------------------------------


def dataset_sizes(image_px: int) -> tuple[int, int]:
    """(global_px, local_px) for a dataset of `image_px` images: 224/96 ImageNet-size, 32/16 CIFAR,
    otherwise the image side and half of it (64/32 for 64-px data)."""
    if image_px >= 224:
        return 224, 96
    return image_px, max(1, image_px // 2)


def _size(v, global_px: int, local_px: int, where: str) -> tuple[int, str | None]:
    """(px, role the word implies or None) of a YAML `size_px`."""
    if v in ("global", "local"):
        return (int(global_px) if v == "global" else int(local_px)), v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RecipeError(f"{where}: size_px {v!r} must be a positive integer, 'global' or 'local'")
    return v, None


def _range(v, where: str, key: str, lo: float, hi: float) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v):
        raise RecipeError(f"{where}: {key} must be a pair [min, max] of numbers, got {v!r}")
    a, b = float(v[0]), float(v[1])
    if not (lo <= a <= b <= hi):
        raise RecipeError(f"{where}: {key} {[a, b]} must satisfy {lo} <= min <= max <= {hi}")
    return a, b


def load_recipe(name_or_path: str, global_px: int, local_px: int) -> Recipe:
    """Load a preset (`byol`, `relicv2`, `rsa`, `multicrop8`, `plain`; `mocov3`: `byol` with crops of
    20-100 %) or a YAML file, sizes and roles resolved.

    YAML layout: `name: <str>` (optional) and `groups:` a list of mappings with the `ViewGroup`
    fields; `size_px` may be `global` or `local` (which also sets the group's role). Staged groups
    take their parent's size.

    Raises:
        FileNotFoundError: neither a preset nor an existing file.
        RecipeError: invalid content (see `validate_recipe`).
    """
    import yaml

    path = Path(name_or_path)
    if name_or_path in PRESETS or name_or_path in VARIANTS:
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    elif not path.is_file():
        raise FileNotFoundError(f"recipe {name_or_path!r} is neither a preset ({', '.join([*PRESETS, *VARIANTS])}) "
                                "nor a YAML file")
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
    groups = []
    for i, g in enumerate(raw["groups"]):
        if not isinstance(g, dict) or "name" not in g:
            raise RecipeError(f"recipe {name!r} group #{i}: each group must be a mapping with a `name`")
        where = f"recipe {name!r} group {g['name']!r}"
        bad = sorted(set(g) - set(_GROUP_KEYS))
        if bad:
            raise RecipeError(f"{where}: unknown key(s) {bad}; valid: {', '.join(_GROUP_KEYS)}")
        kw = dict(g)
        word = None
        if "size_px" in kw:
            kw["size_px"], word = _size(kw["size_px"], global_px, local_px, where)
        elif "parent" not in kw:
            kw["size_px"], word = int(global_px), "global"
        if word is not None and "role" not in kw and "parent" not in kw:
            kw["role"] = word
        for key, lo, hi in (("area", 0.0, 1.0), ("ratio", 0.0, 1e9), ("blur_sigma", 0.0, 1e9)):
            if key in kw:
                kw[key] = _range(kw[key], where, key, lo, hi)
        for key in _PROB_KEYS + ("brightness", "contrast", "saturation", "hue"):
            if key in kw and (isinstance(kw[key], bool) or not isinstance(kw[key], (int, float))):
                raise RecipeError(f"{where}: {key} must be a number, got {kw[key]!r}")
        if "count" in kw and (isinstance(kw["count"], bool) or not isinstance(kw["count"], int)):
            raise RecipeError(f"{where}: count must be an integer, got {kw['count']!r}")
        groups.append(ViewGroup(**kw))
    # Words name a crop group's role; a weak parent's word only gives its size.
    parents = {g.parent for g in groups if g.parent is not None}
    groups = [replace(g, role=None) if g.name in parents and g.role in ("global", "local") else g for g in groups]
    return Recipe(name=name, groups=tuple(groups))


def recipe_for_dataset(name_or_path: str, image_px: int) -> Recipe:
    """`load_recipe` with the sizes of `dataset_sizes(image_px)`."""
    return load_recipe(name_or_path, *dataset_sizes(image_px))


__all__ = ["ViewGroup", "Recipe", "RecipeError", "load_recipe", "validate_recipe", "recipe_for_dataset",
           "dataset_sizes", "PRESETS", "VARIANTS", "ROLES", "FIELDS"]
