"""What FFCV would compile in every process is compiled once per machine: numba's typed-dict helpers,
which FFCV's import compiles (after the first process, a process that fills a typed dict the way
`import ffcv` does loads them from numba's on-disk cache: `pipelines/jit.py`), and the FFCV loader's
per-batch code (`ffcv_decode.decode_rows` from the cache, nothing compiled for a further loader)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import ROOT

FILL = """
import json
from pipelines.jit import cache_typed_dict_helpers, caches
cache_typed_dict_helpers()
from numba import types
from numba.typed import Dict, typeddict
d = Dict.empty(key_type=types.unicode_type, value_type=types.int64)    # as ffcv.fields.rgb_image fills IMAGE_MODES
d["jpg"], d["raw"] = 0, 1
stats = typeddict._setitem.stats
print(json.dumps({"modes": dict(d), "hits": len(stats.cache_hits), "misses": len(stats.cache_misses),
                  "cached": caches(typeddict._setitem)}))
"""


def fill_in_a_new_process() -> dict:
    done = subprocess.run([sys.executable, "-c", FILL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_typed_dict_helpers_from_the_cache() -> None:
    first = fill_in_a_new_process()                  # compiles, or loads what an earlier run cached
    second = fill_in_a_new_process()
    assert first["modes"] == second["modes"] == {"jpg": 0, "raw": 1} and second["cached"]
    assert second["hits"] == 1 and second["misses"] == 0


LOADERS = """
import json, sys
from dataclasses import replace
from numba.core import dispatcher
from pipelines.loader import build_loader
from pipelines.spec import LoaderSpec
from pipelines.views import load_recipe
from pipelines.ffcv_decode import decode_rows

compiled = []
real = dispatcher.Dispatcher.compile
def counted(self, sig):
    compiled.append(self.py_func.__qualname__)
    return real(self, sig)
dispatcher.Dispatcher.compile = counted

spec = LoaderSpec(root=sys.argv[1], dataset="synthetic", split="train", recipe=load_recipe("byol", 32, 16),
                  batch_size=8, num_workers=1, seed=0)
first = next(iter(build_loader("ffcv", spec)))
before = len(compiled)
# Another recipe (staged views), rank, seed and split: a new FFCV pipeline of other shapes.
other = replace(spec, recipe=load_recipe("rsa", 32, 16), rank=1, world_size=2, seed=5, split="val")
batches = list(build_loader("ffcv", other))
print(json.dumps({"further": compiled[before:], "batches": len(batches), "views": list(batches[0].global_views.shape),
                  "hits": len(decode_rows.stats.cache_hits), "misses": len(decode_rows.stats.cache_misses)}))
"""


def loaders_in_a_new_process(root: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", LOADERS, str(root)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ffcv") is None, reason="ffcv not installed")
def test_ffcv_loaders_compile_nothing_per_loader_and_their_decoder_comes_from_the_cache(tiny_data_root) -> None:
    """A second FFCV loader of another recipe compiles nothing (FFCV compiled every loader's
    pipeline: 1.5-1.8 CPU-s each on 2 cores), and a new process loads the decode kernel from numba's cache."""
    loaders_in_a_new_process(tiny_data_root)            # compiles, or loads what an earlier run cached
    second = loaders_in_a_new_process(tiny_data_root)
    assert second["further"] == []
    assert second["batches"] == 2 and second["views"][1:] == [8, 3, 32, 32]     # 32 val images, 2 ranks, batch 8
    assert second["hits"] >= 1 and second["misses"] == 0
