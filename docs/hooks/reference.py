"""The docs' reference pages, generated from the code at every build so they cannot drift:

- the gRPC API from the .proto files (services, RPCs, messages, fields, enums, each with its
  comment), read from protoc's descriptor set with source info (grpcio-tools, offline);
- every environment variable of every service, from its pydantic-settings class: the name, the
  default and the comment the field carries in the source;
- the error reasons, from the one table every service's errors draw on.

Pure functions of the tree: `api_reference()`, `configuration_reference()`, `errors_reference()`
each return one page's Markdown.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from pydantic import BaseModel, SecretStr
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
# Where the settings classes live: every `config` or `settings` module of the package.
PACKAGE_ROOTS = (ROOT / "services" / "kvshuttle", ROOT / "clients" / "kvshuttle")

# FileDescriptorProto / DescriptorProto / ... field numbers, as SourceCodeInfo paths use them.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


# ---------------------------------------------------------------------------------------------
# The API, from the protos


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def descriptor_set(protos: list[Path] | None = None) -> descriptor_pb2.FileDescriptorSet:
    """protoc's descriptors of kvshuttle's protos with their comments (grpcio-tools' protoc and
    its bundled well-known types: no network). protoc runs in a child process: its extension
    module, loaded into a process that already holds grpc and protobuf's upb, can crash it."""
    spec = importlib.util.find_spec("grpc_tools")
    if spec is None or spec.origin is None:
        raise RuntimeError("grpcio-tools is not installed (a dev dependency)")
    protos = proto_files() if protos is None else protos
    well_known = Path(spec.origin).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        args = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--descriptor_set_out={out}",
            "--include_source_info",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed on {', '.join(map(str, protos))}: {done.stderr.strip()}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Each element's leading comment (its trailing one when it has none), by source path."""
    found = {}
    for loc in file.source_code_info.location:
        text = loc.leading_comments or loc.trailing_comments
        if text.strip():
            found[tuple(loc.path)] = textwrap.dedent(text).strip()
    return found


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "-")


def _type_name(field: descriptor_pb2.FieldDescriptorProto, known: set[str]) -> str:
    kind = descriptor_pb2.FieldDescriptorProto
    entry = _MAP_ENTRIES.get(field.type_name.lstrip("."))
    if entry is not None:  # a map field: protoc's synthetic repeated *Entry message
        key, value = (_type_name(f, known) for f in entry.field)
        return f"map<{key}, {value}>"
    if field.type in (kind.TYPE_MESSAGE, kind.TYPE_ENUM):
        name = field.type_name.lstrip(".")
        shown = f"[`{name.rsplit('.', 1)[-1]}`](#{_anchor(name)})" if name in known else f"`{name}`"
    else:
        shown = "`" + kind.Type.Name(field.type).removeprefix("TYPE_").lower() + "`"
    if field.label == kind.LABEL_REPEATED:
        return f"repeated {shown}"
    if field.proto3_optional:
        return f"optional {shown}"
    return shown


def _cell(text: str) -> str:
    """A comment as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _block(text: str) -> str:
    """A multi-line comment as a paragraph; indented lines (the protos' lists) keep their breaks."""
    lines = text.splitlines()
    out: list[str] = []
    for line in lines:
        if line.startswith("  ") and out:
            out.append("<br>" + line.strip())
        else:
            out.append(line)
    return "\n".join(out)


# Map fields' synthetic entry messages by full name, filled by _known_names.
_MAP_ENTRIES: dict[str, descriptor_pb2.DescriptorProto] = {}


def _known_names(files: list[descriptor_pb2.FileDescriptorProto]) -> set[str]:
    names: set[str] = set()

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        if message.options.map_entry:
            _MAP_ENTRIES[name] = message
            return
        names.add(name)
        for nested in message.nested_type:
            walk(name, nested)
        names.update(f"{name}.{e.name}" for e in message.enum_type)

    for f in files:
        for m in f.message_type:
            walk(f.package, m)
        names.update(f"{f.package}.{e.name}" for e in f.enum_type)
    return names


def _enum_md(
    full: str, enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], comments: dict[Any, str]
) -> list[str]:
    out = [f"#### enum `{enum.name}` {{#{_anchor(full)}}}", ""]
    if path in comments:
        out += [_block(comments[path]), ""]
    out += ["| value | number | meaning |", "|---|---:|---|"]
    for i, value in enumerate(enum.value):
        meaning = _cell(comments.get((*path, _ENUM_VALUE, i), ""))
        out.append(f"| `{value.name}` | {value.number} | {meaning} |")
    return [*out, ""]


