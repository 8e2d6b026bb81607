"""The checks of the fields several of the Registry's requests carry (kvshuttle.registry.service.registry):
ids, node names, bounded strings, and page sizes and tokens."""

from __future__ import annotations

import base64
import binascii
import json

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.names import check_id, parse_node
from kvshuttle.registry.limits import RegistryLimits


class FieldChecks:
    """Each check raises InvalidArgument naming the request field, or returns the value."""

    def __init__(self, limits: RegistryLimits) -> None:
        self._limits = limits

    def id(self, value: str, field_name: str) -> str:
        return check_id(value, field_name, max_length=self._limits.max_id_length)

    def node_name(self, name: str, field_name: str) -> str:
        parse_node(name, field_name, max_length=self._limits.max_id_length)
        return name

    def bounded(self, value: str, field_name: str, *, required: bool = True) -> str:
        if required and not value:
            raise InvalidArgument(field_name, "required")
        if len(value) > self._limits.max_endpoint_length:
            raise InvalidArgument(field_name, f"longer than {self._limits.max_endpoint_length} characters")
        return value

    def page(self, page_size: int, page_token: str, scope: str) -> tuple[int, str]:
        """The page's size and the name it starts after."""
        if page_size < 0:
            raise InvalidArgument("page_size", "must not be negative")
        size = min(page_size or self._limits.default_page_size, self._limits.max_page_size)
        if not page_token:
            return size, ""
        try:
            token_scope, after = json.loads(base64.urlsafe_b64decode(page_token.encode()))
        except (ValueError, TypeError, binascii.Error) as exc:
            raise InvalidArgument("page_token", "malformed") from exc
        if token_scope != scope or not isinstance(after, str):
            raise InvalidArgument("page_token", "belongs to another listing")
        return size, after

    @staticmethod
    def next_token(scope: str, names: list[str], size: int) -> str:
        if len(names) < size:
            return ""
        return base64.urlsafe_b64encode(json.dumps([scope, names[-1]]).encode()).decode()
