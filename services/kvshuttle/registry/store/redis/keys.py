"""The Redis store's key layout (kvshuttle.registry.store.redis.store: its docstring lists each key and
what it holds): the names of the global slot's keys and of each conversation's, node's and tenant's."""

from __future__ import annotations


class RedisKeys:
    """Every key name of one store, under `prefix` (non-empty, without braces: the braces are
    Redis Cluster hash tags)."""

    def __init__(self, prefix: str) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError("the key prefix must be non-empty and without braces")
        self.prefix = prefix
        g = f"{{{prefix}}}"
        self.nodes = f"{g}:nodes"
        self.ndl, self.nver = f"{g}:ndl", f"{g}:nver"
        self.rdl, self.rver = f"{g}:rdl", f"{g}:rver"
        self.idem, self.isz = f"{g}:idem", f"{g}:isz"
        self.fdl, self.fsz = f"{g}:fdl", f"{g}:fsz"
        self.claimed, self.meta = f"{g}:claimed", f"{g}:meta"
        # Transcript bytes reserved per retention name and per tenant (their sum in `meta` "tb").
        self.txsz, self.txt = f"{g}:txsz", f"{g}:txt"
        # The retention deadline set with its versions, per-tenant member counts, members
        # reserved past a limit and the transcript bytes its members hold: the keys of every
        # script that adds or removes one of its members (kvshuttle.registry.store.redis.bounds).
        self.retention_deadlines = [
            self.rdl,
            self.rver,
            f"{g}:rcount",
            f"{g}:rover",
            self.txsz,
            self.txt,
            self.meta,
        ]

    def conversation(self, conversation: str) -> str:
        return f"{self.prefix}:{{{conversation}}}"

    def idempotency(self, conversation: str, op: str, target: str, request_id: str) -> str:
        return f"{self.prefix}:{{{conversation}}}:i:{op}:{target}:{request_id}"

    def node(self, node: str) -> list[str]:
        """The node's record, its held retentions and its lost ones (one slot)."""
        base = f"{self.prefix}:{{{node}}}"
        return [base, f"{base}:held", f"{base}:lost"]

    def tenant(self, tenant: str) -> str:
        return f"{self.prefix}:{{tenants/{tenant}}}:names"

    def lookup(self, tenant: str) -> list[str]:
        """The tenant's find_retention indexes (its names' slot): chain ends (model, block size,
        last hash -> retention name) and transcript keys (model, key -> retention name)."""
        base = f"{self.prefix}:{{tenants/{tenant}}}"
        return [f"{base}:ends", f"{base}:tx"]
