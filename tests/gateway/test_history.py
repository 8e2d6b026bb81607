"""Exact-token history (kvshuttle.gateway.prompts.history): a chat is spliced onto its conversation's last
turn only when it repeats that turn's rendered text and answer byte for byte."""

from __future__ import annotations

from collections.abc import Sequence

from kvshuttle.gateway.config import DEFAULT_HISTORY_BYTES
from kvshuttle.gateway.prompts.history import ExactHistory

A = "tenants/a/conversations/c"
B = "tenants/b/conversations/c"
EOS = 0
# A toy vocabulary: id -> text (EOS decodes to its special token text).
VOCAB = {0: "<eos>", 1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


PROMPT = "<user>hi</user><assistant>"
ANSWER = "Hello world!"
ANSWER_IDS = [1, 2, 3, 4, 5]


def remembered(history: ExactHistory, conversation: str = A, output: Sequence[int] = ANSWER_IDS) -> bool:
    return history.remember(
        conversation,
        prompt_ids=[10, 11, 12],
        text=PROMPT,
        output_ids=output,
        output_text=ANSWER,
        decode=decode,
    )


def test_a_chat_that_repeats_the_turn_exactly_is_spliced() -> None:
    history = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(history)
    rest = "</assistant><user>more</user><assistant>"
    splice = history.splice(A, PROMPT + ANSWER + rest)
    assert splice is not None
    assert list(splice.ids) == [10, 11, 12, *ANSWER_IDS]
    assert splice.rest == rest


def test_a_byte_of_difference_is_never_spliced() -> None:
    history = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(history)
    for text in (
        PROMPT + "Hello world?" + "</assistant>",  # the answer edited
        PROMPT + "Hello world" + "</assistant>",  # trimmed
        PROMPT + " Hello world!</assistant>",  # re-rendered with a space
        "<user>hi!</user><assistant>" + ANSWER + "</assistant>",  # earlier history edited
        PROMPT[:-1] + ANSWER,  # shorter than the turn
        PROMPT,
    ):
        assert history.splice(A, text) is None, text


def test_a_trailing_stop_token_the_text_lacks_is_dropped() -> None:
    history = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(history, output=[*ANSWER_IDS, EOS])
    splice = history.splice(A, PROMPT + ANSWER + "</assistant>")
    assert splice is not None and list(splice.ids) == [10, 11, 12, *ANSWER_IDS]


def test_ids_that_do_not_decode_to_the_text_are_not_remembered() -> None:
    history = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(history)
    # A stop string cut the text short of the ids (or a special token was skipped): forgotten.
    assert not remembered(history, output=[1, 2, 3, 4])
    assert not remembered(history, output=[1, EOS, 2, 3, 4, 5])
    assert history.splice(A, PROMPT + ANSWER) is None
    assert len(history) == 0 and history.nbytes == 0


def test_tenants_and_conversations_never_share_a_history() -> None:
    history = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(history, A)
    assert history.splice(B, PROMPT + ANSWER) is None
    assert history.splice("tenants/a/conversations/other", PROMPT + ANSWER) is None
    assert history.splice(A, PROMPT + ANSWER) is not None


def test_bounded_by_bytes_least_recently_used_out() -> None:
    one = ExactHistory(DEFAULT_HISTORY_BYTES)
    assert remembered(one, "c0")
    size = one.nbytes
    history = ExactHistory(max_bytes=3 * size)
    for name in ("c0", "c1", "c2"):
        assert remembered(history, name)
    assert history.splice("c0", PROMPT + ANSWER) is not None  # c0 used: c1 is the oldest now
    assert remembered(history, "c3")
    assert len(history) == 3 and history.nbytes == 3 * size
    assert history.splice("c1", PROMPT + ANSWER) is None
    assert all(history.splice(n, PROMPT + ANSWER) is not None for n in ("c0", "c2", "c3"))
    # A turn larger than the whole bound is not kept (and the conversation's old one is gone).
    assert not remembered(ExactHistory(max_bytes=size - 1))
    history.forget("c0")
    assert len(history) == 2 and history.nbytes == 2 * size
