"""numba's typed-dict helpers, which FFCV's import compiles, are compiled once per machine: after the
first process, a process that fills a typed dict the way `import ffcv` does loads them from numba's
on-disk cache instead of compiling them (`pipelines/jit.py`)."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_a_second_process_loads_the_typed_dict_helpers_from_the_cache() -> None:
    first = fill_in_a_new_process()                  # compiles, or loads what an earlier run cached
    second = fill_in_a_new_process()
    assert first["modes"] == second["modes"] == {"jpg": 0, "raw": 1} and second["cached"]
    assert second["hits"] == 1 and second["misses"] == 0
