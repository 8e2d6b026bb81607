"""The emulator: vLLM 0.32 engines (NixlConnector `kv_both` with bidirectional transfer, the
OffloadingConnector's CPU tier) without a model, for tests, load and scale. Not shipped: the
shipped vLLM side is deploy/vllm/plugin.

* `core/`: one engine, transport-free: the KV block pool with vLLM's prefix cache, holdings and
  host tier (pool.py), the step scheduler timed by an engine profile (scheduler.py, timing.py),
  links with contention (link.py), and the request rules both surfaces share (engine.py).
* `http/`: the core behind vLLM's HTTP and KV-event surface (the "stand-in": engine.py), on real
  sockets, as processes or in a test's event loop, scripted; what kvshuttle's tests and the
  socket benches (bench/cluster, bench/load) run against.
* `fleet/`: the core on a virtual clock (vtime.py), many engines and their KV-event and load
  visibility as one fleet (fleet.py): what the fleet simulator (bench/fleet) runs.
"""
