"""Bearer tokens for the local stacks: one per identity, each in its own file (mode 0600), and
the settings that make a service accept exactly the identities it is given.

    tokens = Tokens(work_dir / "tokens")
    registry_env = tokens.auth({"router": {"role": "router"}, "admin": {"role": "admin"}})
    tokens.file("router")   # the router's KVSHUTTLE_ROUTER_REGISTRY__TOKEN_FILE
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class Tokens:
    """A bearer token per identity, each in its own file (mode 0600), and the files a service
    needs to know who may call it."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        self._tokens: dict[str, str] = {}

    def token(self, identity: str) -> str:
        if identity not in self._tokens:
            self._tokens[identity] = secrets.token_urlsafe(24)
            path = self.file(identity)
            path.write_text(self._tokens[identity])
            path.chmod(0o600)
        return self._tokens[identity]

    def file(self, identity: str) -> Path:
        return self._dir / f"{identity}.token"

    def auth(self, grants: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        """AUTH__* settings of a service that accepts exactly these identities."""
        table = self._dir / f"accepts-{secrets.token_hex(4)}.json"
        table.write_text(json.dumps({identity: self.token(identity) for identity in grants}))
        table.chmod(0o600)
        return {"AUTH__IDENTITIES": json.dumps(grants), "AUTH__TOKENS_FILE": str(table)}
