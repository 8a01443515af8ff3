"""The one exact verifier: a draft proposes, the target decides, output never changes.

The engine core (engine/core.py) plans, runs and updates drafting steps; this
module holds the acceptance rule and each request's `Drafter`. Each drafting step runs `[pending, d1 .. dk]` through the target in one pass
(k+1 rows, so each expert is read once for all of them), accepts a prefix of
the proposal by the rule below, emits that prefix plus one token of the
target's own, and truncates the cache back to exactly what was emitted.

- Greedy: accept while `argmax(row i) == d_{i+1}`; then the target's argmax.
- Sampling: standard speculative rejection sampling (Leviathan et al. 2023,
  Chen et al. 2023). With the draft's distribution q: accept d with
  probability min(1, p(d)/q(d)), else draw from normalised max(p - q, 0). A
  deterministic proposal (q None) is the one-hot q: accept with probability
  p(d), else draw from p with d removed. Either way each emitted token follows
  the target's distribution p exactly (p = `sampling_probs`, the sampler's own).

A draft that raises (any error, out-of-memory included) is logged and the
request goes on target-only. Token ids only; knows nothing of text or HTTP.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from deltafind.engine.draft.base import DraftError, DraftSession, DraftSource, Proposal
from deltafind.engine.draft.policy import DraftStats, PolicyOptions, WidthController
from deltafind.engine.sampler import SamplingParams, greedy_tokens, sampling_probs
from deltafind.log import get_logger
from deltafind.models.ops.batch import SequenceCache

log = get_logger(__name__)


def accept(
    logits: torch.Tensor,
    tokens: Sequence[int],
    q: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens to emit for target `logits` [k+1, V] over `[pending, *tokens]`: accepted drafts + one.

    `q` [k, V] is the draft's distribution for each proposed token (None: deterministic).
    """
    k = len(tokens)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    if params.temperature == 0.0:
        best = greedy_tokens(logits)  # [k+1]; ties resolve as the sampler's do
        out: list[int] = []
        for i, d in enumerate(tokens):
            if best[i] != d:
                break
            out.append(d)
        out.append(best[len(out)])
        return out
    out = []
    for i, d in enumerate(tokens):
        p = sampling_probs(logits[i], params)  # [V]
        qi = None if q is None else q[i].float().cpu()
        if qi is not None and not float(qi[d]) > 0.0:
            qi = None  # d could not have been drawn from q: take the proposal as deterministic
        u = float(torch.rand((), generator=generator))
        if u < min(1.0, float(p[d]) / (1.0 if qi is None else float(qi[d]))):
            out.append(d)
            continue
        if qi is None:  # one-hot q: the residual max(p - q, 0) is p without d
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - qi, min=0.0)
        total = float(residual.sum())
        # A rejection implies p(d) < q(d), so the residual has mass; guard the rounding case.
        residual = residual / total if total > 0.0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    p = sampling_probs(logits[k], params)
    out.append(int(torch.multinomial(p, 1, generator=generator)))
    return out


def captured_rows(
    batch: Any, layers: Sequence[int], rows: slice | torch.Tensor
) -> torch.Tensor | None:
    """`batch.captured` (a Batch's, or a StepOutput's) as [n, len(layers) * H] for flat `rows`, in `layers` order."""
    if not layers:
        return None
    return torch.cat([batch.captured[layer][rows] for layer in layers], dim=-1)


