"""Token ids as the engine computes them: chat templates rendered as transformers renders
them, vLLM's special-token handling, and the segment cache never changing an id."""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from bench.emulator.http.tokenizer import SPECIAL, WORDS, make_tokenizer
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.openai.protocol import normalize_messages
from kvshuttle.gateway.prompts.chat_template import TemplateError
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

# Whitespace control, loop controls, tojson, special-token variables, namespaces, macros:
# everything a real template (Qwen3's, Llama's) leans on.
RICH_TEMPLATE = """{%- set ns = namespace(system=none) -%}
{%- macro render(m) %}
    <|im_start|>{{ m.role }}
    {% if m.content is string %}
{{ m.content | trim }}
    {%- else %}
        {% for part in m.content %}{{ part.text }}{% endfor %}
    {%- endif %}
<|im_end|>
{% endmacro %}
{{- bos_token }}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.system = m.content %}
        {% continue %}
    {% endif %}
    {% if loop.index > 50 %}{% break %}{% endif %}
    {{ render(m) }}
{%- endfor %}
{% if ns.system %}<|im_start|>system
{{ ns.system }}{{ {'k': [1, 'ü']} | tojson }}<|im_end|>
{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


def independent_render(template: str, **context: Any) -> str:
    """apply_chat_template's jinja setup, written out again from transformers' source."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(**context)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), bos_post_processor=False)


def load(directory: Path, **kw: Any) -> ChatTokenizer:
    return ChatTokenizer.load("m", ModelSettings(tokenizer=directory, **kw))


def with_template(base: Path, target: Path, template: str, **config: Any) -> Path:
    target.mkdir()
    (target / "tokenizer.json").write_text((base / "tokenizer.json").read_text())
    (target / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template, **config})
    )
    return target


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "Hello,\n  world!  "},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
]


@pytest.mark.parametrize("content_format", ["string", "openai"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_rendering_equals_transformers_style_jinja(
    base_dir: Path, tmp_path: Path, content_format: str, kwargs: dict[str, Any]
) -> None:
    tok = load(with_template(base_dir, tmp_path / "m", RICH_TEMPLATE), content_format=content_format)
    messages = normalize_messages(MESSAGES, content_format)
    expected = independent_render(
        RICH_TEMPLATE,
        messages=messages,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
        **kwargs,
    )
    assert tok.render(messages, template_kwargs=kwargs) == expected
    assert "<think>" in expected if kwargs else "<think>" not in expected
    without = independent_render(
        RICH_TEMPLATE, messages=messages, add_generation_prompt=False, bos_token="<s>"
    )
    assert tok.render(messages, add_generation_prompt=False) == without


def test_messages_reach_the_template_as_vllm_hands_them_over() -> None:
    assert normalize_messages(list(MESSAGES), "string")[3]["content"] == "two\nparts"
    assert normalize_messages([{"role": "assistant", "content": None}], "string") == [
        {"role": "assistant", "content": ""}
    ]
    call: dict[str, Any] = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    (message,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], "string")
    assert message["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call["function"]["arguments"] == '{"x": 1}'  # the client's object is left alone


def test_the_template_comes_from_the_override_then_the_jinja_file_then_the_config(
    base_dir: Path, tmp_path: Path
) -> None:
    directory = with_template(base_dir, tmp_path / "m", "config:{{ messages[0].content }}")
    assert load(directory).render([{"role": "user", "content": "x"}]) == "config:x"
    (directory / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    assert load(directory).render([{"role": "user", "content": "x"}]) == "file:x"
    override = tmp_path / "override.jinja"
    override.write_text("override:{{ messages[0].content }}")
    assert load(directory, chat_template=override).render([{"role": "user", "content": "x"}]) == "override:x"
    named = with_template(base_dir, tmp_path / "named", "")
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default"},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    assert load(named).render([]) == "default"


def test_a_template_refusal_is_a_template_error(base_dir: Path, tmp_path: Path) -> None:
    tok = load(with_template(base_dir, tmp_path / "m", "{{ raise_exception('no ' + messages[0].role) }}"))
    with pytest.raises(TemplateError, match="no user"):
        tok.render([{"role": "user", "content": "x"}])


# ---- ids ----------------------------------------------------------------------------------


def random_chat(rnd: random.Random, turns: int) -> list[dict[str, Any]]:
    pieces = [
        *WORDS,
        " ",
        "  ",
        "\n",
        "\n\n",
        "!",
        "123",
        "ünï",
        "🙂",
        "<|im_start|>",
        "<|im_end|>",
        "<s>",
        "'s",
        "\t",
    ]
    messages = [{"role": "system", "content": "".join(rnd.choice(pieces) for _ in range(200))}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(
            {"role": role, "content": "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 60)))}
        )
    return messages


def test_cached_ids_are_the_ids_of_tokenizing_the_whole_chat(base_dir: Path) -> None:
    tok = load(base_dir)
    assert tok.cached, tok.cache_off_reason
    rnd = random.Random(3)
    for _ in range(40):
        messages = random_chat(rnd, rnd.randint(1, 12))
        for end in range(2, len(messages) + 1):  # a conversation growing turn by turn
            text = tok.render(messages[:end])
            assert tok.encode_chat(text) == tok.encode_exact(text, add_special_tokens=False)
    assert tok.cache_stats()["hits"] > tok.cache_stats()["misses"]
    assert tok.verify(text, tok.encode_chat(text))


def test_a_verification_mismatch_turns_the_cache_off(base_dir: Path) -> None:
    tok = load(base_dir)
    text = tok.render([{"role": "user", "content": "hello world"}])
    ids = tok.encode_chat(text)
    assert not tok.verify(text, [*ids, 1])
    assert not tok.cached and "mismatch" in tok.cache_off_reason
    assert tok.encode_chat(text) == ids  # still right, the slow way


def metaspace_tokenizer(directory: Path) -> Path:
    """A SentencePiece-style tokenizer whose pre-tokenizer treats the first piece specially."""
    rnd = random.Random(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(20)) for _ in range(500)]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False)
    )
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_a_tokenizer_that_treats_the_first_piece_specially_is_not_cached(
    tmp_path: Path, base_dir: Path
) -> None:
    directory = metaspace_tokenizer(tmp_path / "sp")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": json.loads((base_dir / "tokenizer_config.json").read_text())["chat_template"]}
        )
    )
    tok = load(directory)
    assert not tok.cached and "Metaspace" in tok.cache_off_reason
    text = tok.render([{"role": "user", "content": "the cache"}, {"role": "assistant", "content": "block"}])
    assert tok.encode_chat(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_an_added_token_overlapping_a_special_token_turns_the_cache_off(
    base_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "overlap"
    directory.mkdir()
    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken("|>\n", normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text((base_dir / "tokenizer_config.json").read_text())
    loaded = load(directory)
    assert not loaded.cached and "overlaps" in loaded.cache_off_reason
    text = loaded.render([{"role": "user", "content": "x"}])
    assert loaded.encode_chat(text) == loaded.tokenizer.encode(text, add_special_tokens=False).ids


def test_special_tokens_follow_vllm_for_chat_and_for_text_prompts(base_dir: Path, tmp_path: Path) -> None:
    # transformers rebuilds the post-processor from add_bos_token: a text prompt gets <s>,
    # a rendered chat (add_special_tokens=False) does not.
    directory = with_template(base_dir, tmp_path / "bos", "{{ messages[0].content }}", add_bos_token=True)
    tok = load(directory)
    bos = tok.tokenizer.token_to_id("<s>")
    assert tok.encode_prompt("the cache")[0] == bos
    assert tok.encode_prompt("the cache")[1:] == tok.encode_chat(
        tok.render([{"role": "user", "content": "the cache"}])
    )
    assert tok.encode_chat("the cache")[0] != bos
    # split_special_tokens: special tokens in text are text (and the cache cannot cut at them).
    split = with_template(base_dir, tmp_path / "split", "x", split_special_tokens=True)
    tok = load(split)
    assert not tok.cached
    assert tok.tokenizer.token_to_id("<|im_start|>") not in tok.encode_chat("<|im_start|>user")


def test_generation_blocks_and_strftime_render_as_transformers_renders_them(
    base_dir: Path, tmp_path: Path
) -> None:
    template = "{% generation %}{{ messages[0].content }}{% endgeneration %}|{{ strftime_now('%Y') }}"
    tok = load(with_template(base_dir, tmp_path / "gen", template))
    assert tok.render([{"role": "user", "content": "hi"}]) == f"hi|{datetime.now().strftime('%Y')}"
