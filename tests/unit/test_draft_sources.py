"""Draft sources and policy on their own: n-gram lookup against a brute-force reading of the
rule, the width controller against docs/kimi-k3-drafting-io.md §7.6, and building sources from --draft / [draft]."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from deltafind.engine.draft.base import DraftError
from deltafind.engine.draft.load import (
    admit_store,
    check_same_vocab,
    make_draft_source,
    source_from_settings,
)
from deltafind.engine.draft.ngram import NgramSession, NgramSource
from deltafind.engine.draft.policy import PolicyOptions, WidthController
from deltafind.engine.draft.self_draft import SelfDraftSource
from deltafind.engine.sampler import SamplingParams
from deltafind.models.contract import FamilyModel

G = SamplingParams()


def reference_ngram(history: list[int], width: int) -> list[int]:
    """The rule as written: the longest suffix (6 down to 2 tokens) that also occurs earlier,
    its most recent earlier occurrence, and up to `width` tokens that followed it."""
    h = len(history)
    for n in range(min(6, h - 1), 1, -1):
        suffix = history[h - n :]
        for start in range(h - n - 1, -1, -1):  # occurrences ending before the last token
            if history[start : start + n] == suffix:
                end = start + n - 1
                return history[end + 1 : min(end + 1 + width, h)]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 7))
def test_ngram_matches_the_brute_force_rule(history: list[int], width: int) -> None:
    session = NgramSession()
    # grow the history step by step, as decoding does, asking at every step
    for i in range(1, len(history) + 1):
        got = session.propose(history[:i], width, G, None).tokens
        assert got == reference_ngram(history[:i], width), (history[:i], width)


def test_ngram_restarts_on_an_unrelated_history() -> None:
    s = NgramSession()
    assert s.propose([1, 2, 3, 1, 2], 3, G, None).tokens == [3, 1, 2]
    assert s.propose([7, 8, 7], 3, G, None).tokens == []
    assert s.propose([7, 8, 9, 7, 8], 2, G, None).tokens == [9, 7]


# -- width policy (docs/kimi-k3-drafting-io.md §7.6) -------------------------------------------------------


def test_width_rule_of_spec_7_6_when_qualified() -> None:
    c = WidthController(PolicyOptions(mode="on", max_width=7))
    assert c.next_width(0) == 2  # the probe
    c.record_spec(2, 2, 3, 0.1, 1)
    assert c.next_width(3) == 7  # full match, qualified: the widest
    c.record_spec(7, 3, 4, 0.1, 4)
    assert c.next_width(8) == 6  # partial, a = 3: max(2, min(7, 2a))
    c.record_spec(6, 1, 2, 0.1, 10)
    assert c.next_width(12) == 2
    c.record_spec(2, 0, 1, 0.1, 12)
    assert c.next_width(13) == 2  # "on" never turns off


def test_auto_measures_the_target_first_and_stays_on_only_while_it_pays() -> None:
    c = WidthController(PolicyOptions(mode="auto", max_width=7, min_steps=3, backoff_tokens=16))
    assert c.next_width(1) == 0  # no target-only measurement yet
    c.record_target(0.10)
    assert c.next_width(2) == 2
    for g in (3, 6, 9):  # 3 tokens per 0.12 s beats 1 per 0.10 s by far: qualified, widens
        c.record_spec(2, 2, 3, 0.12, g)
    assert c.qualified and c.next_width(12) == 7
    for g in (20, 22, 24, 26):  # now 1 token per 0.2 s: slower than target-only, backs off
        c.record_spec(7, 1, 1, 0.20, g)
        if c.next_width(g) == 0:
            break
    assert not c.qualified and c.next_width(g) == 0 and c.next_width(g + 16) == 2


def test_auto_turns_off_after_a_probe_that_accepts_nothing_then_probes_again_later() -> None:
    c = WidthController(PolicyOptions(mode="auto", backoff_tokens=8))
    c.record_target(0.1)
    c.record_spec(2, 0, 1, 0.1, 5)
    assert c.next_width(6) == 0 and c.next_width(13) == 2
    c.record_spec(2, 0, 1, 0.1, 13)
    assert c.next_width(28) == 0 and c.next_width(29) == 2  # the back-off doubled


# -- building sources ----------------------------------------------------------------


class _Net(FamilyModel):
    """Stands in for a model only where a source inspects it (its head's vocabulary size)."""

    layer_prefix = False  # not a layer-skip model

    def __init__(self, vocab: int = 300) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(4, vocab, bias=False)

    def forward(self, input_ids, batch, all_logits=False):  # no num_layers: not a layer-skip model
        raise NotImplementedError


def test_make_draft_source_names_and_errors(tmp_path: Path) -> None:
    net = _Net()
    assert make_draft_source("off", net) == (None, "off")
    src, mode = make_draft_source("ngram", net)
    assert isinstance(src, NgramSource) and mode == "on"
    src, mode = make_draft_source("auto", net, target_store=tmp_path)
    assert isinstance(src, NgramSource) and mode == "auto"  # no DSpark in this store
    with pytest.raises(DraftError, match="runs a layer prefix"):
        make_draft_source("self", net)
    with pytest.raises(DraftError, match="expected off, auto"):
        make_draft_source("bogus", net)
    with pytest.raises(DraftError, match="not a deltafind store"):
        make_draft_source(str(tmp_path), net, open_store=lambda p: net)
    with pytest.raises(DraftError, match="layer count"):
        make_draft_source("self:x", net)


def test_memory_admission_refuses_a_draft_that_does_not_fit(tmp_path: Path) -> None:
    (tmp_path / "spine.safetensors").write_bytes(b"\0" * 1000)
    assert admit_store(tmp_path, available=10_000) == 1000
    with capture_logs() as logs, pytest.raises(DraftError, match="needs 0 MiB and 0 MiB"):
        admit_store(tmp_path, available=1050)  # fits, but not with the reserve kept free
    assert logs[0]["event"] == "draft_refused" and logs[0]["spine_bytes"] == 1000


def test_a_store_draft_with_other_token_ids_is_refused(tmp_path: Path) -> None:
    import json

    for name, vocab in (("t", {"a": 0, "b": 1}), ("d", {"a": 1, "b": 0})):
        (tmp_path / name / "tokenizer").mkdir(parents=True)
        (tmp_path / name / "tokenizer" / "tokenizer.json").write_text(
            json.dumps({"model": {"vocab": vocab}, "added_tokens": []})
        )
    check_same_vocab(tmp_path / "t", tmp_path / "t")
    with pytest.raises(DraftError, match="other ids"):
        check_same_vocab(tmp_path / "d", tmp_path / "t")


def test_draft_settings_on_fails_auto_goes_on_without(tmp_path: Path) -> None:
    net = _Net()
    on = SimpleNamespace(mode="on", source="self", max_width=5)
    with pytest.raises(DraftError):
        source_from_settings(on, net)
    auto = SimpleNamespace(mode="auto", source="self", max_width=5)
    with capture_logs() as logs:
        src, policy = source_from_settings(auto, net)
    assert src is None and logs[0]["event"] == "draft_unavailable"
    src, policy = source_from_settings(
        SimpleNamespace(mode="auto", source="auto", max_width=4), net, target_store=tmp_path
    )
    assert isinstance(src, NgramSource) and policy.mode == "auto" and policy.max_width == 4
    assert (
        source_from_settings(SimpleNamespace(mode="off", source="auto", max_width=7), net)[0]
        is None
    )


def test_self_draft_refuses_a_depth_it_cannot_run() -> None:
    class Deep(_Net):
        num_layers, layer_prefix = 4, True

        def forward(self, input_ids, batch, all_logits=False, num_layers=None):
            raise NotImplementedError

    with pytest.raises(DraftError, match=r"1\.\.3"):
        SelfDraftSource(Deep(), 4)
    assert SelfDraftSource(Deep()).num_layers == 3
