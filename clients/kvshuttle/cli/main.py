"""`kvshuttle`: the command line of the kvshuttle control plane.

    kvshuttle [--registry ADDR] [--timeout S] [--json] [--tls --ca F --cert F --key F] registry COMMAND ...
    kvshuttle [...] agent status [--agent ADDR]
    kvshuttle [...] status [--gateway-metrics HOST:PORT] [--tenant T] [--last N]

Global options may also follow the command (`kvshuttle registry nodes --json`). Exit status:
0 on success, 1 when an RPC fails (one line `error: ...` on stderr, no traceback), 2 for usage
errors, 130 on Ctrl-C. The CLI parses arguments and formats results; every RPC goes through
kvshuttle.client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import Coroutine, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn, TextIO

import grpc

from kvshuttle.cli import agent_commands, registry_commands, status_command
from kvshuttle.cli.common import Command, UsageError, positive_float
from kvshuttle.cli.output import Printer
from kvshuttle.client import AgentClient, ChannelOptions, KvshuttleRpcError, RegistryClient

__all__ = ["DEFAULT_REGISTRY", "REGISTRY_ENV", "main", "run"]

REGISTRY_ENV = "KVSHUTTLE_REGISTRY_ADDR"
TOKEN_FILE_ENV = "KVSHUTTLE_TOKEN_FILE"
DEFAULT_REGISTRY = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 5.0

_STREAMS: ContextVar[tuple[TextIO, TextIO]] = ContextVar("kvshuttle_cli_streams")


class _ParserExitError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse writing to the streams `run` was given, and raising instead of exiting."""

    def print_usage(self, file: Any = None) -> None:
        (file or _STREAMS.get()[0]).write(self.format_usage())

    def print_help(self, file: Any = None) -> None:
        (file or _STREAMS.get()[0]).write(self.format_help())

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise _ParserExitError(status, message or "")

    def error(self, message: str) -> NoReturn:
        raise _ParserExitError(2, f"{self.format_usage()}{self.prog}: error: {message}\n")


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"--token-file: {exc}") from exc


