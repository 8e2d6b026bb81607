"""The local launchers' child processes: free ports to start them on, and stopping them.

A server that starts helpers of its own (vLLM: engine core and workers) runs in its own process
group (`start_new_session=True`); `stop_group` ends the whole group. A single process (a kvshuttle
service, `redis-server`) is ended with `stop_process` (SIGTERM) or `kill_process` (SIGKILL, a
crash). `die_with_parent` makes a child die with the thread that started it, so a crashed caller
leaves none running.

Used by deploy/local/vllm_engine.py, redis.py, stack.py, control_plane.py and bench/emulator/http/launcher.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, *, rng: random.Random | None = None) -> list[int]:
    """`count` distinct TCP ports that are free now, below the kernel's ephemeral range.

    Below the ephemeral range, no outgoing connection borrows the port between this check and
    vLLM's bind. Each port is bound on 0.0.0.0 without SO_REUSEADDR, which also fails while
    connections to an earlier listener linger in TIME_WAIT (vLLM's ZMQ side channel would then
    fail to bind: "Address already in use").
    """
    rng = rng or random.Random()
    low = 20000
    high = min(_ephemeral_range()[0], 65536) - 1
    ports: list[int] = []
    tries = 0
    while len(ports) < count:
        tries += 1
        if tries > 2000:
            raise RuntimeError(f"found only {len(ports)} free ports in {low}-{high}")
        port = rng.randint(low, high)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # a probe, closed at once
            except OSError:
                continue
        ports.append(port)
    return ports


def die_with_parent() -> None:
    """preexec_fn: SIGTERM the server when the thread that started it dies (Linux prctl)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a child's log (of its last 64 KiB), for an error message."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def kill_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL `proc` if it runs, as a crash or an OOM kill ends it, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(5)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> int | None:
    """SIGTERM `proc`, SIGKILL it after `timeout`; its exit code (None: never started)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def _group_members(pgid: int) -> list[int]:
    """Live pids in process group `pgid` (Linux /proc), zombies excluded."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def terminate_group(proc: subprocess.Popen[bytes]) -> None:
    """Send SIGTERM to the process group `proc` leads (non-blocking; see `stop_group`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> list[int]:
    """SIGTERM the process group `proc` leads, SIGKILL what is left after `timeout`, reap `proc`;
    returns once none is left, or with the pids that survived SIGKILL (for 10 s)."""
    pgid = proc.pid
    terminate_group(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader
        if not _group_members(pgid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 10
        while _group_members(pgid) and time.monotonic() < kill_deadline:
            proc.poll()
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return _group_members(pgid)
