"""Kimi K3 GGUF files for tests, written by llama.cpp's OWN converter (docs/kimi-k3-gguf.md).

PyPI's gguf has no KIMI_K3 tables; llama.cpp's own gguf-py and converter come from the llama-cpp-python
sdist (`make dev` unpacks them into .venv/llama.cpp-src and installs that gguf-py). The converter runs in
a subprocess on deltafind's tiny synthetic K3 HF folder. Its own `set_vocab` runs (pre "kimi-k2"), with
AutoTokenizer standing in for the `tokenization_kimi.py` remote code the synthetic folder lacks, and the
bundled models/templates/Kimi-K3.jinja as the chat template, as for the release. Its output is
deterministic (a test checks the sha256 a reference was made from).

Also runnable: `python tests/k3_gguf.py convert HF_DIR OUT.gguf f32|bf16 [SPLIT_MAX_TENSORS]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERTER = "convert_hf_to_gguf.py"


def llamacpp_src() -> Path | None:
    """llama.cpp's source tree holding convert_hf_to_gguf.py and conversion/, or None."""
    env = os.environ.get("DELTAFIND_LLAMACPP_SRC")
    for p in [Path(env)] if env else [ROOT / ".venv" / "llama.cpp-src"]:
        if (p / CONVERTER).is_file() and (p / "conversion").is_dir():
            return p
    return None


def has_k3_tables() -> bool:
    """Whether the installed gguf-py knows KIMI_K3 (llama.cpp's own does; PyPI's 0.19.0 does not)."""
    import gguf

    return hasattr(gguf.MODEL_ARCH, "KIMI_K3")


def need_k3_gguf() -> Path:
    """llama.cpp's source tree, or skip the test naming the fix."""
    import pytest

    src = llamacpp_src()
    if src is None or not has_k3_tables():
        pytest.skip(
            "needs llama.cpp's own gguf-py (KIMI_K3 tables) and converter: `make dev` installs them "
            "into .venv/llama.cpp-src (or set DELTAFIND_LLAMACPP_SRC to llama.cpp's source tree)"
        )
    return src


def make_k3_hf(dest: Path, seed: int = 0, shape: str = "tiny") -> Path:
    """deltafind's synthetic K3 as its release lays it out (`language_model.` names, MXFP4 experts)."""
    from deltafind.importer.synthetic import open_synthetic, write_hf_folder

    return write_hf_folder(open_synthetic("kimi_k3", shape, seed), dest, prefix="language_model.")


def convert_k3(
    hf: Path, out: Path, outtype: str = "f32", split_max_tensors: int | None = None
) -> Path:
    """Run llama.cpp's converter on `hf`; the GGUF written (the first shard when split)."""
    src = llamacpp_src()
    if src is None:
        raise FileNotFoundError("llama.cpp's converter not found: run `make dev`")
    cmd = [sys.executable, __file__, "convert", str(hf), str(out), outtype]
    if split_max_tensors:
        cmd.append(str(split_max_tensors))
    env = {**os.environ, "DELTAFIND_LLAMACPP_SRC": str(src), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {hf}:\n{done.stderr[-4000:]}")
    if split_max_tensors:
        return out.with_name(f"{out.stem}-00001-of-{_count(out):05d}.gguf")
    return out


def _count(out: Path) -> int:
    return len(list(out.parent.glob(f"{out.stem}-*-of-*.gguf")))


class _KimiTiktoken:
    """What llama.cpp's KimiLinearModel.set_vocab reads of Moonshot's TikTokenTokenizer
    (tokenization_kimi.py, remote code the synthetic folder lacks), built as that class builds it:
    tiktoken ranks from tiktoken.model, then 256 reserved ids named by tokenizer_config.json's
    added_tokens_decoder, `<|reserved_token_{id}|>` where it names none (docs/kimi-k3-format.md §6.1).
    """

    def __init__(self, folder: str | Path, **_: object) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        from deltafind.tokenizer.bpe import KIMI_PATTERN

        folder = Path(folder)
        ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        named = {int(i): e["content"] for i, e in config["added_tokens_decoder"].items()}
        first = len(ranks)
        self.special_tokens = {
            named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, first + 256)
        }
        self.model = tiktoken.Encoding(
            "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.bos_id = self.special_tokens[config["bos_token"]]
        self.eos_id = self.special_tokens[config["eos_token"]]


def _set_vocab(model_class: type) -> None:
    """Let llama.cpp's own KimiK3Model.set_vocab (and the KimiLinearModel.set_vocab it borrows) run.

    AutoTokenizer gives `_KimiTiktoken`, and the pre-tokenizer name is "kimi-k2": the converter finds
    it by hashing the ids of a probe text, which only the real 163,584-rank vocabulary matches.
    """
    import transformers

    transformers.AutoTokenizer.from_pretrained = staticmethod(_KimiTiktoken)
    model_class.get_vocab_base_pre = lambda self, tokenizer: "kimi-k2"


def _convert_main(hf: str, out: str, outtype: str, split: str | None = None) -> None:
    src = os.environ["DELTAFIND_LLAMACPP_SRC"]
    sys.path.insert(0, src)
    import gguf

    assert hasattr(gguf.MODEL_ARCH, "KIMI_K3"), f"{gguf.__file__} has no KIMI_K3 tables"
    from conversion.kimi_k3 import KimiK3Model

    _set_vocab(KimiK3Model)
    sys.argv = [CONVERTER, hf, "--outfile", out, "--outtype", outtype]
    if split:
        sys.argv += ["--split-max-tensors", split]
    import convert_hf_to_gguf

    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if len(sys.argv) < 5 or sys.argv[1] != "convert":
        sys.exit(__doc__)
    _convert_main(*sys.argv[2:])
