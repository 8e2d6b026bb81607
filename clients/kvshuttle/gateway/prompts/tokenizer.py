"""Token ids exactly as the engine will compute them: the model's tokenizer.json (`tokenizers`)
and chat template (kvshuttle.gateway.prompts.chat_template: jinja2 as transformers sets it up), with
vLLM's special-token handling (chat: the template's text encoded with add_special_tokens=False;
completions with a text prompt: the tokenizer's default, add_special_tokens=True).

Why the gateway tokenizes itself: the router verifies reuse on token ids, and the cheapest way
to have ids that are exactly the engine's is to compute them the same way here, in the process
that already holds the request, instead of a /tokenize round trip to an engine. The engines
then get those ids as the prompt (`/v1/completions` with `prompt: [ids]`), so what vLLM computes
is what the router verified, whatever the engine's own templating would have done.

Speed: a 4k-token chat takes 2-3 ms to tokenize from scratch on one core, more than the
gateway's whole latency budget. Chat templates put special tokens (`<|im_start|>`, ...) between
messages, and a tokenizer splits its input on those before it normalizes and pre-tokenizes
anything, so the ids of a rendered chat are the ids of the text between special tokens, piece
by piece, with the special tokens' ids in between. The pieces of the earlier messages repeat
every turn; they are cached (LRU, bounded), and only new text is tokenized. The cache is used
only where that equivalence holds: the tokenizer is checked when loaded (no Metaspace
`prepend_scheme: "first"`, which treats the first piece differently; special tokens that split
cleanly) and self-tested on sample renderings; a sampled fraction of requests is re-checked
against a full tokenization off the request path, and any mismatch turns the cache off.

One module on purpose: the segment cache and the checks that decide when it may be used make
one argument (cached ids equal the engine's), read together.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import structlog
from tokenizers import AddedToken, Tokenizer, processors

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.prompts.chat_template import (
    ChatTemplate,
    TemplateError,
    find_chat_template,
    read_json_object,
)

log = structlog.get_logger("kvshuttle.gateway")

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to every template.
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Uncached text longer than this is tokenized on a worker thread, not on the event loop.
_THREAD_CHARS = 32_768
# A cache entry's bookkeeping beyond its text and ids.
_ENTRY_OVERHEAD = 120


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


# ---- the segment cache ----------------------------------------------------------------------


class _SegmentCache:
    """LRU of text piece -> token ids, bounded by an estimate of its memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size(text: str, ids: array[int]) -> int:
        return len(text) + 4 * len(ids) + _ENTRY_OVERHEAD

    def get(self, text: str) -> array[int] | None:
        ids = self._entries.get(text)
        if ids is None:
            self.misses += 1
            return None
        self._entries.move_to_end(text)
        self.hits += 1
        return ids

    def put(self, text: str, ids: array[int]) -> None:
        size = self._size(text, ids)
        if size > self.max_bytes // 8 or text in self._entries:
            return  # one huge piece would flush everything else
        self._entries[text] = ids
        self._bytes += size
        while self._bytes > self.max_bytes and self._entries:
            old, old_ids = self._entries.popitem(last=False)
            self._bytes -= self._size(old, old_ids)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _overlap(a: str, b: str) -> bool:
    """Whether a proper suffix of `a` is a prefix of `b`."""
    return any(a.endswith(b[:k]) for k in range(1, min(len(a), len(b))))


def _walk(component: Any) -> Iterator[dict[str, Any]]:
    """Every component dict of a normalizer / pre-tokenizer tree."""
    if isinstance(component, dict):
        yield component
        for value in component.values():
            yield from _walk(value)
    elif isinstance(component, list):
        for value in component:
            yield from _walk(value)


def _split_tokens(spec: dict[str, Any]) -> tuple[list[str], str]:
    """The special tokens a rendered chat can be cut at, or ([], why not)."""
    for part in (*_walk(spec.get("pre_tokenizer")), *_walk(spec.get("normalizer"))):
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") == "first":
            return [], "Metaspace prepend_scheme=first treats the first piece differently"
    added = [t for t in spec.get("added_tokens") or () if isinstance(t, dict)]
    raw = [t for t in added if not t.get("normalized", False) and isinstance(t.get("content"), str)]
    clean = [
        str(t["content"])
        for t in raw
        if t.get("special")
        and t["content"]
        and not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))
    ]
    # Split tokens among themselves match as the tokenizer matches them (leftmost-longest). A
    # raw added token that is not one of them, but contains, sits inside or overlaps the end of
    # one, could win the tokenizer's match where a plain split would not.
    others = [str(t["content"]) for t in raw if str(t["content"]) not in clean and t["content"]]
    for s in clean:
        for o in others:
            if s in o or o in s or _overlap(s, o) or _overlap(o, s):
                return [], f"special token {s!r} overlaps added token {o!r}"
    return clean, ""


