"""When to draft and how wide: the per-request controller (docs/kimi-k3-drafting-io.md §7.6) and draft counters.

`auto` keeps drafting only while the measured tokens/s of drafting steps beats
the measured tokens/s of target-only steps by a margin; the width starts at a
2-token probe, widens on full matches and narrows on partial ones. It never
affects which tokens are emitted (the verifier alone decides that), only speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyOptions:
    """How a request drafts.

    Args:
        mode: "on" drafts every step the source proposes; "auto" drafts only
            while it measurably pays (see `WidthController`).
        margin: drafting must beat target-only tokens/s by this fraction to stay on.
        min_steps: drafting steps measured before `auto` judges them.
        backoff_tokens: tokens decoded target-only before `auto` probes again
            (doubles after each failed probe).
    """

    mode: str = "auto"
    max_width: int = 7
    probe_width: int = 2
    margin: float = 0.10
    min_steps: int = 3
    backoff_tokens: int = 16

    def __post_init__(self) -> None:
        if self.mode not in ("on", "auto"):
            raise ValueError(f"draft policy mode must be 'on' or 'auto' (got {self.mode!r})")
        if self.max_width < 1:
            raise ValueError(f"draft max_width must be >= 1 (got {self.max_width})")


@dataclass
class DraftStats:
    """Counters of one request, or summed over many (`add`)."""

    steps: int = 0  # verify passes that carried a proposal
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by those passes (accepted + the target's own)
    draft_s: float = 0.0
    verify_s: float = 0.0
    saved_s: float = 0.0  # estimated: emitted x target-only seconds/token - (draft + verify) time
    failures: int = 0
    source: str = ""
    widths: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def add(self, other: DraftStats) -> None:
        for name in (
            "steps",
            "proposed",
            "accepted",
            "emitted",
            "draft_s",
            "verify_s",
            "saved_s",
            "failures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for w, n in other.widths.items():
            self.widths[w] = self.widths.get(w, 0) + n
        self.source = self.source or other.source

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "source": self.source,
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "emitted": self.emitted,
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "saved_s": round(self.saved_s, 4),
            "failures": self.failures,
        }


class WidthController:
    """One request's draft width: 0 = decode target-only this step."""

    EMA = 0.3  # weight of the newest step in the running means

    def __init__(self, opts: PolicyOptions) -> None:
        self.opts = opts
        self.width = min(opts.probe_width, opts.max_width)
        self.qualified = opts.mode == "on"
        self.target_s: float | None = (
            None  # mean seconds of a target-only step (it emits one token)
        )
        self.spec_tokens = 0.0  # means over drafting steps: tokens emitted, seconds taken
        self.spec_s = 0.0
        self.spec_steps = 0
        self.off_until = 0  # while generated < off_until, auto decodes target-only
        self.backoff = opts.backoff_tokens

    def next_width(self, generated: int) -> int:
        """Draft width for the step after `generated` tokens."""
        if self.opts.mode == "auto" and (self.target_s is None or generated < self.off_until):
            return 0  # measure the target alone first; or backing off
        return self.width

    def record_target(self, seconds: float) -> None:
        """A target-only step (one token) took `seconds`."""
        a = self.EMA
        self.target_s = seconds if self.target_s is None else (1 - a) * self.target_s + a * seconds

    def record_spec(
        self, proposed: int, accepted: int, emitted: int, seconds: float, generated: int
    ) -> None:
        """A drafting step (draft + verify) took `seconds` and emitted `emitted` tokens."""
        a, o = self.EMA, self.opts
        if self.spec_steps == 0:
            self.spec_tokens, self.spec_s = float(emitted), seconds
        else:
            self.spec_tokens = (1 - a) * self.spec_tokens + a * emitted
            self.spec_s = (1 - a) * self.spec_s + a * seconds
        self.spec_steps += 1
        if o.mode == "auto" and self.target_s is not None and self.spec_steps >= o.min_steps:
            self.qualified = self.spec_tokens / self.spec_s > (1 + o.margin) / self.target_s
            if not self.qualified:
                self._back_off(generated)
                return
            self.backoff = o.backoff_tokens  # a probe that pays resets the back-off
        probe = min(o.probe_width, o.max_width)
        if proposed and accepted == proposed:
            self.width = o.max_width if self.qualified else probe
        elif accepted:
            self.width = max(probe, min(o.max_width, 2 * accepted))
        else:
            self.width = probe
            if o.mode == "auto" and proposed and not self.qualified:
                self._back_off(
                    generated
                )  # docs/kimi-k3-drafting-io.md §7.6: nothing accepted turns drafting off (here: for a while)

    def _back_off(self, generated: int) -> None:
        self.off_until = generated + self.backoff
        self.backoff *= 2
        self.width = min(self.opts.probe_width, self.opts.max_width)
        self.spec_steps = 0
        self.qualified = False
