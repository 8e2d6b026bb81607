"""Cluster-scale benchmark: workloads (session traces, converters, replay) for an emulator of
vLLM engines and routing policies compared side by side. See README.md."""
