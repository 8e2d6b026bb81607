"""Reasoning parsers, one module per vLLM `--reasoning-parser` name."""
