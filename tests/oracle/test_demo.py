"""The bundled demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) against llama.cpp on the same file.

tests/data/smollm2_llamacpp_reference.json was made once by
tests/data/make_llamacpp_reference.py with llama-cpp-python. llama.cpp multiplies
Q4_1 weights by Q8-quantized activations while we run the dequantized weights in
fp32, so the engines may differ where llama.cpp's own top two are close; where
its top choice is clear (margin > 0.5 logit) they must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltafind import Model

REF = json.loads(
    (Path(__file__).parents[1] / "data" / "smollm2_llamacpp_reference.json").read_text()
)
CLEAR_MARGIN = 0.5


@pytest.fixture(scope="module")
def demo(demo_store: Path):
    model = Model.open(demo_store)
    yield model
    model.close()


def test_tokenizer_matches_llamacpp(demo: Model) -> None:
    assert demo.tokenizer.encode(REF["paragraph"]) == [p["token"] for p in REF["positions"]]
    assert demo.tokenizer.encode(REF["prompt"]) == REF["prompt_ids"]


def test_teacher_forced_predictions_agree_with_llamacpp(demo: Model) -> None:
    tokens = [p["token"] for p in REF["positions"]]
    top1 = demo.forward_logits(tokens).argmax(-1).tolist()
    clear = [(i, p) for i, p in enumerate(REF["positions"]) if p["margin"] > CLEAR_MARGIN]
    assert len(clear) >= 100
    disagree = [(i, top1[i], p["top1"]) for i, p in clear if top1[i] != p["top1"]]
    assert not disagree, disagree
    outside_top5 = [i for i, p in enumerate(REF["positions"]) if top1[i] not in p["top5"]]
    assert not outside_top5


def test_capital_of_france_is_paris(demo: Model) -> None:
    new = demo.generate(demo.tokenizer.encode("The capital of France is"), max_new_tokens=16)
    assert demo.tokenizer.decode(new).startswith(" Paris")
    # Greedy continuations agree with llama.cpp up to its first close call.
    clear_prefix = next(i for i, m in enumerate(REF["continuation_margins"]) if m < CLEAR_MARGIN)
    assert new[:clear_prefix] == REF["continuation_ids"][:clear_prefix]
