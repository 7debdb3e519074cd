"""CIFAR-10 / CIFAR-100 sources: the official "python version" pickle batches.

CIFAR-10 (`cifar-10-batches-py/`): data_batch_1..5 (train), test_batch (val), batches.meta.
CIFAR-100 (`cifar-100-python/`): train, test, meta (fine labels are used).
`src` may be that folder or the folder that contains it. Pickles are read with an unpickler that
only admits the numpy array constructors, so a hostile file cannot run code.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from preprocess.records import ArraySplit

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
_LAYOUT = {
    "cifar10": dict(folder="cifar-10-batches-py", train=[f"data_batch_{i}" for i in range(1, 6)],
                    val=["test_batch"], meta="batches.meta", label_key=b"labels",
                    names_key=b"label_names", num_classes=10),
    "cifar100": dict(folder="cifar-100-python", train=["train"], val=["test"], meta="meta",
                     label_key=b"fine_labels", names_key=b"fine_label_names", num_classes=100),
}
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar")}


class CifarError(ValueError):
    """A missing or malformed CIFAR batch (one-line message naming the file and the fix)."""


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def find_cifar_dir(dataset: str, src: Path) -> Path:
    """The folder holding the batches: `src` itself or `src/<official folder name>`."""
    folder = _LAYOUT[dataset]["folder"]
    if (src / folder).is_dir():
        return src / folder
    return src


def _load(path: Path, dataset: str) -> dict:
    fix = f"re-extract the official python-version archive from {CIFAR_URL} into --src"
    if not path.is_file():
        raise CifarError(f"{dataset}: batch {path.name} is missing in {path.parent}: {fix}")
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 — any unpickling failure means a malformed batch
        raise CifarError(f"{dataset}: batch {path} is not a readable CIFAR pickle "
                         f"({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(obj, dict):
        raise CifarError(f"{dataset}: batch {path} holds a {type(obj).__name__}, not a dict: {fix}")
    return obj


def load_cifar(dataset: str, src: Path) -> tuple[dict[str, ArraySplit], list[str]]:
    """Read and validate all batches of `dataset` ("cifar10" | "cifar100").

    Returns:
        ({"train": ArraySplit, "val": ArraySplit}, class_names). Images are (N, 32, 32, 3) uint8.

    Raises:
        CifarError: a missing batch, a batch that does not unpickle, wrong keys, shapes (N, 3072)
            uint8, label count or a label out of range.
    """
    lay = _LAYOUT[dataset]
    root = find_cifar_dir(dataset, src)
    fix = f"re-extract the official python-version archive from {CIFAR_URL} into --src"
    meta = _load(root / lay["meta"], dataset)
    names = meta.get(lay["names_key"])
    if not isinstance(names, list) or len(names) != lay["num_classes"]:
        raise CifarError(f"{dataset}: {root / lay['meta']} lacks {lay['num_classes']} "
                         f"{lay['names_key'].decode()}: {fix}")
    class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    splits = {}
    for split in ("train", "val"):
        images, labels = [], []
        for name in lay[split]:
            batch = _load(root / name, dataset)
            data, lab = batch.get(b"data"), batch.get(lay["label_key"])
            if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
                    or data.shape[1] != 3072:
                shape = getattr(data, "shape", None)
                raise CifarError(f"{dataset}: batch {name} has data {getattr(data, 'dtype', type(data))} "
                                 f"{shape}, expected (N, 3072) uint8: {fix}")
            if lab is None or len(lab) != len(data):
                raise CifarError(f"{dataset}: batch {name} has {0 if lab is None else len(lab)} labels for "
                                 f"{len(data)} images: {fix}")
            lab = np.asarray(lab, dtype=np.int64)
            if lab.size and (lab.min() < 0 or lab.max() >= lay["num_classes"]):
                raise CifarError(f"{dataset}: batch {name} has labels outside [0, {lay['num_classes']}): {fix}")
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))   # (N, 32, 32, 3)
            labels.append(lab)
        splits[split] = ArraySplit(np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels))
    return splits, class_names
