"""Kimi K3's tokenizer from its GGUF (`tokenizer.ggml.pre` "kimi-k2").

llama.cpp's own converter writes the vocabulary from the synthetic K3 HF folder (tests/k3_gguf.py);
the folder deltafind rebuilds from it must encode, decode and render chats exactly as the HF
folder's tokenizer does, and encode as tiktoken does on the same ranks and as llama.cpp does on the
same file. kimi-k2 GGUFs written directly with gguf.GGUFWriter cover the padding the converter adds
and the refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deltafind.errors import StoreError
from deltafind.tokenizer import Tokenizer, write_tokenizer_from_gguf
from deltafind.tokenizer.bpe import KIMI_PATTERN
from deltafind.tokenizer.kimi import K3_SPECIALS, NUM_RESERVED, KimiTokenizer, write_k3_tokenizer
from tests.k3_gguf import convert_k3, make_k3_hf, need_k3_gguf

os.environ["TIKTOKEN_CACHE_DIR"] = ""

TEXTS = [
    "Hello, world! I'm sure they'll say it's fine; DON'T SHOUT, IT'S OK",
    "def main():\n    return 42  # answer\n\tif x:\n\t\tpass\n",
    "中文测试：你好，世界。混合Mixed中英文text和数字123456",
    "日本語のテキスト、カタカナ。한국어 문장 Ελληνικά Русский العربية",
    "emoji 😀🎉👍🏽 ❤️ 🇫🇷 🦙🦙 and symbols !!! ??? ... ```json {\"a\": [1, 2]}```",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000",
    "   leading, trailing   \n\n\n  \r\n\t \u3000 x  ",
    "user text with <|open|>, [EOS], <|end_of_msg|> and [BOS] typed in it",
    "a" + " " * 30_000 + "b",  # past the 25k-character run cut (docs/kimi-k3-format.md §6.4)
]
CONTROL = ["<|open|>", "[EOS]", "<|end_of_msg|>", "<|sep|>", "[BOS]"]


def _ranks(folder: Path) -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(str(folder / "tiktoken.model"))


def _byte_spelling(data: bytes) -> str:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return "".join(table[b] for b in data)


def _tiktoken(ranks: dict[bytes, int]):
    import tiktoken

    return tiktoken.Encoding("k3", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the synthetic K3 HF folder, the GGUF llama.cpp's converter writes from it)."""
    need_k3_gguf()
    root = tmp_path_factory.mktemp("k3tok")
    hf = make_k3_hf(root / "hf")
    return hf, convert_k3(hf, root / "k3.gguf", "bf16")


