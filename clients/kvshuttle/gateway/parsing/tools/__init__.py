"""Tool-call parsers, one module per vLLM `--tool-call-parser` name, and their JSON helpers."""