def _add_global_options(
    parser: argparse.ArgumentParser, registry: str | None, token_file: str | None = None
) -> None:
    """The options every command takes. With `registry` None every default is SUPPRESS: the copy
    that each command's parser gets, so an option given after the command overrides the
    top-level one without the command's defaults clobbering it."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if registry is None else value

    group = parser.add_argument_group("global options")
    group.add_argument(
        "--registry",
        metavar="ADDR",
        default=default(registry),
        help=f"registry host:port (default: ${REGISTRY_ENV} or {DEFAULT_REGISTRY})",
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=positive_float,
        default=default(DEFAULT_TIMEOUT),
        help=f"deadline of each call, retries included (default: {DEFAULT_TIMEOUT})",
    )
    group.add_argument("--json", action="store_true", default=default(False), help="JSON output")
    group.add_argument("--tls", action="store_true", default=default(False), help="connect with TLS")
    group.add_argument(
        "--tls-ca",
        "--ca",
        dest="ca",
        metavar="FILE",
        default=default(None),
        help="PEM CA bundle (implies --tls)",
    )
    group.add_argument(
        "--tls-cert",
        "--cert",
        dest="cert",
        metavar="FILE",
        default=default(None),
        help="PEM client certificate (mTLS)",
    )
    group.add_argument(
        "--tls-key", "--key", dest="key", metavar="FILE", default=default(None), help="PEM client key (mTLS)"
    )
    group.add_argument(
        "--token-file",
        metavar="FILE",
        default=default(token_file),
        help=f"file holding this caller's bearer token (default: ${TOKEN_FILE_ENV})",
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        default=default(None),
        help="name to verify the server as",
    )


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="kvshuttle", description="Inspect and drive a kvshuttle control plane.")
    _add_global_options(
        parser, environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY, environ.get(TOKEN_FILE_ENV) or None
    )
    leaf_options = _Parser(add_help=False)
    _add_global_options(leaf_options, None)
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    registry_commands.add_commands(groups, parents=[leaf_options])
    agent_commands.add_commands(
        groups,
        parents=[leaf_options],
        agent=environ.get(agent_commands.AGENT_ENV) or agent_commands.DEFAULT_AGENT,
    )
    status_command.add_command(
        groups, parents=[leaf_options], gateway_metrics=environ.get(status_command.GATEWAY_METRICS_ENV)
    )
    return parser


def _channel_options(args: argparse.Namespace, target: str) -> ChannelOptions:
    try:
        return ChannelOptions(
            target=target,
            default_timeout=args.timeout,
            tls=args.tls,
            root_certificates=args.ca,
            cert_chain=args.cert,
            private_key=args.key,
            tls_server_name=args.tls_server_name,
            token=_read_token(args.token_file),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _service(args: argparse.Namespace) -> tuple[str, str]:
    """The service a command talks to, and its address."""
    return ("agent", args.agent) if hasattr(args, "agent_command") else ("registry", args.registry)


async def _dispatch(args: argparse.Namespace, printer: Printer) -> int:
    if hasattr(args, "agent_command"):
        agent_command: agent_commands.AgentCommand = args.agent_command
        async with AgentClient.connect(_channel_options(args, args.agent)) as agent:
            return await agent_command(agent, args, printer)
    if hasattr(args, "status_command"):
        status: status_command.StatusCommand = args.status_command
        async with RegistryClient.connect(_channel_options(args, args.registry)) as client:
            return await status(client, lambda target: _channel_options(args, target), args, printer)
    command: Command = args.command
    async with RegistryClient.connect(_channel_options(args, args.registry)) as client:
        return await command(client, args, printer)


async def _interruptible(command: Coroutine[Any, Any, int], handle_sigint: bool) -> int:
    """Run `command`; the first SIGINT cancels it (KeyboardInterrupt out of the loop), a second
    one raises KeyboardInterrupt at once, even while the first one's clean-up runs.

    Not asyncio.run's own SIGINT handler: that one is a plain Python handler, which runs only
    when the main thread next runs Python code. The kernel may deliver a process's SIGINT to
    any of its threads (grpc's poller, timer and event-engine threads), and a watch waiting on
    an idle stream leaves the main thread asleep in epoll with nothing to wake it: the signal
    was noted and never acted on. The loop's own handler also writes to the loop's wakeup fd,
    from whichever thread the signal reached.
    """
    if not handle_sigint:  # not the main thread, or SIGINT ignored (a shell's background job)
        return await command
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        return await command
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)  # back to default_int_handler


def _describe_failure(error: KvshuttleRpcError, args: argparse.Namespace) -> str:
    """The line for a failed RPC; transport failures (no ErrorInfo) name the address."""
    service, address = _service(args)
    if error.reason is None and error.code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the {service} at {address} ({error.code_name})"
    if error.reason is None and error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the {service} at {address} did not answer within {args.timeout}s ({error.code_name})"
    return str(error)


def run(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run the CLI and return its exit status; writes only to `stdout` and `stderr`.

    The defaults are the process's argv, streams and environment. Safe to call from any thread
    that runs no event loop (it runs its own).
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    token = _STREAMS.set((out, err))
    try:
        parser = build_parser(os.environ if environ is None else environ)
        try:
            args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
        except _ParserExitError as exc:
            (out if exc.status == 0 else err).write(exc.message)
            return exc.status
        printer = Printer(out=out, err=err, json=args.json)
        handle_sigint = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        try:
            return asyncio.run(_interruptible(_dispatch(args, printer), handle_sigint))
        except UsageError as exc:
            sub: argparse.ArgumentParser = args.parser
            err.write(f"{sub.format_usage()}{sub.prog}: error: {exc}\n")
            return 2
        except KvshuttleRpcError as exc:
            printer.error(f"error: {_describe_failure(exc, args)}")
            return 1
        except BrokenPipeError:  # the reader of stdout went away; main() quiets the rest
            return 1
        except OSError as exc:  # certificate files
            printer.error(
                f"error: {exc.strerror or exc}: {exc.filename}" if exc.filename else f"error: {exc}"
            )
            return 1
        except KeyboardInterrupt:
            return 130
    finally:
        _STREAMS.reset(token)


def main() -> None:
    """Console-script entry point."""
    try:
        status = run()
    except KeyboardInterrupt:  # Ctrl-C outside the event loop (while parsing, say)
        status = 130
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `kvshuttle ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        status = status or 1
    sys.exit(status)


if __name__ == "__main__":
    main()
