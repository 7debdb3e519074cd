"""The `viewmill` command: one entry point for what the Makefile does (`viewmill.cli`)."""
