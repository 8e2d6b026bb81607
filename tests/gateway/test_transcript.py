"""Exact-token transcripts (kvshuttle.gateway.prompts.transcript): a chat is spliced onto a
retained turn's ids only when it repeats that turn's rendered prompt and answer byte for byte;
keys never collide across salts, models or texts."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from kvshuttle.gateway.openai.prompt import Prompt, transcript_spec
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.prompts.transcript import (
    answer_ids,
    answer_sha256,
    lookup_key,
    previous_turn_end,
    splice,
)
from kvshuttle.gateway.turns.record import DecodeOutput

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


def test_an_empty_answer_splices_the_prompt_alone() -> None:
    """A turn whose answer ids did not decode to its text keeps its prompt's ids alone: the next
    chat starts with them, and its answer text is tokenized with the rest."""
    rest = ANSWER + "</assistant><user>more</user><assistant>"
    found = splice(PROMPT + rest, PROMPT, [10, 11, 12], answer_sha256(""), 0)
    assert found is not None
    assert list(found.ids) == [10, 11, 12] and found.rest == rest
    assert splice("<user>hi!</user><assistant>" + rest, PROMPT, [10, 11, 12], answer_sha256(""), 0) is None


def test_a_turn_keeps_decodes_ids_or_else_its_prompts(chat_tokenizer: ChatTokenizer) -> None:
    ids = chat_tokenizer.tokenizer.encode("Hello world", add_special_tokens=False).ids
    prompt = Prompt([1, 2, 3], "<prompt text>", lookup_key=b"k" * 32)
    kept = transcript_spec(
        chat_tokenizer, prompt, DecodeOutput(text="Hello world", token_ids=ids, finish_reason="stop")
    )
    assert kept is not None
    assert (kept.num_tokens, kept.answer_chars, kept.answer_sha256) == (
        3 + len(ids),
        11,
        answer_sha256("Hello world"),
    )
    # Ids that decode to other text, or none: the prompt's ids alone, an empty answer.
    for out in (
        DecodeOutput(text="Hello there", token_ids=ids, finish_reason="stop"),
        DecodeOutput(text="Hello world", token_ids=[], ids_complete=False, finish_reason="stop"),
    ):
        alone = transcript_spec(chat_tokenizer, prompt, out)
        assert alone is not None
        assert (alone.num_tokens, alone.answer_chars, alone.answer_sha256) == (3, 0, answer_sha256(""))
    # Decode did not finish (the client left): none.
    assert transcript_spec(chat_tokenizer, prompt, DecodeOutput(text="Hel", token_ids=ids[:1])) is None
    # A prompt that keeps no transcript (a completions prompt): none.
    assert transcript_spec(chat_tokenizer, Prompt([1, 2, 3]), DecodeOutput(finish_reason="stop")) is None