def _message_md(
    full: str,
    message: descriptor_pb2.DescriptorProto,
    path: tuple[int, ...],
    comments: dict[Any, str],
    known: set[str],
) -> list[str]:
    out = [f"#### `{message.name}` {{#{_anchor(full)}}}", ""]
    if path in comments:
        out += [_block(comments[path]), ""]
    if message.field:
        out += ["| field | number | type | meaning |", "|---|---:|---|---|"]
        for i, field in enumerate(message.field):
            meaning = _cell(comments.get((*path, _MESSAGE_FIELD, i), ""))
            if field.HasField("oneof_index") and not field.proto3_optional:
                oneof = message.oneof_decl[field.oneof_index].name
                meaning = f"(oneof `{oneof}`) {meaning}"
            out.append(f"| `{field.name}` | {field.number} | {_type_name(field, known)} | {meaning} |")
        out.append("")
    else:
        out += ["No fields.", ""]
    for i, nested in enumerate(message.nested_type):
        if nested.options.map_entry:
            continue
        out += _message_md(f"{full}.{nested.name}", nested, (*path, _MESSAGE_NESTED, i), comments, known)
    for i, enum in enumerate(message.enum_type):
        out += _enum_md(f"{full}.{enum.name}", enum, (*path, _MESSAGE_ENUM, i), comments)
    return out


def api_reference(protos: list[Path] | None = None) -> str:
    """Every service's RPCs, messages, fields and enums, with their comments, per proto file."""
    order = ["registry", "router", "agent", "vllm"]  # the turn's order; vLLM's params last
    files = sorted(
        (f for f in descriptor_set(protos).file if f.package.startswith("kvshuttle.")),
        key=lambda f: (
            order.index(f.package.split(".")[1]) if f.package.split(".")[1] in order else 99,
            f.name,
        ),
    )
    known = _known_names(files)
    out = [
        "# gRPC API",
        "",
        "Generated from the `.proto` files under `proto/` at every docs build: what is written here",
        "is what the protos say. Every error carries a `google.rpc.ErrorInfo`; its reasons are",
        "listed in [Error reasons](errors.md).",
        "",
    ]
    for f in files:
        comments = _comments(f)
        out += [f"## `{f.name}`", "", f"Package `{f.package}`: [source](../../proto/{f.name}).", ""]
        for s_index, service in enumerate(f.service):
            path = (_FILE_SERVICE, s_index)
            out += [f"### service `{service.name}` {{#{_anchor(f.package + '.' + service.name)}}}", ""]
            if path in comments:
                out += [_block(comments[path]), ""]
            out += ["| RPC | request | response | what it does |", "|---|---|---|---|"]
            for m_index, method in enumerate(service.method):
                req, resp = method.input_type.lstrip("."), method.output_type.lstrip(".")
                stream_in = "stream " if method.client_streaming else ""
                stream_out = "stream " if method.server_streaming else ""
                what = _cell(comments.get((*path, _SERVICE_METHOD, m_index), ""))
                out.append(
                    f"| `{method.name}` | {stream_in}[`{req.rsplit('.', 1)[-1]}`](#{_anchor(req)}) "
                    f"| {stream_out}[`{resp.rsplit('.', 1)[-1]}`](#{_anchor(resp)}) | {what} |"
                )
            out.append("")
        if f.message_type or f.enum_type:
            out += ["### Messages and enums", ""]
        for i, enum in enumerate(f.enum_type):
            out += _enum_md(f"{f.package}.{enum.name}", enum, (_FILE_ENUM, i), comments)
        for i, message in enumerate(f.message_type):
            out += _message_md(f"{f.package}.{message.name}", message, (_FILE_MESSAGE, i), comments, known)
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# Comments in Python source: what a settings field or an enum member means


def _comment_lines(source: str) -> dict[int, str]:
    """line number -> the comment on that line (without '#')."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def class_comments(cls: type) -> dict[str, str]:
    """attribute -> its comment in `cls`'s own body: the comment lines right above the
    assignment, then the one at its end of line."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = _comment_lines(source)
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found = {}
    previous: tuple[str, int] | None = None  # the last assignment: its name and last line
    for stmt in body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
        elif (
            isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
        ):
            name = stmt.targets[0].id
        else:
            previous = None
            continue
        grouped = previous is not None and previous[1] == stmt.lineno - 1 and previous[0] in found
        previous = (name, stmt.end_lineno or stmt.lineno)
        above: list[str] = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        inline = [
            comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments
        ]
        text = " ".join([*above, *(c for c in inline if c not in above)]).strip()
        if text:
            found[name] = text
        elif grouped:
            # A comment above a run of fields with no blank line between speaks for the run.
            found[name] = "(with the variable above)"
    return found


