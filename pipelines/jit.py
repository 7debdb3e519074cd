"""numba as FFCV's import uses it: the typed-dict helpers compiled once per machine, not per process.

`import ffcv` fills a numba typed dict (`ffcv.fields.rgb_image.IMAGE_MODES`), and numba compiles the
dict's helpers (`numba.typed.typeddict._setitem`, ...) in every process that imports it: 2.4 of the
3.9 s `import ffcv` took on 2 cores, paid by every `make preprocess`, every FFCV loader's process and
every saliency run. `cache_typed_dict_helpers` recompiles them with numba's on-disk cache (the same
cache `pipelines.ffcv_ops`' kernels use), so that each process loads them: `import ffcv` 1.5 s.
The writers (`preprocess.write_ffcv`) and the loader dispatcher (`pipelines.loader`) call it before
they import FFCV.
"""

from __future__ import annotations

# The module-level @njit helpers of numba.typed.typeddict (numba 0.68) that Dict's methods call.
_TYPED_DICT_HELPERS = ("_make_dict", "_length", "_setitem", "_getitem", "_delitem", "_contains", "_get",
                       "_setdefault", "_iter", "_popitem", "_copy")


def cache_typed_dict_helpers() -> None:
    """Give numba's typed-dict helpers its on-disk cache (idempotent; a helper numba no longer has, or
    has already cached, is left as it is). Call before importing FFCV."""
    import numba
    from numba.typed import typeddict

    for name in _TYPED_DICT_HELPERS:
        helper = getattr(typeddict, name, None)
        if not caches(helper) and hasattr(helper, "py_func"):
            setattr(typeddict, name, numba.njit(cache=True)(helper.py_func))


def caches(dispatcher) -> bool:
    """Whether a numba dispatcher keeps its compiled code in numba's on-disk cache."""
    from numba.core.caching import NullCache

    return getattr(dispatcher, "_cache", None) is not None and not isinstance(dispatcher._cache, NullCache)
