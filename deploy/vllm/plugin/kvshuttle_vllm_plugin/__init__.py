"""kvshuttle's vLLM plugin (entry-point group `vllm.general_plugins`).

vLLM calls `register()` in every process it starts (API server, engine core, workers) while it
parses its arguments. Nothing is imported then; each fix patches its target when vLLM imports it.

- `stream.py`: backports upstream 0.33's streamed `kv_transfer_params`: a streamed
  `/v1/completions` or `/v1/chat/completions` answer carries them on the chunk with
  `finish_reason`, as the non-streamed answer always did. Off: `KVSHUTTLE_STREAM_KV_PARAMS=0`.
- `nixl_cpu.py`: NixlConnector on the CPU build: keep each worker on its own core (off:
  `KVSHUTTLE_NIXL_KEEP_CORE=0`), and, when `KVSHUTTLE_NIXL_PTHR_DELAY_US` is set, let NIXL's
  progress thread sleep instead of spinning a core.
- `idle.py`: a decode node that only holds retained KV waits for new work between engine steps
  instead of stepping every millisecond (which spins its worker's core). Off:
  `KVSHUTTLE_IDLE_STEP_MS=0`.
"""

from __future__ import annotations

from . import idle, nixl_cpu, stream

__all__ = ["register"]


def register() -> None:
    """The entry point vLLM calls; never raises (a broken plugin must not stop the server)."""
    stream.install()
    nixl_cpu.install()
    idle.install()
