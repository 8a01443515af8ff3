"""A small model from another store drafts for the target (same token ids, any family).

The draft keeps its own cache per sequence. Each proposal first catches its
cache up to the history (reusing every position whose tokens still agree,
its own earlier drafts included), then runs one token at a time. Opening the
store (and the memory check before it) is the wiring's job (draft/load.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafind.engine.draft.base import DraftError, Proposal, draw
from deltafind.engine.sampler import SamplingParams
from deltafind.models.ops.batch import Batch, SequenceCache


class StoreDraftSession:
    def __init__(self, net: torch.nn.Module, vocab_size: int, max_positions: int | None) -> None:
        self.net, self.vocab_size, self.max_positions = net, vocab_size, max_positions
        self.cache = SequenceCache(net.num_layers)
        self.seen: list[int] = []  # the tokens whose positions `cache` holds
        self.device = net.device

    def _run(self, ids: Sequence[int]) -> torch.Tensor:
        batch = Batch.of([(self.cache, len(ids))], device=self.device)
        logits = self.net(torch.tensor(list(ids), dtype=torch.long, device=self.device), batch)[
            0
        ]  # [V_draft]
        self.seen.extend(ids)
        return logits[: self.vocab_size]  # a draft with spare rows proposes only the target's ids

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if self.max_positions is not None and len(history) + width > self.max_positions:
            return Proposal([])  # past the draft's context: the target continues alone
        keep = 0
        for a, b in zip(self.seen, history, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(history) - 1)  # the last history token must run: its logits propose d1
        if keep < self.cache.length:
            self.cache.truncate(keep)
            del self.seen[keep:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        with torch.inference_mode():
            logits = self._run(history[keep:])
            for j in range(width):
                token, q = draw(logits, params, generator)
                tokens.append(token)
                if q is not None:
                    qs.append(q)
                if j + 1 < width:
                    logits = self._run([token])
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        pass  # the next propose reuses what agrees with the new history

    def close(self) -> None:
        self.cache = SequenceCache(0)
        self.seen = []


class StoreDraftSource:
    """Drafts with `net`, a model opened from another store that shares the target's token ids."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, net: torch.nn.Module, name: str, target_vocab_size: int) -> None:
        draft_vocab = net.vocab_size
        if draft_vocab < target_vocab_size:
            raise DraftError(
                f"{name}: the draft's vocabulary ({draft_vocab}) is smaller than the target's "
                f"({target_vocab_size}); a same-tokenizer draft must share the target's token ids"
            )
        self.net, self.name, self.vocab_size = net, name, target_vocab_size
        self.max_positions = getattr(getattr(net, "args", None), "max_position_embeddings", None)

    def session(self, prompt_ids: Sequence[int]) -> StoreDraftSession:
        return StoreDraftSession(self.net, self.vocab_size, self.max_positions)

    def close(self) -> None:
        pass
