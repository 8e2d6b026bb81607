"""A model's chat template, set up the way transformers' apply_chat_template sets it up:
jinja2's sandbox with `trim_blocks`, `lstrip_blocks`, loop controls and the `{% generation %}`
tag, transformers' `tojson`, `raise_exception` and `strftime_now`; and where the template is
found in the model's directory (kvshuttle.gateway.prompts.tokenizer renders it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "ChatTemplate",
    "TemplateError",
    "find_chat_template",
    "read_json_object",
]

# Template variables the gateway sets itself; a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize"}
)


class TemplateError(ValueError):
    """The chat template refused the conversation (its raise_exception, or a template error)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker) renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's API: a class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> Any:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, json.dumps' options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A model's chat template, compiled as transformers compiles it for apply_chat_template."""

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The prompt text, as apply_chat_template(tokenize=False) renders it, with `variables`
        (the special tokens, the template kwargs). Raises TemplateError when the template
        refuses the conversation."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateError(f"{type(exc).__name__}: {exc}") from exc


def read_json_object(path: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict; {} when it is missing or not an object."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def find_chat_template(directory: Path, override: Path | None = None) -> str | None:
    """The configured file, else chat_template.jinja, else tokenizer_config.json's
    "chat_template" (its "default" entry when it holds named templates), else
    chat_template.json's; None when the model has none."""
    if override is not None:
        return override.read_text(encoding="utf-8")
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.json"):
        template = read_json_object(directory / name).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            default = named.get("default")
            if isinstance(default, str):
                return default
    return None
