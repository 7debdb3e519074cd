"""How every command ends on bad input, in one place: one line `error: <what is wrong and the fix>` on
stderr and exit status 2 (`EXIT_BAD_INPUT`), before anything is written.

The exception types stay where their rules live (`schema.DatasetError`, `spec.LoaderError`,
`processes.LimitError`, `train.config.ConfigError`, `preprocess.sources.PreprocessError`, ...); each
command's entry point catches its own and reports them with `bad_input`, so that `python -m preprocess`,
`python -m train`, the saliency stage, the benches and `viewmill` read and exit alike.
"""

from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2


def bad_input(error: BaseException | str) -> int:
    """Print `error` as the one line `error: ...` on stderr (its first line, or the exception's type
    where it has no message) and return `EXIT_BAD_INPUT`."""
    text = str(error).strip()
    print(f"error: {text.splitlines()[0] if text else type(error).__name__}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT
