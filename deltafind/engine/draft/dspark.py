"""The DSpark draft source for Kimi K3 (docs/kimi-k3-drafting-io.md §7.3-7.6): block proposals from K3's own hidden states.

The target captures its carried hidden after DSpark's five target layers; each
session turns the committed positions' rows into its context cache and proposes
1..7 tokens per step as a greedy Markov chain (a deterministic proposal: q is
None, so the verifier's deterministic form keeps sampling exact). Past
`max_context` committed positions the session stops and K3 continues alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from deltafind.engine.draft.base import DraftError, Proposal
from deltafind.engine.sampler import SamplingParams
from deltafind.log import get_logger
from deltafind.models import dspark
from deltafind.store.dspark import load_dspark

log = get_logger(__name__)
K3_DSPARK_MAX_CONTEXT = (
    8192  # docs/kimi-k3-drafting-io.md §7.6: committed positions DSpark drafts over
)


class DSparkSession:
    """One sequence's DSpark context: rows for exactly the positions the target committed."""

    def __init__(self, model: dspark.Model, max_context: int) -> None:
        self.model, self.max_context = model, max_context
        self.ctx: dspark.Context | None = model.new_context()
        self.last_confidence: torch.Tensor | None = (
            None  # computed per docs/kimi-k3-drafting-io.md §7.4.5; no controller reads it
        )

    @property
    def stopped(self) -> bool:
        return self.ctx is None

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        ctx = self.ctx
        if ctx is None or width <= 0:
            return Proposal([])
        committed = len(history) - 1  # history[-1] is the pending token
        if ctx.length != committed:
            raise DraftError(
                f"DSpark context holds {ctx.length} rows but the target committed {committed} positions"
            )
        with torch.inference_mode():
            draft = self.model.propose(ctx, int(history[-1]), min(width, dspark.BLOCK))
        self.last_confidence = draft.confidence
        return Proposal(draft.tokens)

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        """Add the target's rows for the committed inputs [pending, accepted drafts]; roll back first if the target did."""
        ctx = self.ctx
        if ctx is None:
            return
        committed = len(history) - 1
        if captured is None:
            raise DraftError("DSpark needs the target's captured rows; the verifier passed none")
        if ctx.length > committed:
            ctx.truncate(committed)  # the target cut back past rows we already hold
        need = committed - ctx.length
        if need <= 0:
            return
        if captured.shape[0] < need:
            raise DraftError(
                f"DSpark got {captured.shape[0]} captured rows for {need} newly committed positions"
            )
        if committed > self.max_context:
            log.info("dspark_context_limit", positions=committed, limit=self.max_context)
            self.ctx = None  # past the limit K3 continues alone (docs/kimi-k3-drafting-io.md §7.6); free the context
            return
        with torch.inference_mode():
            self.model.extend(ctx, captured[-need:])  # [need, 5 * H]

    def close(self) -> None:
        self.ctx = None


class DSparkSource:
    """DSpark for one K3 model; `capture_layers` = the checkpoint's `target_layer_ids`."""

    name = "dspark"

    def __init__(self, model: dspark.Model, max_context: int = K3_DSPARK_MAX_CONTEXT) -> None:
        self.model, self.max_context = model, max_context
        self.capture_layers: tuple[int, ...] = tuple(model.args.target_layer_ids)

    @classmethod
    def open(
        cls, store: str | Path, target: torch.nn.Module, max_context: int = K3_DSPARK_MAX_CONTEXT
    ) -> DSparkSource:
        """Load `<store>/draft/dspark` for the K3 `target` (its embedding and lm_head are shared, not copied)."""
        cfg, tensors = load_dspark(store)
        args = dspark.ModelArgs.from_config(cfg)
        with torch.device("meta"):
            model = dspark.Model(args)
        model.load_state_dict(
            {n: t.to(target.device) for n, t in tensors.items()}, strict=True, assign=True
        )
        model.eval()
        source = cls(model, max_context)
        source.check_target(target)
        model.attach(target.embed_tokens.weight, target.lm_head)
        return source

    def check_target(self, net: torch.nn.Module) -> None:
        args = getattr(net, "args", None)
        a = self.model.args
        if getattr(args, "attn_res_block_size", None) is None:
            raise DraftError("DSpark drafts only for Kimi K3")
        if (args.hidden_size, args.vocab_size) != (a.target_hidden_size, a.vocab_size):
            raise DraftError(
                f"DSpark was made for hidden {a.target_hidden_size} / vocab {a.vocab_size}, "
                f"the target has {args.hidden_size} / {args.vocab_size}"
            )
        if max(a.target_layer_ids) >= net.num_layers:
            raise DraftError(
                f"DSpark reads layers {list(a.target_layer_ids)}, the target has {net.num_layers}"
            )

    def session(self, prompt_ids: Sequence[int]) -> DSparkSession:
        return DSparkSession(self.model, self.max_context)

    def close(self) -> None:
        pass
