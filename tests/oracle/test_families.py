"""Each family, imported through `setup --from` into a store, against transformers.

Tiny random checkpoints are written by transformers itself (from_config +
save_pretrained); our engine must reproduce its logits (fp32, 1e-4) and its
greedy tokens, and incremental decode must equal full recompute.
"""

from __future__ import annotations

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from tests.conftest import make_hf_checkpoint

CASES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-gqa1-3layers": ("llama", {"num_key_value_heads": 1, "num_hidden_layers": 3}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe-norm": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-nonorm-dense0": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [0]}),
    "deepseek_v3-dense1-groups2": ("deepseek_v3", {}),
    "olmoe-clip": ("olmoe", {"clip_qkv": 0.5}),
    "olmoe-norm-gqa": ("olmoe", {"norm_topk_prob": True}),
    "deepseek_v3-groups4-top2-noqlora": (
        "deepseek_v3",
        {
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": False,
            "q_lora_rank": None,
            "num_hidden_layers": 3,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import transformers as T

    family, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = make_hf_checkpoint(family, root / "hf", seed=len(request.param), **overrides)
    store = root / "store"
    setup_store(hf_dir, store, [root / "d0", root / "d1"], dense_slices=4, progress=False)
    ours = Model.open(store)
    theirs = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    yield ours, theirs
    ours.close()


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_transformers(pair) -> None:
    ours, theirs = pair
    ids = _ids(20)
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0].float()
    got = ours.forward_logits(ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_generate(pair) -> None:
    ours, theirs = pair
    ids = _ids(6, seed=2)
    with torch.no_grad():
        ref = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert ours.generate(ids, max_new_tokens=16) == ref


def test_incremental_decode_equals_full_recompute(pair) -> None:
    from deltafind.models.ops.batch import SequenceCache, forward_step

    ours, _ = pair
    ids = _ids(14, seed=3)
    full = ours.forward_logits(ids)
    cache = SequenceCache(ours.net.num_layers)
    with torch.inference_mode():
        steps = [forward_step(ours.net, cache, ids[:8], all_logits=True)]
        steps += [forward_step(ours.net, cache, [t]) for t in ids[8:]]
    torch.testing.assert_close(torch.cat(steps), full, atol=2e-5, rtol=0)
