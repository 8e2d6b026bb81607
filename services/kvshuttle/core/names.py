"""Resource names (AIP-122 style) and their parsing.

    nodes/{node}
    tenants/{tenant}
    tenants/{tenant}/conversations/{conversation}
    tenants/{tenant}/conversations/{conversation}/retentions/{generation}

Ids are 1..max_id_length characters of [A-Za-z0-9._~:-], starting with a letter or digit:
conversation ids come from users' gateways (UUIDs, "conv_123"), so they are not lowercased.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_GENERATION, MAX_ID_LENGTH

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:-]*")


def check_id(value: str, field: str, *, max_length: int = MAX_ID_LENGTH) -> str:
    if not value:
        raise InvalidArgument(field, "required")
    if len(value) > max_length:
        raise InvalidArgument(field, f"longer than {max_length} characters")
    if not _ID.fullmatch(value):
        raise InvalidArgument(field, "must be letters, digits and ._~:- and start with a letter or digit")
    return value


@dataclass(frozen=True, slots=True)
class ConversationName:
    tenant: str
    conversation: str

    def __str__(self) -> str:
        return f"tenants/{self.tenant}/conversations/{self.conversation}"

    def retention(self, generation: int) -> str:
        return f"{self}/retentions/{generation}"


@dataclass(frozen=True, slots=True)
class RetentionName:
    conversation: ConversationName
    generation: int

    def __str__(self) -> str:
        return self.conversation.retention(self.generation)


def _split(name: str, field: str, max_length: int) -> list[str]:
    if not name:
        raise InvalidArgument(field, "required")
    # Five ids and their collection words, bounded so a huge string is rejected cheaply.
    if len(name) > 6 * (max_length + 16):
        raise InvalidArgument(field, "too long")
    return name.split("/")


def parse_node(name: str, field: str = "name", *, max_length: int = MAX_ID_LENGTH) -> str:
    """`nodes/{node}` -> node id."""
    parts = _split(name, field, max_length)
    if len(parts) != 2 or parts[0] != "nodes":
        raise InvalidArgument(field, "must be nodes/{node}")
    return check_id(parts[1], field, max_length=max_length)


def parse_tenant(name: str, field: str = "parent", *, max_length: int = MAX_ID_LENGTH) -> str:
    """`tenants/{tenant}` -> tenant id."""
    parts = _split(name, field, max_length)
    if len(parts) != 2 or parts[0] != "tenants":
        raise InvalidArgument(field, "must be tenants/{tenant}")
    return check_id(parts[1], field, max_length=max_length)


def parse_conversation(
    name: str, field: str = "name", *, max_length: int = MAX_ID_LENGTH
) -> ConversationName:
    parts = _split(name, field, max_length)
    if len(parts) != 4 or parts[0] != "tenants" or parts[2] != "conversations":
        raise InvalidArgument(field, "must be tenants/{tenant}/conversations/{conversation}")
    return ConversationName(
        check_id(parts[1], field, max_length=max_length), check_id(parts[3], field, max_length=max_length)
    )


def parse_retention(name: str, field: str = "name", *, max_length: int = MAX_ID_LENGTH) -> RetentionName:
    parts = _split(name, field, max_length)
    if len(parts) != 6 or parts[0] != "tenants" or parts[2] != "conversations" or parts[4] != "retentions":
        raise InvalidArgument(
            field, "must be tenants/{tenant}/conversations/{conversation}/retentions/{generation}"
        )
    generation = parts[5]
    # ASCII digits only (str.isdigit() also takes superscript, Arabic-Indic and fullwidth digits,
    # which int() then reads or refuses), canonical (no leading zero),
    # and a generation the registry can store (limits.MAX_GENERATION).
    if (
        not generation.isascii()
        or not generation.isdigit()
        or generation[0] == "0"
        or len(generation) > len(str(MAX_GENERATION))
        or int(generation) > MAX_GENERATION
    ):
        raise InvalidArgument(field, f"generation must be an integer in 1..{MAX_GENERATION}")
    conversation = ConversationName(
        check_id(parts[1], field, max_length=max_length), check_id(parts[3], field, max_length=max_length)
    )
    return RetentionName(conversation, int(generation))


def parse_tenant_or_conversation(
    name: str, field: str = "parent", *, max_length: int = MAX_ID_LENGTH
) -> tuple[str, str | None]:
    """`tenants/{t}` or `tenants/{t}/conversations/{c}` -> (tenant, conversation or None)."""
    parts = _split(name, field, max_length)
    if len(parts) == 2:
        return parse_tenant(name, field, max_length=max_length), None
    conv = parse_conversation(name, field, max_length=max_length)
    return conv.tenant, conv.conversation


def tenant_of(name: str) -> str | None:
    """The tenant a resource name starts with (tenants/{tenant}/...), without validating the rest;
    None for a name of another shape. For scoping a caller before its request is parsed: a
    malformed name is refused by the parse that follows."""
    parts = name.split("/", 2)
    return parts[1] if len(parts) >= 2 and parts[0] == "tenants" and parts[1] else None