def docstring_fields(cls: type) -> dict[str, str]:
    """`name: meaning` entries of a class's own docstring (continuation lines indented)."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    found: dict[str, str] = {}
    current = None
    for line in doc.splitlines():
        match = re.match(r"^(\w+): (.+)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif current is not None and line.startswith((" ", "\t")) and line.strip():
            found[current] += " " + line.strip()
        else:
            current = None
    return found


def field_comment(model: type, name: str, description: str | None = None) -> str:
    """The field's description, else its comment in the class that declares it (or a base),
    else its entry in that class's docstring."""
    if description:
        return description
    for cls in model.__mro__:
        if name in inspect.get_annotations(cls):
            text = class_comments(cls).get(name) or docstring_fields(cls).get(name)
            if text:
                return text
    return ""


# ---------------------------------------------------------------------------------------------
# Settings: every variable of every service


def _import_settings_modules() -> Iterator[types.ModuleType]:
    for root in PACKAGE_ROOTS:
        for info in pkgutil.walk_packages([str(root)], prefix="kvshuttle."):
            if info.name.rsplit(".", 1)[-1] in ("config", "settings") and ".v1" not in info.name:
                yield importlib.import_module(info.name)


def settings_classes() -> list[type[BaseSettings]]:
    """Every pydantic-settings class of the package (one per service process), by env prefix."""
    found: dict[str, type[BaseSettings]] = {}
    for module in _import_settings_modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(obj, BaseSettings)
                and obj is not BaseSettings
                and obj.__module__ == module.__name__
            ):
                found[obj.__module__ + "." + obj.__qualname__] = obj
    order = ["REGISTRY", "ROUTER", "AGENT", "GATEWAY"]  # the services first, in the turn's order

    def key(cls: type[BaseSettings]) -> tuple[int, str]:
        prefix = str(cls.model_config.get("env_prefix", ""))
        service = prefix.removeprefix("KVSHUTTLE_").rstrip("_")
        return (order.index(service) if service in order else len(order), prefix)

    return sorted(found.values(), key=key)


def _nests(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    )


def _model_of(annotation: Any) -> type | None:
    """The model (pydantic or dataclass) a field nests, also through `X | None`; None for a leaf."""
    if _nests(annotation):
        return typing.cast(type, annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if _nests(a)]
        return models[0] if len(models) == 1 else None
    return None


_UNSET = object()  # a required field's default


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    annotation: Any
    default: Any  # _UNSET when required
    description: str | None
    excluded: bool


def _fields(cls: type) -> list[_Field]:
    """A pydantic model's or a dataclass's fields, each with its default (_UNSET: required)."""
    out = []
    if issubclass(cls, BaseModel):
        for name, info in cls.model_fields.items():
            default = _UNSET if info.is_required() else info.get_default(call_default_factory=True)
            out.append(_Field(name, info.annotation, default, info.description, info.exclude is True))
        return out
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(typing.cast(Any, cls)):
        value: Any = _UNSET
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        out.append(_Field(f.name, hints.get(f.name, f.type), value, None, False))
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, timedelta):
        return f"`{value.total_seconds():g} s`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, list | dict | tuple | frozenset | set):
        if isinstance(value, frozenset | set):
            value = sorted(value, key=str)
        text = json.dumps(value, default=str)
        return "`" + (text if len(text) <= 80 else text[:77] + "…") + "`"
    if isinstance(value, Path):
        return f"`{value}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


@dataclass(frozen=True, slots=True)
class Variable:
    name: str  # the environment variable, prefix included
    default: str
    meaning: str


def variables(cls: type, prefix: str, defaults: dict[str, Any] | None = None) -> list[Variable]:
    """Every variable `cls` reads, nested models walked with `__`, each with the default its
    service gives it (a nested model's default instance is the service's: the router's listen
    address, not the shared class's)."""
    out = []
    for field in _fields(cls):
        if field.excluded:
            continue
        env = f"{prefix}{field.name.upper()}"
        default = field.default if defaults is None else defaults.get(field.name, field.default)
        nested = _model_of(field.annotation)
        if nested is not None:
            instance = default if isinstance(default, nested) else None
            nested_defaults = (
                {f.name: getattr(instance, f.name) for f in _fields(nested)} if instance is not None else None
            )
            out += variables(nested, env + "__", nested_defaults)
            continue
        shown = "required" if default is _UNSET else _shown(default)
        out.append(Variable(env, shown, field_comment(cls, field.name, field.description)))
    return out