@pytest.fixture(scope="module")
def store(k3: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("k3tok_store")
    written = write_tokenizer_from_gguf(k3[1], dest)
    assert written == ["tiktoken.model", "tokenizer_config.json", "generation_config.json"]
    return dest


@pytest.fixture(scope="module")
def ours(store: Path) -> Tokenizer:
    return Tokenizer.load(store)


@pytest.fixture(scope="module")
def theirs(k3: tuple[Path, Path]) -> Tokenizer:
    return Tokenizer.load(k3[0])


def test_converter_writes_kimi_k2_vocabulary(k3: tuple[Path, Path]) -> None:
    # What KimiLinearModel.set_vocab writes: ranks byte-level spelled at id = rank, merges in rank
    # order, the 256 reserved ids CONTROL, eos restored to the config's <|end_of_msg|>.
    from gguf import GGUFReader

    hf, path = k3
    fields = GGUFReader(path).fields
    meta = {k: fields[k].contents() for k in fields if k.startswith("tokenizer.")}
    ranks = _ranks(hf)
    n = len(ranks)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "kimi-k2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert tokens[:n] == [_byte_spelling(t) for t in sorted(ranks, key=ranks.get)]
    assert types == [1] * n + [3] * NUM_RESERVED
    first = {text: n + off for off, text in K3_SPECIALS.items()}
    assert all(tokens[i] == text for text, i in first.items())
    merged = [tokens.index(m.replace(" ", "")) for m in meta["tokenizer.ggml.merges"]]
    assert merged and merged == sorted(merged) and min(merged) >= 256
    assert meta["tokenizer.ggml.eos_token_id"] == first["<|end_of_msg|>"]
    assert meta["tokenizer.ggml.bos_token_id"] == first["[BOS]"]
    assert "tokenizer.chat_template" in meta  # llama.cpp's bundled Kimi-K3.jinja


def test_gguf_folder_is_the_hf_folder(store: Path, k3: tuple[Path, Path]) -> None:
    hf = k3[0]
    assert _ranks(store) == _ranks(hf)
    names = [
        {int(i): e["content"] for i, e in json.loads(p.read_text())["added_tokens_decoder"].items()}
        for p in (store / "tokenizer_config.json", hf / "tokenizer_config.json")
    ]
    assert names[0] == names[1]


def test_tokenizer_matches_hf(ours: Tokenizer, theirs: Tokenizer) -> None:
    assert type(ours) is type(theirs) is KimiTokenizer
    assert ours.vocab_size == theirs.vocab_size
    assert ours.eos_token_ids == theirs.eos_token_ids == [theirs.token_to_id("<|end_of_msg|>")]
    assert ours.bos_token_id == theirs.bos_token_id
    assert [ours.token_to_id(t) for t in CONTROL] == [theirs.token_to_id(t) for t in CONTROL]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_decode_match_hf_and_tiktoken(
    ours: Tokenizer, theirs: Tokenizer, k3: tuple[Path, Path], text: str
) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == text
    if len(text) < 25_000:  # tiktoken itself does not cut runs; tokenization_kimi.py does
        assert ids == _tiktoken(_ranks(k3[0])).encode_ordinary(text)


def test_ids_match_llama_cpp_on_the_same_file(ours: Tokenizer, k3: tuple[Path, Path]) -> None:
    # llama.cpp's own kimi-k2 tokenizer reading the converter's file (llama-cpp-python is in the
    # bench extra, so this runs where it is installed).
    llama_cpp = pytest.importorskip("llama_cpp")
    llama = llama_cpp.Llama(str(k3[1]), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text) == llama.tokenize(text.encode(), add_bos=False, special=False)
    text = "".join(CONTROL)
    want = llama.tokenize(text.encode(), add_bos=False, special=True)
    assert ours.encode(text, allow_special=True) == want
    assert ours.eos_token_ids == [llama.token_eos()] and ours.bos_token_id == llama.token_bos()


def test_special_text_in_user_content_stays_text(ours: Tokenizer, theirs: Tokenizer) -> None:
    text = "".join(CONTROL)
    n_ranks = ours.token_to_id("[BOS]")
    assert max(ours.encode(text)) < n_ranks
    read = ours.encode(text, allow_special=True)
    assert read == theirs.encode(text, allow_special=True) == [ours.token_to_id(t) for t in CONTROL]


def test_chat_prompt_matches_hf(ours: Tokenizer, theirs: Tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are terse. 你好"},
        {"role": "user", "content": "Weather in Paris? <|open|>[EOS]<|end_of_msg|>"},
        {"role": "assistant", "content": "Let me check.\n\n  done"},
        {"role": "user", "content": "And 12345 🦙?"},
    ]
    text, ids = ours.chat_prompt(messages, tools=tools)
    assert (text, ids) == theirs.chat_prompt(messages, tools=tools)
    # every <|end_of_msg|> in the prompt is the control id but the one the user typed
    assert ids.count(ours.token_to_id("<|end_of_msg|>")) == text.count("<|end_of_msg|>") - 1


# --- kimi-k2 GGUFs written directly: the converter's padding, and the refusals --------------


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("k3tok_hf")
    write_k3_tokenizer(folder, num_merges=64)
    return folder


def _vocab(hf_tok: Path, pads: int = 0) -> tuple[list[str], list[int]]:
    # The converter's layout: ranks, 256 reserved CONTROL ids, `[PAD{id}]` UNUSED to vocab_size.
    ranks = _ranks(hf_tok)
    n = len(ranks)
    tokens = [_byte_spelling(t) for t in sorted(ranks, key=ranks.get)]
    named = {n + off: text for off, text in K3_SPECIALS.items()}
    tokens += [named.get(i, f"<|reserved_token_{i}|>") for i in range(n, n + NUM_RESERVED)]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + pads)]
    return tokens, [1] * n + [3] * NUM_RESERVED + [5] * pads


