"""Turn a GGUF file's tokenizer metadata into tokenizer.json (or tiktoken.model) + tokenizer_config.json.

Owns the llama.cpp key names and token-type codes, and the choice of split
regexes by `tokenizer.ggml.pre` (tables in `bpe`); a `kimi-k2` vocabulary goes
back to the tiktoken folder of its HF release. Runs once at setup; the runtime
only ever loads the files written here. Knows nothing of weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from deltafind.errors import StoreError, UnsupportedModelError

from .bpe import (
    LLAMA3_FAMILY,
    PRE_SPLITS,
    UNICODE_TO_BYTE,
    byte_level_bpe,
    is_byte_spelled,
    spell_bytes,
    tiktoken_text,
)

# llama.cpp's llama_token_type codes.
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
_UNUSED = 5
# Kimi K2/K3's tiktoken vocabulary, as llama.cpp's converter names it.
KIMI_PRE = "kimi-k2"
_KIMI_FIX = "set up from the model's HF folder (tiktoken.model) or re-convert it with llama.cpp"

# Spellings llama.cpp also treats as end-of-generation when the file marks them control.
_EOG_SPELLINGS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
        "<|return|>", "<|call|>",
    }
)  # fmt: skip


def _read_fields(reader: GGUFReader) -> dict[str, Any]:
    # Plain Python values for the tokenizer.* keys only (weights are never touched).
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        parts = [field.parts[i] for i in field.data]
        if kind == GGUFValueType.STRING:
            out[name] = bytes(parts[0]).decode("utf-8")
        elif kind == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            out[name] = [bytes(p).decode("utf-8") for p in parts]
        elif kind == GGUFValueType.ARRAY:
            out[name] = np.concatenate(parts).tolist() if parts else []
        else:
            out[name] = parts[0][0].item()
    return out


def _build_backend(meta: dict[str, Any], source: Path) -> Backend:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not one deltafind knows "
            f"(known: {', '.join(sorted([*PRE_SPLITS, KIMI_PRE]))}); set up from the HF folder instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = {i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)}
    # Normal tokens are stored byte-spelled; control and user-defined ones as raw text.
    # Keeping the raw text as their vocab key makes the added tokens below land on their ids.
    vocab = {
        tok if i in added or is_byte_spelled(tok) else spell_bytes(tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    if len(vocab) != len(tokens):
        raise StoreError(
            f"{source}: tokenizer.ggml.tokens holds duplicate spellings; the file is corrupt"
        )
    merges = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after position 0
        merges.append((merge[:cut], merge[cut + 1 :]))
    backend = byte_level_bpe(vocab, merges, PRE_SPLITS[pre], ignore_merges=pre in LLAMA3_FAMILY)
    # Control tokens are special (skipped by skip_special_tokens); user-defined ones are not.
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
            for i in sorted(added)
        ]
    )
    moved = [(tokens[i], i) for i in added if backend.token_to_id(tokens[i]) != i]
    if moved:
        raise StoreError(
            f"{source}: added tokens would not keep their ids (first: {moved[0]}); the vocabulary is inconsistent"
        )
    return backend


def _kimi_tiktoken(meta: dict[str, Any], source: Path) -> tuple[str, dict[str, Any]]:
    """tiktoken.model's text and the tokenizer_config.json keys of a `kimi-k2` vocabulary.

    llama.cpp's converter (KimiLinearModel/DeepseekV2Model.set_vocab) writes tiktoken rank r as
    the NORMAL token at id r, spelled byte-level; then the reserved ids as CONTROL tokens, unnamed
    ones spelled `<|reserved_token_{id}|>` as tokenization_kimi.py names them; then `[PAD{id}]`
    UNUSED up to the model's vocab_size (docs/kimi-k3-format.md §6.1).
    """
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] | None = meta.get("tokenizer.ggml.token_type")
    if types is None or len(types) != len(tokens):
        raise StoreError(
            f"{source}: tokenizer.ggml.token_type is missing or not one per token; a {KIMI_PRE} "
            f"vocabulary needs it to tell the tiktoken ranks from the reserved ids; {_KIMI_FIX}"
        )
    first = next((i for i, t in enumerate(types) if t != _NORMAL), len(tokens))
    ranks: dict[bytes, int] = {}
    for i, tok in enumerate(tokens[:first]):
        if not tok or not is_byte_spelled(tok):
            raise StoreError(
                f"{source}: tokenizer.ggml.tokens[{i}] {tok!r} is a normal token but not spelled "
                f"in GPT-2's byte-level alphabet (or empty), so it is no tiktoken rank; {_KIMI_FIX}"
            )
        ranks.setdefault(bytes(UNICODE_TO_BYTE[c] for c in tok), i)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if len(ranks) != first or missing:
        raise StoreError(
            f"{source}: tokenizer.ggml.tokens[:{first}] are not a tiktoken rank table "
            f"({first - len(ranks)} duplicate spellings, {len(missing)} single bytes missing); "
            f"{_KIMI_FIX}"
        )
    # Ranks must be ids 0..N-1: Tokenizer.load numbers the reserved ids from len(ranks). The
    # `[PAD{id}]` tail past the last reserved id is dropped, as the HF folder has no such ids.
    last = max((i for i, t in enumerate(types) if t == _CONTROL), default=first - 1)
    added: dict[str, dict[str, Any]] = {}
    for i in range(first, len(tokens)):
        tok, pad = tokens[i], types[i] == _UNUSED and tokens[i] == f"[PAD{i}]"
        if types[i] == _NORMAL:
            raise StoreError(
                f"{source}: tokenizer.ggml.tokens[{i}] {tok!r} is a normal token after id {first} "
                f"({tokens[first]!r}, token_type {types[first]}), a hole in the tiktoken ranks, "
                f"which must be ids 0..N-1; {_KIMI_FIX}"
            )
        if types[i] != _CONTROL and not pad:
            raise StoreError(
                f"{source}: tokenizer.ggml.tokens[{i}] {tok!r} has token_type {types[i]}; after "
                f"its {first} ranks a {KIMI_PRE} vocabulary holds only CONTROL reserved ids and "
                f"UNUSED `[PAD{{id}}]` holes; {_KIMI_FIX}"
            )
        if i <= last and tok != f"<|reserved_token_{i}|>":
            added[str(i)] = {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
    lines = tiktoken_text(ranks.items())
    # tokenization_kimi.py's class, which `Tokenizer.load` reads as Kimi's split regex.
    return lines, {"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": added}


def _config(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    def text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    pre = meta.get("tokenizer.ggml.pre", "default")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "unk_token": text("unknown_token_id"),
        "pad_token": text("padding_token_id"),
        # llama.cpp's default when the flag is absent: BOS only for the llama3 family.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", pre in LLAMA3_FAMILY)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    ids = [
        meta.get(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    ids += [i for i, t in enumerate(tokens) if types[i] == _CONTROL and t in _EOG_SPELLINGS]
    generation = {
        "eos_token_id": list(
            dict.fromkeys(i for i in ids if i is not None and 0 <= i < len(tokens))
        )
    }
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        generation["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    return {k: v for k, v in config.items() if v is not None}, generation


def write_tokenizer_from_gguf(
    gguf_path: Path, dest_dir: Path, reader: GGUFReader | None = None
) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json from a GGUF.

    Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported. A `kimi-k2`
    one becomes tiktoken.model instead of tokenizer.json, the folder Kimi's HF release has.
    `reader`: gguf_path already open (setup has it: gguf-py parses a 150k-token vocabulary in ~8 s).

    Returns:
        The names of the files written into `dest_dir`.
    """
    gguf_path, dest_dir = Path(gguf_path), Path(dest_dir)
    try:
        meta = _read_fields(reader or GGUFReader(gguf_path))
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read GGUF metadata from {gguf_path}: {e}") from None
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"{gguf_path}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) GGUF "
            "vocabularies are supported, set up from the HF folder (tokenizer.json) instead"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise StoreError(f"{gguf_path}: no tokenizer.ggml.tokens; the GGUF carries no vocabulary")
    config, generation = _config(meta)
    if meta.get("tokenizer.ggml.pre") == KIMI_PRE:
        ranks, keys = _kimi_tiktoken(meta, gguf_path)
        files, config = {"tiktoken.model": ranks}, config | keys
    else:
        files = {"tokenizer.json": _build_backend(meta, gguf_path).to_str(pretty=True)}
    for name, data in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        files[name] = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    dest_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (dest_dir / name).write_text(text, encoding="utf-8")
    return list(files)
