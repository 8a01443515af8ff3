"""Turn-over-turn token reuse: a prompt that repeats an earlier answer gets that answer's own token ids.

A model may spell its output in tokens that re-encoding the same text would not
choose (a constrained `"}` `}` where BPE says `"` `}}`). A client sends the answer
back as text, so the next prompt, rendered and encoded afresh, differs from the
sequence the engine's prefix cache holds and misses it for the whole history.
`TurnMemory` remembers each finished sequence (prompt + generated ids) with its
text; a new prompt whose text starts with one of them, at a token boundary, is
rewritten to begin with those exact ids. The text the model sees is unchanged
(checked), only its spelling. Bounded in entries and tokens; thread-safe. `save`/`load` carry it
over a daemon restart, so the prompt state on disk still matches the next turn's prompt.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

MAX_ENTRIES = 64
MAX_TOKENS = 4 << 20  # ids kept in all (int32: 16 MiB)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class TurnMemory:
    """Finished sequences, most recent last; `splice` re-spells a prompt that repeats one."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[bytes, tuple[np.ndarray, str]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, tokenizer: Any, ids: Sequence[int]) -> None:
        """Keep a finished sequence (its prompt as submitted, then every token generated)."""
        arr = np.asarray(ids, dtype=np.int32)
        if not len(arr) or len(arr) > self.max_tokens:
            return
        text = tokenizer.decode(list(ids))
        key = arr.tobytes()
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old[0])
            self._entries[key] = (arr, text)
            self._tokens += len(arr)
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                _, (gone, _) = self._entries.popitem(last=False)
                self._tokens -= len(gone)

    def save(self, path: Path, key: str) -> None:
        """Write the remembered sequences to `path` (atomically), marked with `key` (what their ids mean)."""
        with self._lock:
            arrs = [arr for arr, _ in self._entries.values()]
        tmp = Path(f"{path}.tmp{os.getpid()}")
        save_file(
            {f"seq{i:05d}": torch.from_numpy(a.copy()) for i, a in enumerate(arrs)},
            str(tmp),
            metadata={"key": key},
        )
        os.replace(tmp, path)

    def load(self, tokenizer: Any, path: Path, key: str) -> int:
        """Remember the sequences `save` wrote, if written with the same `key`; how many."""
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return 0
            seqs = [f.get_tensor(name).tolist() for name in sorted(f.keys())]
        for ids in seqs:
            self.remember(tokenizer, ids)
        return len(seqs)

    def splice(self, tokenizer: Any, prompt_ids: Sequence[int]) -> list[int]:
        """`prompt_ids`, or the same text starting with the ids of the longest remembered sequence it repeats."""
        with self._lock:
            entries = list(self._entries.values())
        if not entries:
            return list(prompt_ids)
        prompt_text = tokenizer.decode(list(prompt_ids))
        # The sequence this conversation continues: the longest whose text the prompt's text extends.
        found = [
            (arr, text)
            for arr, text in entries
            if len(text) < len(prompt_text) and prompt_text.startswith(text)
        ]
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        for arr, text in sorted(found, key=lambda e: -len(e[1]))[:4]:
            shared = _common_prefix(prompt, arr)
            if shared == len(arr):
                break  # spelled alike already
            k = _boundary(tokenizer, prompt_ids, shared, text)
            if k is None:
                continue  # the prompt has no token boundary where that text ends
            out = [*arr.tolist(), *prompt_ids[k:]]
            # same text, other spelling; else leave the prompt alone
            if tokenizer.decode(out) == prompt_text:
                return out
        return list(prompt_ids)


def _boundary(tokenizer: Any, ids: Sequence[int], lo: int, text: str) -> int | None:
    """The k in [lo, len(ids)] whose ids[:k] decode to exactly `text`, or None (no token boundary there)."""
    target = len(text)
    hi = len(ids)
    # the first k whose decoded length reaches the target (lengths grow with k, give or take U+FFFD)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(list(ids[:mid]))) < target:
            lo = mid + 1
        else:
            hi = mid
    for k in range(max(lo - 2, 0), min(lo + 3, len(ids) + 1)):
        if tokenizer.decode(list(ids[:k])) == text:
            return k
    return None
