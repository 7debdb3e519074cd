"""Fixtures of the training tests: the 2-process reference run (`tests/train/two_ranks.py`)."""

from tests.train.two_ranks import two_processes  # noqa: F401  (a fixture, registered by this import)
