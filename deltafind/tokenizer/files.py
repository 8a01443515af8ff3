"""Tokenizer files on disk: which ones a store keeps, copying them, reading them.

Owns the file names (HF layout), the setup-time copy into a store folder, and
finding the chat template among tokenizer_config.json, chat_template.jinja and
chat_template.json. Knows nothing of how text becomes ids.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from deltafind.errors import DeltafindError, StoreError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tiktoken.model",
)
VOCAB_FILES = ("tokenizer.json", "tiktoken.model")


def copy_tokenizer_files(src_dir: Path, dest_dir: Path) -> list[str]:
    """Copy whichever tokenizer files an HF folder has into a store folder.

    Returns:
        The names copied, in `TOKENIZER_FILES` order.

    Raises:
        StoreError: `src_dir` has neither tokenizer.json nor tiktoken.model.
    """
    src, dest = Path(src_dir), Path(dest_dir)
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(name in present for name in VOCAB_FILES):
        raise StoreError(
            f"{src} has neither tokenizer.json nor tiktoken.model; point setup at the model's "
            "Hugging Face folder with its tokenizer files, or at a GGUF file"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for name in present:
        # Copy then rename, so a crash mid-setup never leaves a truncated file.
        tmp = dest / f".{name}.tmp"
        shutil.copyfile(src / name, tmp)
        os.replace(tmp, dest / name)
    return present


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"cannot parse {path}: {e}; re-run setup to copy it again") from None
    if not isinstance(data, dict):
        raise StoreError(
            f"{path} holds {type(data).__name__}, expected a JSON object; re-run setup"
        )
    return data


def token_text(value: Any) -> str | None:
    """A special token's spelling, written as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick(template: Any, origin: str) -> str:
    # A string, or a list of {name, template} (or a name -> template dict): take "default".
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        if isinstance(template.get("default"), str):
            return template["default"]
        raise DeltafindError(
            f"{origin}: chat templates {sorted(map(str, template))} include no 'default'"
        )
    raise DeltafindError(
        f"{origin}: chat_template is {type(template).__name__}, expected a string or a list"
    )


def find_chat_template(folder: Path | None, config: dict[str, Any]) -> tuple[str, str] | None:
    """The chat template source and the file it came from, or None when there is none.

    Looks in tokenizer_config.json "chat_template", then chat_template.jinja, then
    chat_template.json, in that order.
    """
    origin = str(folder / "tokenizer_config.json") if folder else "tokenizer config"
    if config.get("chat_template"):
        return _pick(config["chat_template"], origin), origin
    if folder is None:
        return None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    data = read_json(folder / "chat_template.json")
    if data.get("chat_template"):
        origin = str(folder / "chat_template.json")
        return _pick(data["chat_template"], origin), origin
    return None