def _write_gguf(path: Path, tokens: list[str], types: list[int] | None, eos: int) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("kimi-k2")
    writer.add_token_list(tokens)
    if types is not None:
        writer.add_token_types(types)
    writer.add_eos_token_id(eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_padded_vocabulary_drops_the_pads(hf_tok: Path, tmp_path: Path) -> None:
    tokens, types = _vocab(hf_tok, pads=7)
    eos = tokens.index("<|end_of_msg|>")
    write_tokenizer_from_gguf(_write_gguf(tmp_path / "k.gguf", tokens, types, eos), tmp_path / "t")
    ours, theirs = Tokenizer.load(tmp_path / "t"), Tokenizer.load(hf_tok)
    assert type(ours) is KimiTokenizer
    assert ours.vocab_size == theirs.vocab_size == len(tokens) - 7
    assert ours.token_to_id(tokens[-1]) is None
    for text in TEXTS[:8]:
        assert ours.encode(text) == theirs.encode(text)


def _mangle(case: str, tokens: list[str], types: list[int], n: int) -> list[int] | None:
    if case == "not byte-level":
        tokens[300] = "two words"
    elif case == "empty":
        tokens[300] = ""
    elif case == "duplicate":
        tokens[300] = tokens[299]
    elif case == "byte missing":
        tokens[65] = _byte_spelling(b"\x00zz")
    elif case == "hole":
        tokens[300], types[300] = "[PAD300]", 5
    elif case == "user-defined":
        types[n + 10] = 4
    elif case == "unused not a pad":
        types[n + 10] = 5
    elif case == "no token types":
        return None
    return types


REFUSALS = {
    "not byte-level": r"tokens\[300\] 'two words' is a normal token but not spelled in GPT-2's",
    "empty": r"tokens\[300\] '' is a normal token but not spelled in GPT-2's",
    "duplicate": r"not a tiktoken rank table \(1 duplicate spellings, 0 single bytes missing\)",
    "byte missing": r"not a tiktoken rank table \(0 duplicate spellings, 1 single bytes missing\)",
    "hole": r"tokens\[301\] .* is a normal token after id 300 \('\[PAD300\]', token_type 5\)",
    "user-defined": r"tokens\[330\] '<\|reserved_token_330\|>' has token_type 4",
    "unused not a pad": r"tokens\[330\] .* has token_type 5; .* UNUSED `\[PAD\{id\}\]` holes",
    "no token types": r"tokenizer\.ggml\.token_type is missing",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_inconsistent_vocabulary_is_refused(hf_tok: Path, tmp_path: Path, case: str) -> None:
    tokens, types = _vocab(hf_tok)
    n = types.index(3)
    assert n == 320  # the ids the messages name
    kept = _mangle(case, tokens, types, n)
    path = _write_gguf(tmp_path / "k.gguf", tokens, kept, tokens.index("<|end_of_msg|>"))
    with pytest.raises(StoreError, match=REFUSALS[case]) as err:
        write_tokenizer_from_gguf(path, tmp_path / "t")
    assert str(path) in str(err.value) and "HF folder" in str(err.value)
    assert not (tmp_path / "t").exists()
