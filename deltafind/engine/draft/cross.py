"""Cross-tokenizer drafts (docs/kimi-k3-drafting-io.md §7.7): a small model with its own vocabulary drafts through text.

Each step: decode the target history to text and check that re-encoding gives
the same ids (else nothing is proposed); encode the text with the draft's
tokenizer; draft greedily, keeping each token's probability; cut at the first
unsure token; decode, re-encode with the target, and propose the target ids
past the history, provided the history is a prefix of that encoding.

Where it lives: the engine speaks ids, text lives in `deltafind/tokenizer`. A
translation needs both tokenizers, so this module takes each one as a
`TextCodec` (two callables, text <-> ids) injected by the wiring
(`deltafind.api.open_cross_draft`, reached from `--draft cross:STORE[,WIDE]`
through draft/load.py's `open_cross`); engine never imports tokenizer, and the
codecs are plain functions the tests can build from any tokenizer. The draft
model is any family's net (`deltafind.api.Model.net`), run with its own cache.

Raw completions only (`raw_only = True`): chat turns are DSpark's; whoever
starts drafting for a request must not use this source for a chat request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltafind.engine.draft.base import DraftError, Proposal
from deltafind.engine.sampler import SamplingParams, greedy_tokens
from deltafind.log import get_logger
from deltafind.models.ops.batch import SequenceCache, forward_step

log = get_logger(__name__)

CONFIDENCE_CUT = 0.3  # docs/kimi-k3-drafting-io.md §7.7: with more than 2 drafts asked, stop at the first token below this
HYBRID_MARGIN = 0.02  # docs/kimi-k3-drafting-io.md §7.7: the wide model wins only if its minimum confidence is this much higher
MIN_BUDGET, MAX_BUDGET = 3, 20
DECODE_WINDOW = (
    8  # draft-prefix tokens decoded with the drafted ones, so leading-space and BOS rules match
)


@dataclass(frozen=True)
class TextCodec:
    """One tokenizer as two callables, so the engine never imports `deltafind.tokenizer`.

    `encode` must be the encoding the sequence's ids were made with (for the target:
    the raw prompt's, without BOS); `bos_id`, if a history starts with it, is set
    aside before decoding and put back after encoding.
    """

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    bos_id: int | None = None


@dataclass
class CrossDraftModel:
    """A draft model and its tokenizer. `net` is a deltafind family model (CausalLM-like)."""

    net: torch.nn.Module
    codec: TextCodec
    eos_ids: frozenset[int] = frozenset()
    max_context: int = 8192  # draft tokens; past it the source proposes nothing


def draft_budget(width: int) -> int:
    """Draft tokens generated for `width` requested target tokens: clamp(width + 2, 3, 20)."""
    return max(MIN_BUDGET, min(MAX_BUDGET, width + 2))


def confidence_cut(probs: Sequence[float], width: int) -> int:
    """How many draft tokens survive the cut: all when width <= 2, else those before the first p < 0.3."""
    if width <= 2:
        return len(probs)
    for i, p in enumerate(probs):
        if p < CONFIDENCE_CUT:
            return i
    return len(probs)


@dataclass
class _Run:
    """One greedy draft after `prefix` (draft ids): tokens and their softmax probabilities."""

    model_idx: int
    prefix: list[int]
    tokens: list[int]
    probs: list[float]
    kept: int  # tokens left after the confidence cut

    @property
    def min_confidence(self) -> float:
        return min(self.probs[: self.kept], default=0.0)


@dataclass
class _DraftCache:
    """A draft model's KV cache for one sequence and the draft ids it holds, reused by common prefix."""

    cache: SequenceCache
    ids: list[int] = field(default_factory=list)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CrossSession:
    """One sequence's cross-tokenizer drafting: a cache per draft model, reused across steps."""

    def __init__(self, source: CrossTokenizerSource) -> None:
        self.source = source
        self._caches = [_DraftCache(SequenceCache(m.net.num_layers)) for m in source.models]
        # Draft positions computed per model: prefix reuse keeps each step near the budget, not the context.
        self.positions_run = [0] * len(source.models)

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if width <= 0 or not history:
            return Proposal([])
        target = self.source.target
        body = list(history)
        if target.bos_id is not None and body[0] == target.bos_id:
            body = body[1:]  # BOS is no text; the proposal follows the history either way
        text = target.decode(body)
        if target.encode(text) != body:  # the history does not round-trip: nothing to translate
            return Proposal([])
        try:
            tokens = self._hybrid(text, body, width)
        except (RuntimeError, ValueError, IndexError) as e:
            raise DraftError(f"{self.source.name}: draft failed: {e}") from e
        return Proposal(tokens)

    def _hybrid(self, text: str, body: list[int], width: int) -> list[int]:
        """The probe-then-wide rule (docs/kimi-k3-drafting-io.md §7.7); with one model, its cut proposal."""
        probe = self._draft(0, text, width)
        if probe is None:
            return []
        cut = self._translate(text, body, probe, probe.kept, width)
        if len(cut) == width:
            return cut
        raw = (
            cut
            if probe.kept == len(probe.tokens)
            else self._translate(text, body, probe, len(probe.tokens), width)
        )
        if probe.kept >= 3 and len(raw) == width:
            return raw
        if len(self.source.models) < 2:
            return cut
        wide = self._draft(1, text, width)
        if wide is None:
            return cut
        wide_raw = self._translate(text, body, wide, len(wide.tokens), width)
        if len(raw) == width and raw == wide_raw:
            return raw
        wide_cut = (
            wide_raw
            if wide.kept == len(wide.tokens)
            else self._translate(text, body, wide, wide.kept, width)
        )
        if wide_cut and wide.min_confidence > probe.min_confidence + HYBRID_MARGIN:
            return wide_cut
        return cut

    def _draft(self, idx: int, text: str, width: int) -> _Run | None:
        """Greedy draft with model `idx` after `text`, reusing its cache by longest common prefix."""
        model, slot = self.source.models[idx], self._caches[idx]
        prefix = model.codec.encode(text)
        budget = draft_budget(width)
        if not prefix or len(prefix) + budget > model.max_context:
            return None
        keep = min(
            _common_prefix(slot.ids, prefix), len(prefix) - 1
        )  # rerun >= 1 token to get logits
        try:
            slot.cache.truncate(keep)
        # a recurrent state (KDA) rolls back only inside its last pass
        except (
            NotImplementedError,
            ValueError,
        ):
            slot.cache, keep = SequenceCache(model.net.num_layers), 0
        tokens: list[int] = []
        probs: list[float] = []
        with torch.inference_mode():
            logits = forward_step(model.net, slot.cache, prefix[keep:])[-1]  # [V]
            self.positions_run[idx] += len(prefix) - keep
            while True:
                p = torch.softmax(logits.float(), dim=-1)
                tok = greedy_tokens(p)[0]
                if tok in model.eos_ids:
                    break
                tokens.append(tok)
                probs.append(float(p[tok]))
                if len(tokens) == budget:
                    break
                logits = forward_step(model.net, slot.cache, [tok])[-1]
                self.positions_run[idx] += 1
        slot.ids = (prefix + tokens)[: slot.cache.length]
        return _Run(idx, prefix, tokens, probs, confidence_cut(probs, width))

    def _translate(self, text: str, body: list[int], run: _Run, n: int, width: int) -> list[int]:
        """Target ids past `body` for `text` + the first `n` drafted tokens' text (at most `width`)."""
        if n == 0:
            return []
        codec = self.source.models[run.model_idx].codec
        tail = run.prefix[-DECODE_WINDOW:]
        before, after = codec.decode(tail), codec.decode(tail + run.tokens[:n])
        if not after.startswith(before):
            return []
        # Bytes that are no UTF-8 (a character cut at the draft's end, or draft noise) are no text to propose.
        delta = after[len(before) :].split("\ufffd", 1)[0]
        if not delta:
            return []
        ids = self.source.target.encode(text + delta)
        # the draft text re-tokenizes across the history's last boundary
        if ids[: len(body)] != body:
            return []
        return ids[len(body) : len(body) + width]

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        """Nothing to do: the next `propose` re-encodes and reuses the cache by common prefix."""

    def close(self) -> None:
        self._caches = []


class CrossTokenizerSource:
    """Drafts through text with one model, or docs/kimi-k3-drafting-io.md §7.7's probe + wide pair (models[0], models[1])."""

    capture_layers: tuple[int, ...] = ()
    raw_only = True  # never for chat requests (docs/kimi-k3-drafting-io.md §7.7): the policy must check this

    def __init__(
        self,
        target: TextCodec,
        models: Sequence[CrossDraftModel],
        name: str = "cross",
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """`closers` release what the wiring opened for the drafts (their stores), on `close`."""
        if not 1 <= len(models) <= 2:
            raise ValueError(
                f"a cross-tokenizer source takes a draft model or a probe + wide pair (got {len(models)})"
            )
        self.target, self.models, self.name = target, list(models), name
        self._closers = list(closers)

    def session(self, prompt_ids: Sequence[int]) -> CrossSession:
        return CrossSession(self)

    def close(self) -> None:
        self.models = []
        closers, self._closers = self._closers, []
        for close in closers:
            close()
