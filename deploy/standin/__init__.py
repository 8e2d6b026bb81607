"""The stand-in engine: a dev and test harness that speaks what kvshuttle consumes of vLLM (HTTP,
KV events, the KV side channel) without a model. Not shipped; the shipped vLLM side is
deploy/vllm/plugin."""
