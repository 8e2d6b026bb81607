"""The emulator's HTTP surface, the stand-in engine: a dev and test harness that speaks what
kvshuttle consumes of vLLM (HTTP, KV events, the KV side channel) without a model, over the engine
core (bench/emulator/core): the one fake of vLLM's API that the tests and the socket benches run
against (as processes, or in a test's own event loop, scripted)."""
