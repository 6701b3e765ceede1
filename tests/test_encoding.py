"""Prompt encoding (spec §3): render, option order, pieces, spans, budget, state truncation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clef_protocol.errors import RequestInvalid
from clef_worker.model.encoding import (
    BUDGET,
    PREFIX,
    SCHEMA_HEADER,
    SUFFIX,
    TYPE_IDS,
    Encoder,
    encode_order,
    option_semantics,
    render,
)


@pytest.fixture(scope="module")
def encoder(tiny_snapshot: Path) -> Encoder:
    return Encoder.from_file(tiny_snapshot / "tokenizer.json")


def _request(state: object = "s", **questions: dict) -> dict:
    return {"model": "m", "state": state, "questions": questions or {"a": {"type": "noul"}}}


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("as is {\"x\": 1}", "as is {\"x\": 1}"),
        ("", ""),
        ({"b": 1, "a": [1, 2.5, None]}, '{"a":[1,2.5,null],"b":1}'),
        ({"name": "Zoë"}, '{"name":"Zoë"}'),
        (123456789012345678901234567890, "123456789012345678901234567890"),
        (1e16, "1e+16"),
        (1e-05, "1e-05"),
        (-0.0, "-0.0"),
        (True, "true"),
        (None, "null"),
        ([], "[]"),
    ],
)
def test_render(value: object, text: str) -> None:
    assert render(value) == text


def test_semantics_sorts_description_first() -> None:
    assert option_semantics("b", "two") == '{"description":"two","option_id":"b"}'
    assert option_semantics("b", None) == '{"option_id":"b"}'
    assert option_semantics("0", {"z": 1, "a": 2}) == (
        '{"description":{"a":2,"z":1},"option_id":"0"}'
    )


def test_option_orders() -> None:
    noul = encode_order({"type": "noul"})
    assert [option for option, _ in noul] == ["true", "false"]
    assert noul[0][1].startswith("The proposition is true")
    partial = encode_order({"type": "noul", "criteria": {"true": "yes", "other": "ignored"}})
    assert partial == [("true", "yes"), ("false", noul[1][1])]
    dropped = encode_order({"type": "noul", "criteria": {"false": None}})
    assert dropped == [("true", noul[0][1]), ("false", None)]
    assert encode_order({"type": "noul", "criteria": None}) == noul
    choice = encode_order({"type": "choice", "criteria": {"b": 1, "B": 2, "10": 3, "2": 4}})
    assert [option for option, _ in choice] == ["10", "2", "B", "b"]
    score = encode_order({"type": "score", "criteria": ["low", None, {"x": 1}]})
    assert score == [("0", "low"), ("1", None), ("2", {"x": 1})]


def test_fixed_pieces_are_cached(encoder: Encoder) -> None:
    tokenizer = encoder.tokenizer
    assert list(encoder.prefix_ids) == tokenizer.encode(PREFIX, add_special_tokens=False).ids
    assert list(encoder.suffix_ids) == tokenizer.encode(SUFFIX, add_special_tokens=False).ids
    assert encoder.fixed_overhead == (
        len(encoder.prefix_ids) + len(tokenizer.encode(SCHEMA_HEADER).ids)
        + len(encoder.suffix_ids)
    )


def test_layout_of_one_question(encoder: Encoder) -> None:
    tokenizer = encoder.tokenizer
    request = _request("hello", q={"type": "choice", "instructions": {"k": 1},
                                   "criteria": {"y": None, "x": "first"}})
    encoding = encoder.encode(request, 16384)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    expected = (ids(PREFIX) + ids("hello") + ids(SCHEMA_HEADER)
                + ids("\nFIELD 1\nID: q\nTYPE: choice\nINSTRUCTION: ") + ids('{"k":1}')
                + ids("\nALLOWED OPTIONS:\n")
                + ids("OPTION 1: ") + ids('{"description":"first","option_id":"x"}') + ids("\n")
                + ids("OPTION 2: ") + ids('{"option_id":"y"}') + ids("\n")
                + ids("END FIELD\n") + ids(SUFFIX))
    assert encoding.input_ids == expected
    question = encoding.questions[0]
    assert question.option_ids == ("x", "y")
    assert question.type_id == 1
    start, end = question.question_span
    assert tokenizer.decode(encoding.input_ids[start:end]) == '{"k":1}'
    start, end = question.option_spans[1]
    assert tokenizer.decode(encoding.input_ids[start:end]) == '{"option_id":"y"}'
    assert encoding.state_tokens == len(ids("hello")) and not encoding.state_truncated


@pytest.mark.parametrize("instructions", [None, "", 0, False, [], {}])
def test_falsy_instructions_fall_back_to_the_id(encoder: Encoder, instructions: object) -> None:
    request = _request(q_id={"type": "noul", "instructions": instructions})
    encoding = encoder.encode(request, 16384)
    start, end = encoding.questions[0].question_span
    assert encoder.tokenizer.decode(encoding.input_ids[start:end]) == "q_id"


def test_budget_error_and_truncation(encoder: Encoder) -> None:
    request = _request("word " * 500)
    fixed = len(encoder.encode(_request(""), 16384).input_ids)
    with pytest.raises(RequestInvalid) as refused:
        encoder.encode(request, fixed - 1)
    assert str(refused.value) == (
        f"schema requires {fixed} tokens before state; maximum is {fixed - 1}"
    )
    exact = encoder.encode(request, fixed)
    assert exact.length == fixed and exact.state_tokens == 0 and exact.state_truncated
    cut = encoder.encode(request, fixed + 10)
    assert cut.length == fixed + 10 and cut.state_tokens == 10
    whole = len(encoder.tokenizer.encode("word " * 500, add_special_tokens=False).ids)
    assert (exact.truncated_tokens, cut.truncated_tokens) == (whole, whole - 10)
    full_state = encoder.tokenizer.encode("word " * 500, add_special_tokens=False).ids
    assert cut.input_ids[len(encoder.prefix_ids):len(encoder.prefix_ids) + 10] == full_state[:10]


def test_media_hook_counts_in_budget_and_shifts_spans(encoder: Encoder) -> None:
    request = _request("state")
    plain = encoder.encode(request, 16384)
    media = [529, 529, 529]
    with_media = encoder.encode(request, 16384, media_ids=media)
    assert with_media.length == plain.length + 3
    position = len(encoder.prefix_ids)
    assert with_media.input_ids[position:position + 3] == media
    shifted = tuple(s + 3 for s in plain.questions[0].question_span)
    assert with_media.questions[0].question_span == shifted
    with pytest.raises(RequestInvalid, match=r"schema requires \d+ tokens"):
        encoder.encode(request, plain.length - plain.state_tokens + 2, media_ids=media)


TEXT = st.lists(
    st.sampled_from(["a", "b", "ab", " ", "é", "1", "22", ".", "\n", "\t", "'s", "-", "  ",
                     "\n\n", "<|im_end|>", "<think>", "word", " word", "\r\n"]),
    max_size=200,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, budget=st.integers(0, 60), window=st.integers(1, 3), slack=st.integers(0, 8))
def test_windowed_state_truncation_equals_whole_text(encoder: Encoder, text: str, budget: int,
                                                     window: int, slack: int) -> None:
    """The long-state shortcut keeps exactly the tokens whole-text encoding would keep, wherever
    its window cuts (inside a word, a whitespace run or an added token such as `<|im_end|>`)."""
    small = Encoder(encoder.tokenizer, state_window=window, state_slack=slack)
    whole = encoder.tokenizer.encode(text, add_special_tokens=False).ids
    ids, dropped = small._state_ids(text, budget)
    assert ids == whole[:budget]
    assert dropped == max(len(whole) - budget, 0)


def test_a_window_cutting_an_added_token_keeps_the_whole_text_tokens(encoder: Encoder) -> None:
    """The case the derandomised CI run found: the window ends inside the third `<|im_end|>`."""
    text = "a's<|im_end|><|im_end|><|im_end|>"
    small = Encoder(encoder.tokenizer, state_window=1, state_slack=3)
    whole = encoder.tokenizer.encode(text, add_special_tokens=False).ids
    assert small._state_ids(text, 5) == (whole[:5], len(whole) - 5)


def test_huge_state_is_cut_quickly(encoder: Encoder) -> None:
    state = "invoice payment overdue " * 400_000  # ~9.6 MB
    encoding = encoder.encode(_request(state), 512)
    assert encoding.length == 512 and encoding.state_truncated
    kept = encoding.state_tokens
    whole = len(encoder.tokenizer.encode(state, add_special_tokens=False).ids)
    assert encoding.truncated_tokens == whole - kept


def test_empty_instruction_span_is_refused(encoder: Encoder) -> None:
    """Validation refuses an empty id without instructions; the encoder never lets an empty
    span through either (the reference answers NaN there)."""
    with pytest.raises(RequestInvalid, match="encodes to no tokens"):
        encoder.encode(_request(**{"": {"type": "noul"}}), 16384)


def test_type_ids_are_the_release_s_and_cover_the_protocol_s_names(tiny_snapshot: Path) -> None:
    """The head's type id of each question type is the model's fact; the protocol only lists the
    names a request may use. Both agree with each other, with the release's own code, and with
    the number of rows of the release head's type embedding."""
    from safetensors import safe_open

    from clef_protocol.validation import QUESTION_TYPES
    from tests.upstream import upstream_module

    assert set(TYPE_IDS) == set(QUESTION_TYPES)
    assert TYPE_IDS == upstream_module().QUESTION_TYPES
    with safe_open(str(tiny_snapshot / "joint_head.safetensors"), framework="pt") as handle:
        rows = handle.get_slice("type_embedding.weight").get_shape()[0]
    assert sorted(TYPE_IDS.values()) == list(range(rows))


def test_budget_refusal_is_the_reference_s(encoder: Encoder, tiny_snapshot: Path) -> None:
    """The encoder's budget refusal is the release's own text, numbers included."""
    from transformers import AutoTokenizer

    from tests.upstream import upstream_module

    request = _request("a state", q={"type": "choice", "instructions": "pick one",
                                     "criteria": {"x": "the first", "y": "the second"}})
    fixed = len(encoder.encode(_request("", **request["questions"]), 16384).input_ids)
    with pytest.raises(RequestInvalid) as ours:
        encoder.encode(request, fixed - 1)
    with pytest.raises(ValueError) as theirs:
        upstream_module().encode_record(AutoTokenizer.from_pretrained(tiny_snapshot), request,
                                        max_length=fixed - 1)
    assert str(ours.value) == str(theirs.value) == BUDGET.format(fixed=fixed, maximum=fixed - 1)