# ---- the tokenizer --------------------------------------------------------------------------


class ChatTokenizer:
    """One model's tokenizer and chat template, with the segment cache."""

    def __init__(
        self,
        name: str,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        content_format: str = "string",
        template_kwargs: Mapping[str, Any] | None = None,
        cache_bytes: int = 64 * 2**20,
        verify_fraction: float = 0.0,
        split_special_tokens: bool = False,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.content_format = content_format
        self.template_kwargs = dict(template_kwargs or {})
        self.verify_fraction = verify_fraction
        self._template = ChatTemplate(chat_template) if chat_template is not None else None
        self._cache = _SegmentCache(cache_bytes)
        self._split: re.Pattern[str] | None = None
        self._special_ids: dict[str, int] = {}
        self.cache_off_reason = ""
        if cache_bytes <= 0:
            self.cache_off_reason = "tokenizer_cache_bytes is 0"
        elif split_special_tokens:
            self.cache_off_reason = "split_special_tokens: special tokens are tokenized as text"
        else:
            tokens, why = _split_tokens(json.loads(tokenizer.to_str()))
            ids = {t: tokenizer.token_to_id(t) for t in tokens}
            if why or not tokens or any(i is None for i in ids.values()):
                self.cache_off_reason = why or "no special tokens to split a chat at"
            else:
                self._special_ids = {t: int(i) for t, i in ids.items() if i is not None}
                ordered = sorted(tokens, key=len, reverse=True)  # leftmost-longest, as the tokenizer
                self._split = re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")")
                failed = self._self_test()
                if failed:
                    self._split = None
                    self.cache_off_reason = f"self-test mismatch on {failed[:80]!r}"
        if self.cache_off_reason:
            log.info("tokenizer.cache_off", model=name, reason=self.cache_off_reason)

    @classmethod
    def load(
        cls,
        name: str,
        settings: ModelSettings,
        *,
        cache_bytes: int = 64 * 2**20,
        verify_fraction: float = 0.0,
    ) -> ChatTokenizer:
        """Load `settings.tokenizer` (a directory) the way transformers' AutoTokenizer would for vLLM."""
        directory = settings.tokenizer
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # vLLM neither truncates nor pads prompts (unless asked per request); tokenizer.json may.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config = read_json_object(directory / "tokenizer_config.json")
        legacy = read_json_object(directory / "special_tokens_map.json")
        special = {
            attr: text
            for attr in SPECIAL_TOKEN_ATTRIBUTES
            if (text := _token_text(config.get(attr, legacy.get(attr)))) is not None
        }
        _add_config_tokens(tokenizer, config)
        _update_post_processor(tokenizer, config, special)
        split_special = bool(config.get("split_special_tokens", False))
        tokenizer.encode_special_tokens = split_special
        return cls(
            name,
            tokenizer,
            chat_template=find_chat_template(directory, settings.chat_template),
            special_tokens=special,
            content_format=settings.content_format,
            template_kwargs=settings.chat_template_kwargs,
            cache_bytes=cache_bytes,
            verify_fraction=verify_fraction,
            split_special_tokens=split_special,
        )

    # ---- rendering --------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text, as apply_chat_template(tokenize=False) renders it, `tools` as the
        template's `tools` variable (the request's tool definitions, as vLLM passes them).
        Raises TemplateError when the template refuses the conversation, LookupError without one."""
        if self._template is None:
            raise LookupError(f"model {self.name!r} has no chat template")
        kwargs = {**self.special_tokens, **self.template_kwargs, **(template_kwargs or {})}
        return self._template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, variables=kwargs
        )

    # ---- encoding ---------------------------------------------------------------------------

    def encode_exact(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The whole text through the tokenizer at once (the reference the cache must equal)."""
        return list(self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A completions text prompt: the tokenizer's default special-token handling (vLLM's)."""
        return self.encode_exact(text, add_special_tokens=True)

    @property
    def cached(self) -> bool:
        return self._split is not None

    def pieces(self, text: str) -> tuple[list[int | array[int] | str], list[str]]:
        """The text cut at special tokens: special ids, cached ids, and the uncached pieces
        (also returned on their own, for encode_missing)."""
        assert self._split is not None
        parts: list[int | array[int] | str] = []
        missing: list[str] = []
        for i, piece in enumerate(self._split.split(text)):
            if not piece:
                continue
            if i % 2:  # re.split puts the separators (special tokens) at odd indexes
                parts.append(self._special_ids[piece])
                continue
            ids = self._cache.get(piece)
            if ids is None:
                parts.append(piece)
                missing.append(piece)
            else:
                parts.append(ids)
        return parts, list(dict.fromkeys(missing))  # a piece twice in one chat is encoded once

    def encode_missing(self, missing: list[str]) -> list[array[int]]:
        """Token ids of uncached pieces (thread-safe: touches no cache)."""
        if not missing:
            return []
        encodings = self.tokenizer.encode_batch_fast(missing, add_special_tokens=False)
        return [array("I", e.ids) for e in encodings]

    def assemble(
        self, parts: list[int | array[int] | str], missing: list[str], encoded: list[array[int]]
    ) -> list[int]:
        """Cache the new pieces and join everything into the prompt's ids."""
        fresh = dict(zip(missing, encoded, strict=True))
        for piece, ids in fresh.items():
            self._cache.put(piece, ids)
        out: list[int] = []
        for part in parts:
            if isinstance(part, int):
                out.append(part)
            elif isinstance(part, str):
                out.extend(fresh[part])
            else:
                out.extend(part)
        return out

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat's ids (add_special_tokens=False), through the cache when it is on."""
        if self._split is None:
            return self.encode_exact(text, add_special_tokens=False)
        parts, missing = self.pieces(text)
        return self.assemble(parts, missing, self.encode_missing(missing))

    @staticmethod
    def needs_thread(missing: Sequence[str]) -> bool:
        return sum(len(m) for m in missing) > _THREAD_CHARS

    def should_verify(self) -> bool:
        return self._split is not None and self.verify_fraction > 0 and random.random() < self.verify_fraction

    def check(self, text: str, ids: Sequence[int]) -> str:
        """ "" when `ids` are the whole text's ids, else what differs. Thread-safe (changes nothing)."""
        exact = self.encode_exact(text, add_special_tokens=False)
        if exact == list(ids):
            return ""
        first = next(
            (i for i, (a, b) in enumerate(zip(exact, ids, strict=False)) if a != b), min(len(exact), len(ids))
        )
        return f"verification mismatch ({len(exact)} vs {len(ids)} tokens, first at {first})"

    def verify(self, text: str, ids: Sequence[int]) -> bool:
        """check(), and a mismatch turns the cache off. Call it on the thread that uses the cache."""
        if self._split is None:
            return True
        mismatch = self.check(text, ids)
        if mismatch:
            self.disable_cache(mismatch)
        return not mismatch

    def disable_cache(self, reason: str) -> None:
        self._split = None
        self.cache_off_reason = reason
        self._cache.clear()
        log.error("tokenizer.cache_disabled", model=self.name, reason=reason)

    def cache_stats(self) -> dict[str, int]:
        return {"entries": len(self._cache), "hits": self._cache.hits, "misses": self._cache.misses}

    def _self_test(self) -> str:
        """Sample texts whose piecewise ids differ from their whole-text ids; "" when none do."""
        specials = list(self._special_ids)
        bodies = [
            "Hello, world! 123 4567",
            " leading space\n\nand  two\tspaces ",
            "ünïcödé 🙂 — \u201cquotes\u201d \u2018x\u2019",
            "\n",
            "",
            "  \n  x\n\n",
            "don't it's we'll I'M",
            "a" * 300,
            "".join(chr(c) for c in range(32, 127)),
        ]
        samples = [s + b + specials[i % len(specials)] + b for i, b in enumerate(bodies) for s in specials]
        samples.append(specials[0].join(bodies))
        if self._template is not None:
            # A template that wants other roles or fields is skipped: the raw samples still test.
            with contextlib.suppress(TemplateError, LookupError):
                samples.append(
                    self.render(
                        [
                            {"role": "system", "content": bodies[1]},
                            {"role": "user", "content": bodies[0] + specials[-1] + bodies[2]},
                            {"role": "assistant", "content": bodies[6]},
                            {"role": "user", "content": bodies[5]},
                        ]
                    )
                )
        for text in samples:
            if self.encode_chat(text) != self.encode_exact(text, add_special_tokens=False):
                self._cache.clear()
                return text
        self._cache.clear()
        self._cache.hits = self._cache.misses = 0
        return ""


def _add_config_tokens(tokenizer: Tokenizer, config: Mapping[str, Any]) -> None:
    """Added tokens tokenizer_config.json declares that tokenizer.json lacks (transformers adds them)."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return
    present = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
    for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
            continue
        if spec["content"] in present:
            continue
        token = AddedToken(
            spec["content"],
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not spec.get("special", False))),
            special=bool(spec.get("special", False)),
        )
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])


def _update_post_processor(
    tokenizer: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """transformers (v5) rebuilds the post-processor from add_bos_token / add_eos_token when the
    config names either; it decides what a text prompt with add_special_tokens=True gets."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    bos = special.get("bos_token") if config.get("add_bos_token") else None
    eos = special.get("eos_token") if config.get("add_eos_token") else None
    tokens = [(t, i) for t in (bos, eos) if t is not None and (i := tokenizer.token_to_id(t)) is not None]
    if bos is not None and tokenizer.token_to_id(bos) is None:
        bos = None
    if eos is not None and tokenizer.token_to_id(eos) is None:
        eos = None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict(tokens).items())
    )
