"""`ReusedBuffers`: a buffer is written again only when no tensor made from it is alive; `Batch.to`
copies to the host blocking (the gpu tests compare finished data) and to a GPU without blocking."""

from __future__ import annotations

import pytest
import torch

from pipelines.batch import Batch, ReusedBuffers


@pytest.mark.parametrize("device, blocking", [("cpu", True), ("cuda", False), ("cuda:1", False)])
def test_copies_to_the_host_block_and_copies_to_a_gpu_do_not(monkeypatch, device: str, blocking: bool) -> None:
    calls = []

    def spy(self, dev, non_blocking=False):                   # records the copy instead of making it
        calls.append((str(dev), non_blocking))
        return self

    b = Batch(global_views=torch.zeros(2, 4, 3, 8, 8), local_views=None, weak_views=None, mixed=None,
              mix_lam=None, mix_partner=None, index=torch.arange(4), label=torch.zeros(4, dtype=torch.long))
    monkeypatch.setattr(torch.Tensor, "to", spy)
    b.to(device)
    assert calls == [(device, not blocking)] * 3               # global_views, index, label


def test_buffer_comes_back_only_after_every_tensor_on_it_is_gone() -> None:
    pool = ReusedBuffers(keep=2)
    a = pool.take((2, 3))
    a.fill_(1.0)
    row = a[1].view(3)                          # a view outlives the tensor it was cut from
    del a
    b = pool.take((2, 3))
    assert b.data_ptr() != row.data_ptr() - 3 * 4 and pool.made == 2
    b.fill_(2.0)
    assert torch.equal(row, torch.ones(3))      # never overwritten while the view lives
    first = row.data_ptr() - 3 * 4
    del row
    c = pool.take((2, 3))
    assert c.data_ptr() == first and pool.made == 2       # reused, nothing new allocated
    d = pool.take((2, 3))                        # b and c alive: a third buffer, not kept
    assert pool.made == 3 and d.data_ptr() not in (first, b.data_ptr())
    assert pool.take((4,)).shape == (4,) and pool.made == 4     # shapes never share a buffer


def test_normalize_makes_its_statistics_once_per_device_and_keeps_the_formula() -> None:
    """(x/255 - mean)/std for uint8 and (x - mean)/std for [0, 1] floats, the layout kept (a channels-last
    view stays one); the statistics are made once per device and dtype, not per batch: on a GPU each new
    tensor from host values would be a copy that waits for the device's stream."""
    from pipelines import batch as batch_mod

    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    x = torch.randint(0, 256, (2, 4, 8, 8, 3), dtype=torch.uint8).permute(0, 1, 4, 2, 3)   # channels-last views
    want = (x.double() / 255 - torch.tensor(mean, dtype=torch.double).view(3, 1, 1)) \
        / torch.tensor(std, dtype=torch.double).view(3, 1, 1)
    batch_mod._statistics.cache_clear()
    for _ in range(3):
        got = batch_mod.normalize(x, mean, std)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-6)
        assert got[0].is_contiguous(memory_format=torch.channels_last)
        assert torch.allclose(batch_mod.normalize(x.float() / 255, mean, std), got, atol=1e-6)
    assert batch_mod._statistics.cache_info().misses == 1
