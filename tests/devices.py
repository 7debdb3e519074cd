"""The devices a DALI graph runs on in tests: the CPU graph everywhere, the GPU graph (nvJPEG `mixed`
decode, GPU ops) as `gpu`-marked cases that run where torch sees a CUDA device."""

from __future__ import annotations

from typing import Iterable, Iterator

import pytest

from pipelines.batch import Batch

DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def on_host(batches: Iterable[Batch], device: str) -> Iterator[Batch]:
    """The batches on the host, after checking that every tensor landed on `device`."""
    for b in batches:
        for name, x in vars(b).items():
            if x is not None:
                assert x.device.type == device, f"{name} on {x.device}, expected {device}"
        yield b.to("cpu")


class OnHost:
    """A loader whose batches are checked to be on `device` and handed over on the host; everything
    else (len, state_dict, set_epoch, last_debug, ...) is the loader's own."""

    def __init__(self, loader, device: str) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[Batch]:
        return on_host(self.loader, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)