def configuration_reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every environment variable each kvshuttle process reads, generated from its settings class",
        "at every docs build: the name, the default and what the source says it means. Nested",
        "settings join with `__` (`KVSHUTTLE_ROUTER_POLICY__PARKING__ENABLED`); lists, maps and",
        "nested objects may also be given whole as JSON. The",
        "[configuration guide](../operations/configuration.md) says which matter in practice.",
        "",
    ]
    for cls in settings_classes():
        prefix = str(cls.model_config.get("env_prefix", ""))
        out += [f"## `{prefix}*`", ""]
        own_doc = cls.__dict__.get("__doc__")
        if own_doc:
            out += [" ".join(inspect.cleandoc(own_doc).split("\n\n")[0].split()), ""]
        out += ["| variable | default | meaning |", "|---|---|---|"]
        for var in variables(cls, prefix):
            out.append(f"| `{var.name}` | {var.default} | {_cell(var.meaning)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# Error reasons


def errors_reference() -> str:
    from kvshuttle.core.reasons import SERVICE_REASONS, ErrorReason  # noqa: PLC0415

    # What each proto's service comment says of a reason (the API's own words) first; else the
    # table's comment on the member (a comment line heading a group, "# Nodes.", is not one).
    listed = proto_reasons()
    own = _inline_member_comments(ErrorReason)
    out = [
        "# Error reasons",
        "",
        "Every error a kvshuttle service returns carries a `google.rpc.ErrorInfo` in its status",
        "details: a `reason` from this table, the service's `domain` (`registry.kvshuttle`,",
        "`router.kvshuttle`, `agent.kvshuttle`) and `metadata` (`field` for a bad request field).",
        "Generated from the one table the services use; a test holds each proto's list to it.",
        "",
        "| reason | meaning | returned by |",
        "|---|---|---|",
    ]
    for reason in ErrorReason:
        services = sorted(s for s, reasons in SERVICE_REASONS.items() if reason in reasons)
        meaning = (
            _meaning(listed[reason.value])
            if reason.value in listed
            else own.get(reason.name)
            or (f"the generic reason of status {reason.value}" if reason.name in _STATUS_NAMES else "")
        )
        where = ", ".join(services) if services else "(no service's API lists it)"
        out.append(f"| `{reason.value}` | {meaning if '<br>' in meaning else _cell(meaning)} | {where} |")
    return "\n".join(out).rstrip() + "\n"


def proto_reasons(protos: list[Path] | None = None) -> dict[str, dict[str, str]]:
    """reason -> service -> what that service's comment says of it ("  NAME[, NAME]: meaning",
    continued on deeper-indented lines)."""
    found: dict[str, dict[str, str]] = {}
    for f in descriptor_set(protos).file:
        service = f.package.split(".")[1]
        comments = _comments(f)
        for s_index in range(len(f.service)):
            current: list[str] = []
            for line in comments.get((_FILE_SERVICE, s_index), "").splitlines():
                match = re.match(r"^  ([A-Z][A-Z_]+(?:, [A-Z][A-Z_]+)*): (.+)$", line)
                if match:
                    current = match.group(1).split(", ")
                    for name in current:
                        found.setdefault(name, {})[service] = match.group(2).strip()
                elif current and line.startswith("    "):
                    for name in current:
                        found[name][service] += " " + line.strip()
                else:
                    current = []
    return found


def _meaning(by_service: dict[str, str]) -> str:
    """One meaning when every service words it alike, else each service's."""
    if len(set(by_service.values())) == 1:
        return next(iter(by_service.values()))
    return "<br>".join(f"**{service}**: {_cell(text)}" for service, text in sorted(by_service.items()))


_STATUS_NAMES = frozenset(
    {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
)


def _inline_member_comments(cls: type) -> dict[str, str]:
    """member -> the comment on its own line(s): the end-of-line comment, else the comment lines
    right above it when they are not a group heading (one followed by a blank or a member that
    has its own end-of-line comment is kept: a heading ends with a period and names no member)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comment_lines(source)
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    found = {}
    for stmt in body.body:
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)):
            continue
        name = stmt.targets[0].id
        if stmt.lineno in comments and lines[stmt.lineno - 1].strip()[0] != "#":
            found[name] = comments[stmt.lineno]
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        text = " ".join(above)
        if text and not _is_heading(text):
            found[name] = text
    return found


def _is_heading(text: str) -> bool:
    """ "Nodes.", "Turns (router).", "Retentions and conversations.": a few words naming a group."""
    return len(text.split()) <= 4 and text.endswith((".", ":"))
