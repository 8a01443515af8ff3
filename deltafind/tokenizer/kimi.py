"""The Kimi K3 tokenizer (docs/kimi-k3-format.md §6): tiktoken ranks + K3's regex + 256 reserved ids,
safety slicing, XTML chat encoded segment by segment, EOS `<|end_of_msg|>`, no BOS.

`Tokenizer.load` returns a `KimiTokenizer` for a tiktoken folder whose added
tokens carry the XTML markers. Also writes small K3-style tokenizer folders
(trained ranks, K3 special layout) for synthetic stores and tests.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

from .bpe import tiktoken_text
from .core import Tokenizer
from .kimi_xtml import EOM, Segment, render_segments

MAX_SLICE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
XTML_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
# Audited spellings by offset from the first reserved id (163584 in K3; docs/kimi-k3-format.md §6.2).
K3_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
NUM_RESERVED = 256


def safety_slices(text: str) -> list[str]:
    """tokenization_kimi.py's cuts: 400k-character slices, then same-class runs (str.isspace) of at most 25k."""
    pieces = []
    for start in range(0, len(text), MAX_SLICE_CHARS):
        chunk = text[start : start + MAX_SLICE_CHARS]
        begin, run, kind = 0, 0, None
        for i, ch in enumerate(chunk):
            space = ch.isspace()
            run = run + 1 if space == kind else 1
            kind = space
            if run > MAX_RUN_CHARS:
                pieces.append(chunk[begin:i])
                begin, run = i, 1
        pieces.append(chunk[begin:])
    return [p for p in pieces if p]


class KimiTokenizer(Tokenizer):
    """K3's tokenizer: plain encode with safety slicing, XTML chat, EOS = <|end_of_msg|>."""

    chat_format = "kimi_k3"

    @classmethod
    def claims(cls, config: dict[str, Any]) -> bool:
        """Whether tokenizer_config.json's added tokens are K3's XTML markers."""
        names = {
            e.get("content")
            for e in (config.get("added_tokens_decoder") or {}).values()
            if isinstance(e, dict)
        }
        return all(m in names for m in XTML_MARKERS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        eom = self.token_to_id(EOM)
        self.eos_token_ids = [eom] if eom is not None else self.eos_token_ids
        self._add_bos = False  # K3 prompts never get BOS (docs/kimi-k3-format.md §4.1)

    def encode(
        self, text: str, add_bos: bool | None = None, *, allow_special: bool = False
    ) -> list[int]:
        if len(text) <= MAX_RUN_CHARS:  # no cut can apply
            return super().encode(text, add_bos=False, allow_special=allow_special)
        ids: list[int] = []
        for piece in safety_slices(text):
            ids += super().encode(piece, add_bos=False, allow_special=allow_special)
        return ids

    @property
    def has_chat_template(self) -> bool:
        return True

    def chat_segments(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[Segment]:
        """XTML segments; kwargs: tools, tool_choice, response_format, thinking, thinking_effort."""
        return render_segments(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def chat_prompt(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> tuple[str, list[int]]:
        """Each segment encoded on its own (control: specials read; ordinary: plain BPE), ids concatenated."""
        segments, ids = self.chat_segments(messages, add_generation_prompt, **kwargs), list[int]()
        for seg in segments:
            ids += self.encode(seg.text, allow_special=seg.control)
        return "".join(s.text for s in segments), ids


SAMPLE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. "
    "def main():\n    return 42\n\nfor i in range(10):\n    print(i)\n"
    "Hello, world! I'm here and you're there; we'll see. 你好世界，中文文本。 123 4567 89\n"
    "message role system user assistant think response tools call argument json type "
) * 4


def train_ranks(num_merges: int, corpus: str = SAMPLE_CORPUS) -> list[bytes]:
    """A small byte-level BPE rank table: 256 bytes, then `num_merges` greedy merges on whitespace-split words."""
    ranks = [bytes([b]) for b in range(256)]
    words = Counter(
        tuple(bytes([b]) for b in w.encode()) for w in corpus.replace("\n", " \n ").split(" ") if w
    )
    words.update(
        tuple(bytes([b]) for b in (" " + w).encode()) for w in corpus.split(" ") if w.strip()
    )
    known = set(ranks)
    while len(ranks) < 256 + num_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, n in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += n
        best = next(((a, b) for (a, b), _ in pairs.most_common() if a + b not in known), None)
        if best is None:
            break
        ranks.append(best[0] + best[1])
        known.add(best[0] + best[1])
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_k3_tokenizer(dest: Path, num_merges: int = 256) -> list[str]:
    """A K3-layout tokenizer folder: tiktoken.model, tokenizer_config.json (K3's reserved-id layout)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks(num_merges)
    (dest / "tiktoken.model").write_text(tiktoken_text((t, i) for i, t in enumerate(ranks)))
    first = len(ranks)
    added = {
        str(first + off): {"content": text, "special": True} for off, text in K3_SPECIALS.items()
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "add_bos_token": False,
        "model_max_length": 1048576,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return ["tiktoken.model", "tokenizer_config.json"]
