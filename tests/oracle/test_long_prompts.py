"""Long prompts against transformers' eager attention (the textbook softmax, scores materialised).

Prefill attention runs torch's CPU flash kernel: one causal pass for a whole prompt, or the cached
keys and the new rows as two passes merged by log-sum-exp for a prompt in chunks. Both must give
transformers' logits within the tolerance of tests/oracle/test_families.py, on 2k-token prompts,
for GQA, q/k-normed heads and MLA (q.k and v of different widths), and K3's gated NoPE MLA layer.
"""

from __future__ import annotations

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.models.ops.batch import SequenceCache, forward_step
from tests.conftest import TINY_VOCAB, make_hf_checkpoint

PROMPT_TOKENS = 2048
CASES = {
    "llama-gqa": ("llama", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "deepseek_v3": ("deepseek_v3", {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import transformers as T

    family, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = make_hf_checkpoint(
        family, root / "hf", seed=7, max_position_embeddings=4096, **overrides
    )
    store = root / "store"
    setup_store(hf_dir, store, [root / "d0"], progress=False)
    ours = Model.open(store)
    theirs = T.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    yield ours, theirs
    ours.close()


def test_long_prompt_whole_and_in_chunks_match_transformers(pair) -> None:
    ours, theirs = pair
    ids = torch.randint(
        0, TINY_VOCAB, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0].float()  # [T, V]
    torch.testing.assert_close(ours.forward_logits(ids), ref, atol=1e-4, rtol=0)
    cache = SequenceCache(ours.net.num_layers)
    with torch.inference_mode():
        first = forward_step(ours.net, cache, ids[:1500], all_logits=True)
        rest = forward_step(
            ours.net, cache, ids[1500:], all_logits=True
        )  # 548 rows after 1,500 cached
    torch.testing.assert_close(torch.cat([first, rest]), ref, atol=1e-4, rtol=0)


def test_kimi_mla_layer_on_a_long_prompt_matches_transformers() -> None:
    """K3's MLA layer (gate off) against transformers' Kimi Linear MLA, eager, on 2k rows, whole and split."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    from tests.oracle import test_kimi_mla as mla

    cfg = KimiLinearConfig(
        vocab_size=100,
        hidden_size=mla.H,
        num_attention_heads=mla.NH,
        num_key_value_heads=mla.NH,
        num_hidden_layers=2,
        q_lora_rank=mla.QL,
        kv_lora_rank=mla.KVL,
        qk_nope_head_dim=mla.NOPE,
        qk_rope_head_dim=mla.ROPE,
        v_head_dim=mla.V,
        linear_attn_config={
            "head_dim": 8,
            "num_heads": 2,
            "kda_layers": [1],
            "full_attn_layers": [2],
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = "eager"
    ours = mla._random_layer(4, output_gate=False, latent_norm_eps=1e-6)
    hf = KimiLinearAttention(cfg, layer_idx=1).eval()
    hf.load_state_dict(ours.state_dict())
    x = torch.randn(1, PROMPT_TOKENS, mla.H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(x, attention_mask=mla._causal(PROMPT_TOKENS, 0))[0][0]
        torch.testing.assert_close(mla._run(ours, x[0], [PROMPT_TOKENS]), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mla._run(ours, x[0], [1000, 1047, 1]), ref, atol=1e-5, rtol=1e-5)
