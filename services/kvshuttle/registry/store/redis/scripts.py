"""The Lua scripts of the Redis store (kvshuttle.registry.store.redis.store), one per atomic step, each
read at import from its file in lua/ (lua/<name>.lua), after the library in lua/lib/ whose functions it
calls. A file's leading `--` lines document its KEYS, ARGV and reply and are not sent, so a script's
body (and its SHA) is exactly the library's code followed by the script's.

Every script touches the keys of ONE hash slot only: a conversation's (its record and its
idempotency entries), a node's (its record, its held and lost sets), a tenant's (its name
index, its find_retention indexes) or the store's global slot (deadline sets, node directory,
counters). Times and expiries arrive as strings from Python (repr of a float) and are stored
as given: Lua only compares them (tonumber), never computes a time, so no precision is lost.
Generations (< 2**63, beyond a double's exact range) are compared as decimal strings.

Replies: {'ok', ...}, {'err', REASON, detail...}, or a step-specific tag.
"""

from __future__ import annotations

from pathlib import Path

_LUA = Path(__file__).with_name("lua")

# The library each script runs after (its functions are the script's to call), None for none.
_LIBRARY: dict[str, str | None] = {
    "put": "retention",
    "renew": "retention",
    "claim": "retention",
    "release": "retention",
    "move": "retention",
    "evict": "retention",
    "drop_if": "retention",
    "expire_retention": "retention",
    "forget_fence": None,
    "register_node": "node",
    "heartbeat_node": "node",
    "remove_node": "node",
    "attach": None,
    "holds": None,
    "hold": None,
    "detach": None,
    "hint": "counted",
    "due": None,
    "reschedule": "counted",
    "drop": "counted",
    "reserve_node": None,
    "unindex_node": None,
    "next_incarnation": None,
    "linger": None,
    "unlinger": None,
    "later": None,
    "reserve": "counted",
    "unreserve": "counted",
    "remember": None,
    "index": None,
    "unindex": None,
}


def _code(path: Path) -> str:
    """The file's code: everything after its leading `--` comment lines, from the newline that
    ends the last of them."""
    lines = path.read_text().split("\n")
    start = 0
    while start < len(lines) and lines[start].startswith("--"):
        start += 1
    return "\n".join(lines[start:])


def _load() -> dict[str, str]:
    libraries = {path.stem: _code(path) for path in (_LUA / "lib").glob("*.lua")}
    return {
        name: (libraries[lib] if lib else "") + _code(_LUA / f"{name}.lua") for name, lib in _LIBRARY.items()
    }


# The scripts by name, as registered (kvshuttle.registry.store.redis.shared).
SCRIPTS: dict[str, str] = _load()
