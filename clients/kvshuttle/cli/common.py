"""Argument parsing shared by the CLI's commands."""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

from kvshuttle.cli.output import Printer
from kvshuttle.client import RegistryClient

Command: TypeAlias = Callable[[RegistryClient, argparse.Namespace, Printer], Awaitable[int]]
"""A subcommand: runs with a connected client, writes through the printer, returns the exit status."""

UINT32_MAX = 2**32 - 1
RANDOM_TOKEN_VOCAB = 32_000


class UsageError(Exception):
    """The arguments make no sense together; the CLI prints usage and exits 2."""


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given inline, or as @FILE."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def parse_token_ids(text: str) -> list[int]:
    """Token ids as a JSON list or separated by commas and/or whitespace."""
    text = text.strip()
    try:
        raw: list[Any] = (
            json.loads(text) if text.startswith("[") else [t for t in re.split(r"[,\s]+", text) if t]
        )
        tokens = [int(t) for t in raw if t != ""]
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError("token ids must be integers, e.g. 1,2,3 or [1, 2, 3]") from None
    if any(not 0 <= t <= UINT32_MAX for t in tokens):
        raise argparse.ArgumentTypeError("token ids must be within 0..2^32-1")
    return tokens


def tokens_file(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    return parse_token_ids(text)


def add_token_options(parser: argparse.ArgumentParser) -> None:
    """One required source of token ids: --token-ids, --tokens-file or --random-tokens [--seed]."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--token-ids", metavar="IDS", type=parse_token_ids, help="e.g. 1,2,3 or '[1, 2, 3]'")
    source.add_argument(
        "--tokens-file", metavar="FILE", type=tokens_file, help="token ids in a file, same syntax"
    )
    source.add_argument("--random-tokens", metavar="N", type=non_negative_int, help="N random token ids")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random-tokens (default: 0)")


def token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        return list(args.token_ids)
    if args.tokens_file is not None:
        return list(args.tokens_file)
    rng = random.Random(args.seed)
    return [rng.randrange(1, RANDOM_TOKEN_VOCAB) for _ in range(args.random_tokens)]


def node_name(text: str) -> str:
    """`nodes/{node}` from "x" or "nodes/x"."""
    return text if text.startswith("nodes/") else f"nodes/{text}"


NODE_NAME = re.compile(r"nodes/[^/]+")
CONVERSATION_NAME = re.compile(r"tenants/[^/]+/conversations/[^/]+")
RETENTION_NAME = re.compile(r"tenants/[^/]+/conversations/[^/]+/retentions/[^/]+")
