"""The stand-in engine: a dev and test harness that speaks what kvshuttle consumes of vLLM (HTTP,
KV events, the KV side channel) without a model: the one fake of vLLM's API that the tests and the
benches run against (as processes, or in a test's own event loop, scripted). Not shipped; the
shipped vLLM side is deploy/vllm/plugin."""
