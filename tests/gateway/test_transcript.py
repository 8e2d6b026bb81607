"""Exact-token transcripts (kvshuttle.gateway.prompts.transcript): a chat is spliced onto a
retained turn's ids only when it repeats that turn's rendered prompt and answer byte for byte;
keys never collide across salts, models or texts."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from kvshuttle.gateway.prompts.transcript import (
    answer_ids,
    answer_sha256,
    lookup_key,
    previous_turn_end,
    splice,
)

# A toy vocabulary: id -> text (EOS decodes to its special token text).
VOCAB = {0: "<eos>", 1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
PROMPT = "<user>hi</user><assistant>"
ANSWER = "Hello world!"
IDS = [10, 11, 12, 1, 2, 3, 4, 5]


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def spliced(text: str) -> list[int] | None:
    found = splice(text, PROMPT, IDS, answer_sha256(ANSWER), len(ANSWER))
    return None if found is None else [*found.ids, len(found.rest)]


def test_a_chat_that_repeats_the_turn_exactly_is_spliced() -> None:
    rest = "</assistant><user>more</user><assistant>"
    found = splice(PROMPT + ANSWER + rest, PROMPT, IDS, answer_sha256(ANSWER), len(ANSWER))
    assert found is not None
    assert list(found.ids) == IDS and found.rest == rest


def test_a_byte_of_difference_is_never_spliced() -> None:
    for text in (
        PROMPT + "Hello world?" + "</assistant>",  # the answer edited
        PROMPT + "Hello world" + "</assistant>",  # trimmed
        PROMPT + " Hello world!</assistant>",  # re-rendered with a space
        "<user>hi!</user><assistant>" + ANSWER + "</assistant>",  # earlier history edited
        PROMPT[:-1] + ANSWER,  # shorter than the turn
        PROMPT,
    ):
        assert spliced(text) is None, text


def test_a_trailing_stop_token_the_text_lacks_is_dropped() -> None:
    assert answer_ids([1, 2, 3, 4, 5, 0], ANSWER, decode) == [1, 2, 3, 4, 5]
    assert answer_ids([1, 2, 3, 4, 5], ANSWER, decode) == [1, 2, 3, 4, 5]


def test_ids_that_do_not_decode_to_the_text_keep_no_transcript() -> None:
    assert answer_ids([1, 2, 3, 4], ANSWER, decode) is None
    assert answer_ids([1, 2, 3, 4, 5, 0, 0], ANSWER, decode) is None
    assert answer_ids([], ANSWER, decode) is None


def test_the_previous_turn_ends_before_the_last_assistant_message() -> None:
    user, assistant, tool = {"role": "user"}, {"role": "assistant"}, {"role": "tool"}
    assert previous_turn_end([{"role": "system"}, user, assistant, user]) == 2
    assert previous_turn_end([user, assistant, tool, assistant, tool]) == 3
    assert previous_turn_end([user]) == 0
    assert previous_turn_end([assistant, user]) == 0  # nothing came before the answer


@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40))
def test_keys_are_apart_for_every_salt_model_and_text(salt: str, model: str, text: str) -> None:
    key = lookup_key(salt, model, text)
    assert len(key) == 32
    assert lookup_key(salt + "x", model, text) != key
    assert lookup_key(salt, model + "x", text) != key
    assert lookup_key(salt, model, text + "x") != key
    # Where the salt ends and the model starts is part of the key.
    if model:
        assert lookup_key(salt + model[0], model[1:], text) != key
