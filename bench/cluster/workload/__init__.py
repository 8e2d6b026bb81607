"""Session traces (model, JSONL), their converters (Mooncake, vLLM's multi-turn generator, a
synthetic agent loop) and the replay side (token ids per block, context cut, open-loop arrivals).
`python -m bench.cluster.workload --help`."""
