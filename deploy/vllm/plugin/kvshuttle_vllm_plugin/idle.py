"""Decode's engine loop while it only holds retained KV.

With `bidirectional_kv_xfer`, a finished request whose blocks decode keeps for the next turn stays
in the scheduler until a reader notifies or the TTL passes, and vLLM keeps stepping the engine
meanwhile (about every millisecond) to poll for that. Each step goes to the worker process, so an
otherwise idle decode node holding retentions spins a whole core (measured on the CPU build: its
worker at 100 %, the engine core at 20 %): in multi-turn serving that is decode's normal state,
and here it starves everything else on the machine.

Two parts, both needed (measured):
- the engine: when a step computed nothing and no request is unfinished (only retained ones
  wait), it waits up to KVSHUTTLE_IDLE_STEP_MS (default 50) on its input queue before the next
  step. A new request ends the wait at once, as vLLM's own idle wait does; a read notification
  or a TTL expiry is seen at most that much later (decode frees the blocks a few ms later; a
  reader is never delayed). 0 turns it off.
- the worker: after each message from the engine, vLLM's shared-memory queue reader busy-loops
  for 1 s before it parks on its ZMQ notification, so steps every 50 ms still keep it spinning.
  KVSHUTTLE_WORKER_SPIN_MS (default 2) caps that busy loop: under load steps come every few
  ms and it still never parks; idle, it parks after 2 ms. 0 leaves vLLM's 1 s.
"""

from __future__ import annotations

import logging
import os
import queue
import types
from typing import Any, Final

from ._imports import when_imported

logger = logging.getLogger("vllm.kvshuttle_plugin")
IDLE_STEP_ENV: Final = "KVSHUTTLE_IDLE_STEP_MS"
WORKER_SPIN_ENV: Final = "KVSHUTTLE_WORKER_SPIN_MS"
PATCHED_ATTR: Final = "__kvshuttle_patched__"
status: dict[str, str] = {}


def idle_wait_s() -> float:
    value = float(os.environ.get(IDLE_STEP_ENV, "50"))
    if value < 0:
        raise ValueError(f"{IDLE_STEP_ENV} must be >= 0, not {value}")
    return value / 1000.0


def install() -> None:
    """Arrange the patch for when the engine core module loads. Never raises."""
    try:
        wait_s = idle_wait_s()
        if wait_s > 0:
            when_imported("vllm.v1.engine.core", lambda module: _patch(module, wait_s))
        else:
            status["idle_step"] = "off"
        spin_s = float(os.environ.get(WORKER_SPIN_ENV, "2")) / 1000.0
        if spin_s > 0:
            when_imported(
                "vllm.distributed.device_communicators.shm_broadcast",
                lambda module: _cap_spin(module, spin_s),
            )
    except Exception:
        logger.exception("kvshuttle plugin: idle-step throttle not installed")


def _patch(module: types.ModuleType, wait_s: float) -> None:
    try:
        cls = getattr(module, "EngineCoreProc", None)
        original = getattr(cls, "_process_engine_step", None)
        if cls is None or original is None or not hasattr(cls, "_handle_client_request"):
            status["idle_step"] = "unsupported: no EngineCoreProc._process_engine_step"
            logger.warning("kvshuttle plugin: %s", status["idle_step"])
            return
        if getattr(original, PATCHED_ATTR, False):
            return

        def _process_engine_step(self: Any) -> bool:
            executed: bool = original(self)
            scheduler = self.scheduler
            if executed or scheduler.has_unfinished_requests() or not scheduler.has_requests():
                return executed
            try:  # only retained requests wait: sleep until new work, or wait_s
                request = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                return executed
            self._handle_client_request(*request)
            return executed

        setattr(_process_engine_step, PATCHED_ATTR, True)
        cls._process_engine_step = _process_engine_step
        status["idle_step"] = f"on: {wait_s * 1000:g} ms"
        logger.info("kvshuttle plugin: idle decode steps wait up to %g ms for new work", wait_s * 1000)
    except Exception:
        status["idle_step"] = "failed"
        logger.exception("kvshuttle plugin: idle-step throttle not installed")


def _cap_spin(module: types.ModuleType, spin_s: float) -> None:
    try:
        cls = getattr(module, "SpinCondition", None)
        original = getattr(cls, "__init__", None)
        if cls is None or original is None:
            status["worker_spin"] = "unsupported: no SpinCondition"
            logger.warning("kvshuttle plugin: %s", status["worker_spin"])
            return
        if getattr(original, PATCHED_ATTR, False):
            return

        def capped_init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > spin_s:
                self.busy_loop_s = spin_s

        setattr(capped_init, PATCHED_ATTR, True)
        cls.__init__ = capped_init
        status["worker_spin"] = f"on: {spin_s * 1000:g} ms"
    except Exception:
        status["worker_spin"] = "failed"
        logger.exception("kvshuttle plugin: worker spin cap not installed")
