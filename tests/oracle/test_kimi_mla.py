"""Gated NoPE MLA: transformers' Kimi Linear MLA with the gate off, a plain attention
written here from docs/kimi-k3-format.md §4.5 with it on, and cached decode against full recompute.

transformers builds the latent norms with eps 1e-6, deltafin (and our default)
with rms_norm_eps = 1e-5: the `latent_norm_eps` switch, set to each side's value.
"""

from __future__ import annotations

import pytest
import torch

from deltafind.models.ops.batch import Batch, SequenceCache
from deltafind.models.ops.mla_nope import GatedNoPEMLA, MLAOptions

H, NH, QL, KVL, NOPE, ROPE, V = 32, 3, 16, 8, 8, 4, 6


def _opts(**kw) -> MLAOptions:
    return MLAOptions(H, NH, QL, KVL, NOPE, ROPE, V, **kw)


def _random_layer(seed: int, **kw) -> GatedNoPEMLA:
    layer = GatedNoPEMLA(_opts(**kw), layer_idx=0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if "layernorm" in name
                else 0.3 * torch.randn(p.shape, generator=g)
            )
    return layer


def _run(layer: GatedNoPEMLA, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    cache, outs, start = SequenceCache(1), [], 0
    for n in splits:
        batch = Batch.of([(cache, n)])
        outs.append(layer(x[start : start + n], batch))
        batch.advance()
        start += n
    return torch.cat(outs)


def _causal(n: int, past: int) -> torch.Tensor:
    mask = torch.full((n, past + n), float("-inf")).triu(past + 1)
    return mask[None, None]


def test_gate_off_equals_transformers_kimi_linear_mla() -> None:
    from transformers import DynamicCache, KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    cfg = KimiLinearConfig(
        vocab_size=100,
        hidden_size=H,
        num_attention_heads=NH,
        num_key_value_heads=NH,
        num_hidden_layers=2,
        q_lora_rank=QL,
        kv_lora_rank=KVL,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
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
    ours = _random_layer(0, output_gate=False, latent_norm_eps=1e-6)
    hf = KimiLinearAttention(cfg, layer_idx=1).eval()
    hf.load_state_dict({k: v for k, v in ours.state_dict().items()})
    x = torch.randn(1, 9, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x, attention_mask=_causal(9, 0))[0][0]
        cache = DynamicCache(config=cfg)
        ref_inc = [hf(x[:, :5], attention_mask=_causal(5, 0), cache=cache)[0][0]]
        ref_inc += [
            hf(x[:, i : i + 1], attention_mask=_causal(1, i), cache=cache)[0][0]
            for i in range(5, 9)
        ]
        torch.testing.assert_close(_run(ours, x[0], [9]), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            _run(ours, x[0], [5, 1, 1, 1, 1]), torch.cat(ref_inc), atol=1e-5, rtol=1e-5
        )


def _plain_gated_attention(layer: GatedNoPEMLA, x: torch.Tensor) -> torch.Tensor:
    """Spec 4.5 written out: normalised latents, shared unrotated k_pe, 192^-0.5-style scale, causal, gate."""
    w = {k: v for k, v in layer.state_dict().items()}
    rms = lambda t, wt: wt * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))  # noqa: E731
    t = x.shape[0]
    q = (rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T).view(
        t, NH, NOPE + ROPE
    )
    ckv = x @ w["kv_a_proj_with_mqa.weight"].T
    c, k_pe = rms(ckv[:, :KVL], w["kv_a_layernorm.weight"]), ckv[:, KVL:]
    kvb = (c @ w["kv_b_proj.weight"].T).view(t, NH, NOPE + V)
    k = torch.cat([kvb[:, :, :NOPE], k_pe[:, None, :].expand(t, NH, ROPE)], -1)
    v = kvb[:, :, NOPE:]
    out = torch.empty(t, NH, V)
    for i in range(t):  # row i sees rows 0..i
        scores = torch.einsum("hd,jhd->hj", q[i], k[: i + 1]) / (NOPE + ROPE) ** 0.5
        out[i] = torch.einsum("hj,jhv->hv", torch.softmax(scores, -1), v[: i + 1])
    out = out.reshape(t, NH * V) * torch.sigmoid(x @ w["g_proj.weight"].T)
    return out @ w["o_proj.weight"].T


def test_gate_on_equals_plain_attention_and_cache_equals_recompute() -> None:
    layer = _random_layer(2)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _plain_gated_attention(layer, x)
        full = _run(layer, x, [10])
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_run(layer, x, [4, 1, 3, 1, 1]), full, atol=1e-5, rtol=1e-5)


def test_two_sequences_in_one_batch_equal_each_alone() -> None:
    layer = _random_layer(4)
    xa, xb = torch.randn(6, H), torch.randn(4, H)
    with torch.no_grad():
        alone_a, alone_b = _run(layer, xa, [6]), _run(layer, xb, [3, 1])
        ca, cb = SequenceCache(1), SequenceCache(1)
        pre = Batch.of([(cb, 3)])
        layer(xb[:3], pre)
        pre.advance()
        both = Batch.of([(ca, 6), (cb, 1)])
        out = layer(torch.cat([xa, xb[3:]]), both)
    torch.testing.assert_close(out[:6], alone_a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[6:], alone_b[3:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("gate", [True, False])
def test_no_rotary_anywhere(gate: bool) -> None:
    # NoPE: attention depends on positions only through the mask, so a token attending
    # to the same keys gives the same output whatever its absolute position.
    layer = _random_layer(5, output_gate=gate)
    x = torch.randn(1, H).expand(5, H).contiguous()  # the same token five times
    with torch.no_grad():
        out = _run(layer, x, [5])
    torch.testing.assert_close(out, out[:1].expand(5, H), atol=1e-6, rtol=1e-6)
