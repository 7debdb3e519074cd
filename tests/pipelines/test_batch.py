"""`ReusedBuffers`: a buffer is written again only when no tensor made from it is alive."""

from __future__ import annotations

import torch

from pipelines.batch import ReusedBuffers


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
