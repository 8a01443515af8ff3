"""The Tokenizer: text <-> ids for one model, its special tokens and its chat template.

Owns loading a store's tokenizer folder (tokenizer.json, or tiktoken.model), the
BOS/EOS rules from tokenizer_config.json and generation_config.json, and keeping
special-token text in user input from turning into control ids. The engine sees
only the ids this produces; nothing here knows about models or requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from deltafind.errors import DeltafindError, StoreError, UnsupportedModelError

from .bpe import KIMI_PATTERN, make_tiktoken_backend, read_tiktoken_ranks
from .chat import ChatTemplate
from .files import find_chat_template, read_json, token_text
from .guard import BREAK, SpecialGuard
from .stream import IncrementalDecoder


def _tiktoken_specials(config: dict[str, Any], num_ranks: int) -> dict[str, int]:
    # added_tokens_decoder lists the specials; ids it skips get Kimi's placeholder names.
    named = {
        int(i): text
        for i, entry in (config.get("added_tokens_decoder") or {}).items()
        if (text := token_text(entry)) is not None
    }
    top = max(named, default=num_ranks - 1)
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_ranks, top + 1)}


def _sampling_defaults(gen: dict[str, Any]) -> dict[str, float | int]:
    """generation_config.json's temperature, top_p and top_k where they are in range (others are
    ignored: a wrong value there is the model's, not the request's, and the API defaults apply).
    `do_sample` is not read, as vLLM does not: a model's sampling values are its recommendation."""
    out: dict[str, float | int] = {}
    for name, ok in (
        ("temperature", lambda v: 0 <= v <= 2),
        ("top_p", lambda v: 0 < v <= 1),
        ("top_k", lambda v: isinstance(v, int) and v >= 0),
    ):
        value = gen.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and ok(value):
            out[name] = value
    return out


def _tiktoken_pattern(config: dict[str, Any], folder: Path) -> str:
    for key in ("pat_str", "pattern"):
        if isinstance(config.get(key), str):
            return config[key]
    # Kimi ships its regex in tokenization_kimi.py, not in any data file.
    auto_map = str(config.get("auto_map", "")).lower()
    if "kimi" in auto_map or config.get("tokenizer_class") == "TikTokenTokenizer":
        return KIMI_PATTERN
    raise UnsupportedModelError(
        f'{folder}: tiktoken.model without a split regex; add its pattern as "pat_str" '
        "to tokenizer_config.json"
    )


