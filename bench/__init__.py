"""Measurement, the top floor of the house: benches and reports that may import every package, and
that no package imports (tests/test_architecture.py)."""
