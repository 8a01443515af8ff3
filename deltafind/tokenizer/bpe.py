"""Byte-level BPE building blocks shared by the GGUF and tiktoken paths.

Owns the GPT-2 byte-to-unicode table, the pre-tokenizer split regexes (by
llama.cpp `tokenizer.ggml.pre` name, plus Kimi's), and the tiktoken ranks file
to `tokenizers` BPE conversion. Knows nothing of model stores or chat.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deltafind.errors import StoreError, UnsupportedModelError


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's table: printable bytes map to themselves, the rest to U+0100.. in order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


BYTE_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}


def spell_bytes(data: bytes) -> str:
    """The byte-level vocabulary spelling of `data` (one character per byte)."""
    return "".join(BYTE_TO_UNICODE[b] for b in data)


def is_byte_spelled(token: str) -> bool:
    """Whether every character of `token` is in the byte-level alphabet."""
    return all(c in UNICODE_TO_BYTE for c in token)


# Split regexes as the vocabularies' own tokenizer.json files write them. llama.cpp
# rewrites `(?i:'s|...)` as `'[sS]|...` only because std::regex lacks `(?i:)`; Oniguruma has it.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Kimi K2/K3 (docs/kimi-k3-format.md §6.3); Oniguruma supports its `&&` class intersections.
KIMI_PATTERN = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

_LLAMA3_NAMES = (
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
)
# llama.cpp turns on `ignore_merges` and BOS for this family only.
LLAMA3_FAMILY = frozenset(_LLAMA3_NAMES)

# llama.cpp's `tokenizer.ggml.pre` names -> regexes applied in turn, each one splitting
# the pieces of the one before (llama-vocab.cpp, `llm_tokenizer_bpe`).
_PRE_GROUPS: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    # llama.cpp's fallback, also used when the key is missing.
    (("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion"), (_GPT2,)),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    (_LLAMA3_NAMES, (_LLAMA3,)),
    (("dbrx", "smaug-bpe"), (_LLAMA3,)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), (_QWEN2,)),
    (("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    (("deepseek-v3",), _DEEPSEEK3),
]
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    name: regexes for names, regexes in _PRE_GROUPS for name in names
}


def make_pre_tokenizer(patterns: tuple[str, ...] | list[str]) -> pre_tokenizers.PreTokenizer:
    """Split by each regex in turn (matches and gaps both kept), then map bytes."""
    try:
        splits = [
            pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns
        ]
    except Exception as e:  # tokenizers raises a bare Exception for Oniguruma errors
        raise UnsupportedModelError(
            f"pre-tokenizer regex does not compile in Oniguruma: {e}"
        ) from None
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def byte_level_bpe(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    patterns: tuple[str, ...],
    ignore_merges: bool,
) -> Backend:
    """A byte-level BPE `tokenizers` backend: split by `patterns` (make_pre_tokenizer), byte-level decode."""
    backend = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre_tokenizer(patterns)
    backend.decoder = decoders.ByteLevel()
    return backend


def tiktoken_text(ranks: Iterable[tuple[bytes, int]]) -> str:
    """A tiktoken ranks file's text, one `<base64 token> <rank>` line per (token, rank)."""
    return "".join(f"{base64.b64encode(t).decode()} {i}\n" for t, i in ranks)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one `<base64 token> <rank>` per line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise StoreError(f"cannot read tiktoken ranks file {path}: {e}") from None
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise StoreError(
                f"{path}:{num}: expected '<base64 token> <rank>', got {line[:60]!r}; "
                "re-copy tiktoken.model from the model folder"
            ) from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise StoreError(
            f"{path}: {len(missing)} single-byte tokens missing (first: {missing[0]}); not a byte-level BPE"
        )
    return ranks


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    # Every split of a token into two in-vocab halves, ordered by the token's rank, then
    # by the halves' ranks: BPE with these merges picks the lowest-rank pair as tiktoken does.
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append(
                    (rank, ranks[left], ranks[right], spell_bytes(left), spell_bytes(right))
                )
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def make_tiktoken_backend(
    ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int]
) -> Backend:
    """A `tokenizers` byte-level BPE that encodes as tiktoken does with these ranks."""
    vocab = {spell_bytes(token): rank for token, rank in ranks.items()}
    for content, token_id in special_tokens.items():
        if content in vocab and vocab[content] != token_id:
            raise StoreError(
                f"special token {content!r} (id {token_id}) collides with BPE rank {vocab[content]}"
            )
        vocab[content] = token_id  # so the added token below keeps this exact id
    backend = byte_level_bpe(vocab, _derive_merges(ranks), (pattern,), ignore_merges=True)
    backend.add_special_tokens(
        [AddedToken(c, special=True, normalized=False) for c in special_tokens]
    )
    return backend
