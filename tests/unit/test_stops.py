"""StopMatcher: streamed text is cut exactly at the first stop string, however it is chunked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deltafind.tokenizer import StopMatcher


def _expected(text: str, stops: list[str]) -> tuple[str, bool]:
    # Brute force: grow the text a character at a time (what a token-by-token check sees);
    # at the first length where some stop ends, cut before the earliest-starting one.
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def _run(chunks: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    pieces, hit = [], False
    for chunk in chunks:
        out, hit = matcher.push(chunk)
        pieces.append(out)
        if hit:
            break
    pieces.append(matcher.flush())
    return "".join(pieces), hit, pieces


ALPHABET = "ab\n😀é"


@st.composite
def _case(draw):
    text = draw(st.text(ALPHABET, max_size=40))
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return text, stops, chunks


@settings(max_examples=400, deadline=None)
@given(_case())
def test_emitted_text_is_text_before_first_stop(case) -> None:
    text, stops, chunks = case
    emitted, hit, _ = _run(chunks, stops)
    assert (emitted, hit) == _expected(text, stops)
    assert not any(s in emitted for s in stops)


@settings(max_examples=200, deadline=None)
@given(_case())
def test_holds_back_only_possible_stop_prefixes(case) -> None:
    _, stops, chunks = case
    matcher = StopMatcher(stops)
    fed = sent = ""
    longest = max((len(s) for s in stops), default=0)
    for chunk in chunks:
        out, hit = matcher.push(chunk)
        if hit:
            return
        fed, sent = fed + chunk, sent + out
        held = fed[len(sent) :]
        assert fed.startswith(sent)
        assert len(held) <= max(longest - 1, 0)
        assert not held or any(s.startswith(held) for s in stops)


def test_examples() -> None:
    assert _run(["Hello wor", "ld. STOP", " more"], ["STOP"])[:2] == ("Hello world. ", True)
    assert _run(["ab", "cd"], ["abcd", "bc"])[:2] == ("a", True)  # "bc" ends first
    assert _run(["xabc"], ["bc", "abc"])[:2] == ("x", True)  # same end: earliest start
    assert _run(["<|e", "nd", "|>tail"], ["<|end|>"])[:2] == ("", True)
    assert _run(["no stop here <|e"], ["<|end|>"])[:2] == (
        "no stop here <|e",
        False,
    )  # flushed at the end
    text, hit, pieces = _run(["abc <", "|x"], ["<|end|>"])
    assert (text, hit, pieces) == ("abc <|x", False, ["abc ", "<|x", ""])
    assert _run(["anything"], [])[:2] == ("anything", False)
    assert _run(["anything"], [""])[:2] == ("anything", False)  # empty stops are ignored


def test_after_a_hit_nothing_more_comes_out() -> None:
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("one\n") == ("one", False)
    assert matcher.push("\ntwo") == ("", True)
    assert matcher.hit == "\n\n" and matcher.stopped
    assert matcher.push("three") == ("", True)
    assert matcher.flush() == ""