class Tokenizer:
    """Encode, decode and chat-render for one model.

    Build with `Tokenizer.load(folder)` or `Tokenizer.from_tiktoken(...)`.
    """

    chat_format: str | None = (
        None  # the chat format it declares (server/formats); None: found from its template
    )

    def __init__(
        self,
        backend: Backend,
        config: dict[str, Any] | None = None,
        *,
        generation_config: dict[str, Any] | None = None,
        folder: Path | None = None,
    ) -> None:
        self._config = dict(config or {})
        self._folder = folder
        # Two copies: one matches special-token text (trusted template output), the
        # other encodes it as plain text (user input), and neither changes per call.
        self._trusted = backend
        self._plain = Backend.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        self._add_bos = bool(self._config.get("add_bos_token", False))
        self._special = self._special_tokens(
            read_json(folder / "special_tokens_map.json") if folder else {}
        )
        gen = generation_config or {}
        bos = self._special.get("bos_token")
        self.bos_token_id: int | None = self.token_to_id(bos) if bos else None
        if self.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            self.bos_token_id = gen["bos_token_id"]
        eos = self._special.get("eos_token")
        ids = [self.token_to_id(eos)] if eos else []
        extra = gen.get("eos_token_id")
        ids += extra if isinstance(extra, list) else [extra]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in ids if isinstance(i, int)))
        # the sampling the model's authors recommend, for requests that set none (vLLM does the same)
        self.sampling_defaults: dict[str, float | int] = _sampling_defaults(gen)
        self._chat: ChatTemplate | None = None
        self._guard = SpecialGuard(backend)

    def _special_tokens(self, special_map: dict[str, Any]) -> dict[str, str]:
        out = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = token_text(self._config.get(name)) or token_text(special_map.get(name))
            if text is not None:
                out[name] = text
        return out

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        """Load a store's tokenizer folder (tokenizer.json, or tiktoken.model + tokenizer_config.json)."""
        folder = Path(folder)
        config = read_json(folder / "tokenizer_config.json")
        generation = read_json(folder / "generation_config.json")
        if (folder / "tokenizer.json").is_file():
            try:
                backend = Backend.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception on bad JSON
                raise StoreError(
                    f"cannot load {folder / 'tokenizer.json'}: {e}; re-run setup"
                ) from None
            return cls(backend, config, generation_config=generation, folder=folder)
        if (folder / "tiktoken.model").is_file():
            ranks = read_tiktoken_ranks(folder / "tiktoken.model")
            backend = make_tiktoken_backend(
                ranks, _tiktoken_pattern(config, folder), _tiktoken_specials(config, len(ranks))
            )
            # a subclass that claims this folder (K3's XTML: tokenizer/kimi.py)
            if cls is Tokenizer:
                cls = next((c for c in Tokenizer.__subclasses__() if c.claims(config)), Tokenizer)
            return cls(backend, config, generation_config=generation, folder=folder)
        raise StoreError(
            f"{folder} has neither tokenizer.json nor tiktoken.model; re-run setup for this model"
        )

    @classmethod
    def claims(cls, config: dict[str, Any]) -> bool:
        """Whether a tiktoken folder with this tokenizer_config.json needs this subclass."""
        return False

    @classmethod
    def from_tiktoken(
        cls,
        ranks_path: Path,
        pattern: str,
        special_tokens: dict[str, int],
    ) -> Tokenizer:
        """Build from a tiktoken ranks file, its split regex and its special tokens."""
        backend = make_tiktoken_backend(
            read_tiktoken_ranks(Path(ranks_path)), pattern, special_tokens
        )
        return cls(backend)

    def encode(
        self, text: str, add_bos: bool | None = None, *, allow_special: bool = False
    ) -> list[int]:
        """Ids for `text`.

        Args:
            add_bos: prepend BOS; None follows tokenizer_config.json `add_bos_token`.
            allow_special: read special-token spellings in `text` as those tokens.
                Leave False for user input, so "<|im_end|>" typed by a user stays text.
        """
        backend = self._trusted if allow_special else self._plain
        ids = backend.encode(text, add_special_tokens=False).ids
        if (self._add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids` (malformed UTF-8 comes out as U+FFFD)."""
        return self._trusted.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A fresh streaming decoder for one sequence."""
        return IncrementalDecoder(self, skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of `token_id` (byte-level form), or None."""
        return self._trusted.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary spelling, or None."""
        return self._trusted.token_to_id(token)

    def backend_json(self) -> str:
        """The `tokenizers` JSON of this vocabulary (for grammar libraries that index token bytes)."""
        return self._trusted.to_str()

    @property
    def chat_template_source(self) -> str:
        """The chat template's jinja source ("" without one): which tool/thinking format it speaks."""
        found = find_chat_template(self._folder, self._config)
        return found[0] if found else ""

    @property
    def has_chat_template(self) -> bool:
        """Whether the model's files carry a chat template."""
        return find_chat_template(self._folder, self._config) is not None

    def _template(self) -> ChatTemplate:
        if self._chat is None:
            found = find_chat_template(self._folder, self._config)
            if found is None:
                where = self._folder or "this tokenizer"
                raise DeltafindError(
                    f"{where} has no chat template (tokenizer_config.json chat_template, chat_template.jinja "
                    "or chat_template.json); use the completions endpoint or add a template"
                )
            self._chat = ChatTemplate(*found)
        return self._chat

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        return self.chat_prompt(messages, add_generation_prompt, **template_kwargs)[0]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render and encode: the template's markup as special tokens, all caller text as text.

        BOS only if the template left it out.
        """
        return self.chat_prompt(messages, add_generation_prompt, **template_kwargs)[1]

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """(the prompt text, its ids) from one rendering, as `render_chat` and `apply_chat_template` give them."""
        # Everything the caller hands in is escaped; only the tokenizer's own specials are not.
        context = {**self._special, **self._guard.escape(template_kwargs)}
        text = self._template().render(
            self._guard.escape(messages), add_generation_prompt=add_generation_prompt, **context
        )
        ids = self._guard.encode(text, lambda piece: self.encode(piece, add_bos=False))
        if self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return text.replace(BREAK, ""), ids

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, folder={str(self._folder)!r})"
