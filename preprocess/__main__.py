"""`python -m preprocess`: write a dataset as FFCV + DALI files with a manifest.

    python -m preprocess --dataset synthetic --out data
    python -m preprocess --dataset cifar10 --src ~/cifar-10-batches-py
    python -m preprocess --dataset imagefolder --src /data/imagenet --name imagenet100 --class-list in100.txt
    python -m preprocess --dataset imagefolder --src /shared/imagenet --out /shared/data --engine ray

Errors are one line on stderr with exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.errors import bad_input
from pipelines.processes import process_age_s
from pipelines.schema import DatasetError
from preprocess.prepare import ENGINES, SHARD_SIZE, command_seconds, prepare_dataset, summary
from preprocess.sources import SOURCES, Param


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:         # one line, exit code 2 (argparse prints usage too)
        sys.exit(bad_input(message))


def _add_option(group: argparse._ArgumentGroup, param: Param) -> None:
    if param.type is bool:
        group.add_argument(param.flag, action="store_true", help=param.help)
    else:
        group.add_argument(param.flag, type=param.type, default=param.default, choices=param.choices,
                           help=param.help)


def parse_args(argv: list[str] | None, prog: str = "python -m preprocess") -> argparse.Namespace:
    """The command line; see the module docstring."""
    p = _Parser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic", help=f"one of {', '.join(SOURCES)} (default synthetic)")
    p.add_argument("--src", type=Path, help="source: CIFAR batches, SRC/train|val/<class>/, any folder of images "
                   "or a file listing image paths")
    p.add_argument("--out", type=Path, default=Path("data"), help="data root (default data)")
    p.add_argument("--name", help="dataset folder name under --out (default: the dataset)")
    p.add_argument("--force", action="store_true",
                   help="rewrite a complete dataset; start an interrupted image folder over (default: resume)")
    p.add_argument("--workers", type=int, help="parallel processes (default: all cores)")
    p.add_argument("--shard-size", type=int, default=SHARD_SIZE, help="records per DALI shard")
    p.add_argument("--engine", default="local", choices=ENGINES,
                   help="image folders: local processes (default) or Ray Data (RAY_ADDRESS: a cluster)")
    for source in SOURCES.values():
        if source.params:
            g = p.add_argument_group(source.name)
            for param in source.params:
                _add_option(g, param)
    return p.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "python -m preprocess") -> int:
    """Run the CLI (`prog`: its name in the usage); returns the exit code (0 ok, 2 bad input or failed write)."""
    a = parse_args(argv, prog)
    source = SOURCES.get(a.dataset)
    if source is None:
        return bad_input(f"unknown dataset {a.dataset!r}; choose one of {', '.join(SOURCES)}")
    params = {param.name: getattr(a, param.name) for param in source.params}
    started = process_age_s()              # this process's start-up and imports, up to here
    try:
        path = prepare_dataset(a.dataset, a.out, src=a.src, force=a.force, workers=a.workers,
                               progress=True, name=a.name, shard_size=a.shard_size, engine=a.engine, **params)
        ended = process_age_s()
        print(summary(path))
        if started is not None and ended is not None and (line := command_seconds(path, started, ended)):
            print(line)
    except (ValueError, DatasetError, OSError) as e:
        return bad_input(e)
    except KeyboardInterrupt:
        print("preprocess: interrupted; the same command resumes an image folder (other datasets start over)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