class Drafter:
    """One request's drafting: its session, width controller, counters and fallback.

    Every call into the source goes through here, so a failure anywhere turns
    drafting off for this request (with a log line) instead of failing it.
    """

    def __init__(
        self,
        source: DraftSource,
        prompt_ids: Sequence[int],
        options: PolicyOptions,
        stats: DraftStats | None = None,
        request_id: str = "",
        vocab_size: int | None = None,
    ) -> None:
        self.source, self.options, self.request_id, self.vocab_size = (
            source,
            options,
            request_id,
            vocab_size,
        )
        self.stats = stats if stats is not None else DraftStats()
        self.stats.source = source.name
        self.control = WidthController(options)
        self.capture_layers = tuple(source.capture_layers)
        self.session: DraftSession | None = None
        self._cache: SequenceCache | None = None
        self._pending_capture: list[torch.Tensor] = []
        try:
            self.session = source.session(prompt_ids)
        except Exception as e:  # any draft failure falls back to target-only
            self._fail("session", e)

    @property
    def active(self) -> bool:
        return self.session is not None

    def use_target_cache(self, cache: SequenceCache) -> None:
        self._cache = cache
        attach = getattr(self.session, "use_target_cache", None)
        if attach is not None:
            self._guard("use_target_cache", attach, cache)

    def width(self, generated: int) -> int:
        return self.control.next_width(generated) if self.session is not None else 0

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal | None:
        """Up to `width` checked tokens, or None (decode target-only this step)."""
        if self.session is None or width <= 0:
            return None
        length = self._cache.length if self._cache is not None else None
        t0 = time.perf_counter()
        prop = self._guard("propose", self.session.propose, history, width, params, generator)
        if self._cache is not None and length is not None and self._cache.length != length:
            # a source must leave the target's cache as it found it; restore and stop trusting it
            self._cache.truncate(min(length, self._cache.length))
            self._fail(
                "propose",
                DraftError(
                    f"the draft left the target cache at {self._cache.length}, not {length}"
                ),
            )
            return None
        self.stats.draft_s += time.perf_counter() - t0
        if prop is None or not prop.tokens:
            return None
        try:
            self._check(prop, width, params)
        except DraftError as e:
            self._fail("propose", e)
            return None
        return prop

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        if self.session is not None:
            if self.capture_layers and captured is None:
                return
            if self._pending_capture and captured is not None:
                captured = torch.cat([*self._pending_capture, captured])
                self._pending_capture = []
            self._guard("commit", self.session.commit, history, captured)

    def hold_capture(self, captured: torch.Tensor | None) -> None:
        """Keep prefill-chunk rows until the first `commit` (chunked prefill)."""
        if self.session is not None and captured is not None:
            self._pending_capture.append(captured)

    def record(self, prop: Proposal | None, emitted: int, seconds: float, generated: int) -> None:
        """Feed one step's outcome to the controller and the counters."""
        c, st = self.control, self.stats
        if prop is None:
            c.record_target(seconds)
            return
        k = len(prop.tokens)
        accepted = min(emitted - 1, k) if emitted else 0
        st.steps += 1
        st.proposed += k
        st.accepted += accepted
        st.emitted += emitted
        st.widths[k] = st.widths.get(k, 0) + 1
        if c.target_s is not None:
            st.saved_s += emitted * c.target_s - seconds
        c.record_spec(k, accepted, emitted, seconds, generated)

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            try:
                session.close()
            except Exception as e:
                log.warning(
                    "draft_close_failed", source=self.source.name, error=f"{type(e).__name__}: {e}"
                )

    def _check(self, prop: Proposal, width: int, params: SamplingParams) -> None:
        k = len(prop.tokens)
        if k > width:
            raise DraftError(f"proposed {k} tokens for width {width}")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in prop.tokens):
            raise DraftError(
                f"proposed a token outside the target's vocabulary of {self.vocab_size}"
            )
        q = prop.q
        if (
            q is not None
            and params.temperature > 0.0
            and (
                q.dim() != 2
                or q.shape[0] != k
                or (self.vocab_size is not None and q.shape[1] != self.vocab_size)
            )
        ):
            raise DraftError(
                f"q has shape {tuple(prop.q.shape)}, expected [{k}, {self.vocab_size}]"
            )

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # the request goes on target-only
            self._fail(what, e)
            return None

    def _fail(self, what: str, e: BaseException) -> None:
        self.stats.failures += 1
        log.warning(
            "draft_failed",
            source=self.source.name,
            during=what,
            error=f"{type(e).__name__}: {e}",
            request_id=self.request_id or None,
            fallback="target_only",
        )
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
