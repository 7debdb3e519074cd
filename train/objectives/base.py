"""Types shared by the trainer and every objective: what goes in (`StepValues`), what comes out
(`LossOut`), what an objective needs from the data (`ViewNeeds`, checked against the views at start-up
by `check_needs`), the `Objective` base class with the validation every `Config` shares, and the
online/target forward that the EMA-target objectives share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from pipelines.batch import Batch
from pipelines.mixing import MixKind
from pipelines.views import Recipe
from train.config import ConfigError


@dataclass(frozen=True)
class StepValues:
    """Values of every schedule at one optimiser step (pure functions of `step`, train/schedules.py)."""

    step: int                 # optimiser step, 0-based
    total_steps: int          # steps of the whole run
    epoch: float              # step / steps_per_epoch
    lr: float                 # learning rate after warmup/cosine and batch scaling
    weight_decay: float       # weight decay at this step
    ema: float                # EMA momentum of the target network at this step


@dataclass(frozen=True)
class ViewNeeds:
    """What an objective reads from a `Batch`; checked against the data config at start-up."""

    global_views: int = 2     # minimum number of global views
    local: int = 0            # minimum number of local views (0: ignored if present)
    weak: bool = False        # needs staged weak parents (RSA)
    mix: MixKind = "none"     # intra-batch mix kind it needs: "none" | "sdmp" | "dacl"
    target: bool = True       # uses an EMA target network


def check_needs(method: str, needs: ViewNeeds, recipe: Recipe, mix_kind: str) -> None:
    """Fail at start-up, in one line, when the views of the data config cannot feed the objective.

    Counts the views of each `Batch` field from the roles the recipe resolved (`Recipe.fields`).

    Args:
        method: objective name (for the message).
        needs: the objective instance's `ViewNeeds`.
        recipe: the resolved `pipelines.views.Recipe`.
        mix_kind: `data.mix.kind`.

    Raises:
        ConfigError: naming the missing views and the setting that provides them.
    """
    views = {name: sum(g.count for g in groups) for name, groups in recipe.fields.items()}
    n_global, n_local, weak = views["global_views"], views["local_views"], views["weak_views"]
    problems = []
    if n_global < needs.global_views:
        problems.append(f"{needs.global_views} global views (recipe has {n_global})")
    if n_local < needs.local:
        problems.append(f"{needs.local} local views (recipe has {n_local})")
    if needs.weak and not weak:
        problems.append("staged weak views (recipe has none)")
    if needs.mix != "none" and mix_kind != needs.mix:
        problems.append(f"data.mix.kind={needs.mix} (config has {mix_kind})")
    if problems:
        raise ConfigError(f"method {method} needs {', '.join(problems)} but views.recipe={recipe.name} "
                          f"gives fewer; use configs/method/{method}.yaml's recipe or fix views.recipe / data.mix.kind")


@dataclass
class LossOut:
    """The loss of one step and the detached terms to log."""

    loss: Tensor                                            # scalar, differentiable
    logs: dict[str, Tensor] = field(default_factory=dict)   # name -> detached scalar
    state: dict[str, Tensor] = field(default_factory=dict)  # detached tensors for `after_step`


def check_positive(cfg: Any, *names: str) -> None:
    """The `> 0` rule of an objective `Config`'s temperatures (and other positive fields).

    Called from the Config's `__post_init__`; the message suggests the field's default.

    Args:
        cfg: a frozen objective Config dataclass instance.
        names: fields of `cfg` that must be > 0.

    Raises:
        ValueError: one line naming the first field that is not > 0 and its default.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise ValueError(f"objective.{name} must be > 0, got {value}; set objective.{name}={defaults[name]}")


class Objective(nn.Module):
    """Base of every objective (STYLE §2): its validated config, what it reads, its after-step hook.

    A subclass sets `Config` (the frozen dataclass that validates the `objective:` config section)
    and `needs`, and implements `forward(online, target, batch, s) -> LossOut`, which reads no
    state and changes none. State of its own (queues, centres) changes only in `after_step`.
    """

    Config: ClassVar[type]          # the objective's frozen Config dataclass
    needs: ViewNeeds                # what it reads from a Batch; an instance may refine it from cfg

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, online: nn.Module, target: nn.Module | None, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch` (target: None when `needs.target` is False)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def target_momentum(self, s: StepValues) -> float:
        """EMA momentum of the target at this step: the schedule's (`s.ema`, BYOL's cosine from
        `optim.ema_start` to `optim.ema_end`) unless the objective's paper fixes its own."""
        return s.ema

    def after_step(self, out: LossOut) -> None:
        """Update the objective's own state after the optimiser step; by default it has none (the
        EMA target is not objective state: the loop updates it)."""

    def describe(self, total_steps: int, steps_per_epoch: int) -> str | None:
        """A line the loop prints once at the start of a run (e.g. when a phase begins), or None."""
        return None

    @classmethod
    def resolve(cls, cfg: Any) -> Any:
        """The objective's config for the whole run config `cfg` (values it takes from the model or
        the data, checks that need them); by default `cfg.objective` unchanged.

        Raises:
            ValueError: a setup the objective refuses (one line naming the fix).
        """
        return cfg.objective


def online_and_target(online: nn.Module, target: nn.Module, online_views: list[Tensor],
                      target_views: list[Tensor]):
    """One resolution of views through the online model and, without gradient, the EMA target.

    Returns:
        (online ViewEmbeddings, target ViewEmbeddings) of `models.multicrop.SSLModel`.
    """
    (emb,) = online([online_views])
    with torch.no_grad():
        (tgt,) = target([target_views])
    return emb, tgt
