"""Objectives by name: the trainer looks them up here, nowhere else (STYLE §2)."""

from __future__ import annotations

from train.objectives.base import Objective
from train.objectives.byol import BYOL
from train.objectives.dacl import DACL
from train.objectives.mocov3 import MoCoV3
from train.objectives.relicv2 import ReLICv2
from train.objectives.rsa import RSA
from train.objectives.sdmp import SDMP
from train.objectives.simclr import SimCLR
from train.objectives.uota import UOTA

OBJECTIVES: dict[str, type[Objective]] = {
    "byol": BYOL,
    "dacl": DACL,
    "mocov3": MoCoV3,
    "relicv2": ReLICv2,
    "rsa": RSA,
    "sdmp": SDMP,
    "simclr": SimCLR,
    "uota": UOTA,
}
