"""KDA against independent references: fla-core's pure-torch KDA, transformers' Kimi Linear
layer, and the per-token pseudo-code of docs/kimi-k3-format.md §4.10.

Where K3 and Kimi Linear differ, the layer has a switch and each side is tested:
Kimi Linear's form (low-rank output gate, softplus gate with per-head A_log,
x/sqrt(|x|^2+1e-6)) against transformers; K3's (full-rank g_proj, safe gate with
the -5 bound and per-channel A_log, F.normalize) against the spec.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltafind.models.ops.batch import Batch, SequenceCache
from deltafind.models.ops.kda import kda_chunked, kda_recurrent, l2_normalize, safe_gate
from deltafind.models.ops.kda_layer import KDAOptions, KimiDeltaAttention

H, NH, K = 32, 3, 8


def _fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla-core is not installed (it is in the test extra)")
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    # Loaded as a file: importing fla.ops pulls triton, which the CPU env must not have.
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _inputs(t: int, seed: int = 0, nh: int = NH, k: int = K, v: int = 6):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, nh, k, generator=g)) / k**0.5
    key = l2_normalize(torch.randn(t, nh, k, generator=g))
    val = torch.randn(t, nh, v, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(t, nh, k, generator=g))
    beta = torch.sigmoid(torch.randn(t, nh, generator=g))
    s0 = torch.randn(nh, k, v, generator=g)
    return q, key, val, gate, beta, s0


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_equals_recurrent(chunk: int) -> None:
    q, k, v, g, b, s0 = _inputs(37)
    o1, s1 = kda_recurrent(q, k, v, g, b, s0.clone())
    o2, s2 = kda_chunked(q, k, v, g, b, s0.clone(), chunk_size=chunk)
    torch.testing.assert_close(o2, o1, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(s2, s1, atol=2e-6, rtol=1e-5)


def test_both_forms_equal_fla_naive_kda() -> None:
    fla = _fla_naive()
    q, k, v, g, b, s0 = _inputs(48, seed=1)
    args = (q[None], k[None], v[None], g[None], b[None])
    ref_o, ref_s = fla.naive_recurrent_kda(
        *args, scale=1.0, initial_state=s0[None].clone(), output_final_state=True
    )
    ch_o, ch_s = fla.naive_chunk_kda(
        *args, scale=1.0, initial_state=s0[None].clone(), output_final_state=True, chunk_size=16
    )
    for ours in (kda_recurrent(q, k, v, g, b, s0.clone()), kda_chunked(q, k, v, g, b, s0.clone())):
        for theirs_o, theirs_s in ((ref_o, ref_s), (ch_o, ch_s)):
            torch.testing.assert_close(ours[0], theirs_o[0], atol=5e-6, rtol=1e-5)
            torch.testing.assert_close(ours[1], theirs_s[0], atol=5e-6, rtol=1e-5)


def _hf_layer(seed: int = 0):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = KimiLinearConfig(
        vocab_size=100,
        hidden_size=H,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=2,
        linear_attn_config={
            "head_dim": K,
            "num_heads": NH,
            "short_conv_kernel_size": 4,
            "kda_layers": [1],
            "full_attn_layers": [2],
        },
        rms_norm_eps=1e-5,
        hidden_act="silu",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    layer = KimiLinearDeltaAttention(cfg, 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.3 if "o_norm" not in name else 0.1)
                + (1.0 if "o_norm" in name else 0.0)
            )
        layer.forget_gate.A_log.copy_(
            torch.empty(NH).uniform_(1.0, 16.0, generator=g).log().view(1, 1, NH, 1)
        )
        layer.forget_gate.dt_bias.copy_(torch.empty(NH * K).uniform_(-2.0, 1.0, generator=g))
    return cfg, layer


def _ours_from_hf(hf, **opts) -> KimiDeltaAttention:
    base = {
        "full_rank_gate": False,
        "gate_lower_bound": None,
        "a_log_per_channel": False,
        "l2norm": "add_eps",
        "norm_eps": 1e-5,
    }
    layer = KimiDeltaAttention(KDAOptions(H, NH, K, **{**base, **opts}), layer_idx=0)
    d = NH * K
    conv = hf.conv1d.weight.detach()
    sd = {
        "q_proj.weight": hf.q_proj.weight,
        "k_proj.weight": hf.k_proj.weight,
        "v_proj.weight": hf.v_proj.weight,
        "q_conv1d.weight": conv[:d],
        "k_conv1d.weight": conv[d : 2 * d],
        "v_conv1d.weight": conv[2 * d :],
        "f_a_proj.weight": hf.forget_gate.f_a_proj.weight,
        "f_b_proj.weight": hf.forget_gate.f_b_proj.weight,
        "A_log": hf.forget_gate.A_log.reshape(NH),
        "dt_bias": hf.forget_gate.dt_bias,
        "b_proj.weight": hf.b_proj.weight,
        "o_norm.weight": hf.o_norm.weight,
        "o_proj.weight": hf.o_proj.weight,
    }
    if opts.get("full_rank_gate"):
        sd["g_proj.weight"] = (
            hf.g_b_proj.weight @ hf.g_a_proj.weight
        )  # the low-rank pair as one matrix
    else:
        sd.update({"g_a_proj.weight": hf.g_a_proj.weight, "g_b_proj.weight": hf.g_b_proj.weight})
    layer.load_state_dict({k: v.detach().clone() for k, v in sd.items()})
    return layer.eval()


def _run(layer: KimiDeltaAttention, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    cache, outs, start = SequenceCache(1), [], 0
    for n in splits:
        batch = Batch.of([(cache, n)])
        outs.append(layer(x[start : start + n], batch))
        batch.advance()
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("prefill", ["chunked", "recurrent"])
def test_layer_equals_transformers_kimi_linear_kda(prefill: str) -> None:
    from transformers import DynamicCache

    cfg, hf = _hf_layer()
    ours = _ours_from_hf(hf, prefill=prefill, chunk_size=4)
    x = torch.randn(1, 11, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref_full = hf(x)[0]
        cache = DynamicCache(config=cfg)
        ref_inc = torch.cat(
            [hf(x[:, :6], cache=cache)[0]]
            + [hf(x[:, i : i + 1], cache=cache)[0] for i in range(6, 11)]
        )
        full = _run(ours, x[0], [11])
        inc = _run(ours, x[0], [6, 1, 1, 1, 1, 1])
    torch.testing.assert_close(full, ref_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc, ref_inc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_full_rank_gate_switch_is_the_low_rank_product() -> None:
    _, hf = _hf_layer(seed=3)
    ours = _ours_from_hf(hf, full_rank_gate=True)
    x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(_run(ours, x[0], [5]), hf(x)[0], atol=1e-5, rtol=1e-5)


def _spec_kda_step(xa, w, st):
    """Spec 4.10's pseudo-code, transcribed (with the K3 sizes replaced by NH and K)."""

    def conv(u, wt, c):
        src = torch.cat([c[:, 1:], u[:, None]], 1)
        return F.silu((src * wt[:, 0, :]).sum(1)), src

    q, st["cq"] = conv(xa @ w["q_proj.weight"].T, w["q_conv1d.weight"], st["cq"])
    k, st["ck"] = conv(xa @ w["k_proj.weight"].T, w["k_conv1d.weight"], st["ck"])
    v, st["cv"] = conv(xa @ w["v_proj.weight"].T, w["v_conv1d.weight"], st["cv"])
    q = F.normalize(q.view(NH, K), dim=-1, eps=1e-12) / K**0.5
    k = F.normalize(k.view(NH, K), dim=-1, eps=1e-12)
    v = v.view(NH, K)
    beta = torch.sigmoid(xa @ w["b_proj.weight"].T)
    f = (xa @ w["f_a_proj.weight"].T) @ w["f_b_proj.weight"].T
    g = -5.0 * torch.sigmoid(w["A_log"].exp()[None] * (f + w["dt_bias"]).view(NH, K))
    s = st["S"] * g.exp()[:, :, None]
    delta = v - torch.einsum("hk,hkv->hv", k, s)
    s = s + torch.einsum("hk,hv->hkv", beta[:, None] * k, delta)
    st["S"] = s
    o = torch.einsum("hk,hkv->hv", q, s)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w["o_norm.weight"]
    o = o * torch.sigmoid((xa @ w["g_proj.weight"].T).view(NH, K))
    return o.reshape(-1) @ w["o_proj.weight"].T


def test_k3_form_equals_the_spec_pseudo_code() -> None:
    layer = KimiDeltaAttention(KDAOptions(H, NH, K), layer_idx=0).eval()  # K3 defaults
    g = torch.Generator().manual_seed(11)
    w = {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in layer.named_parameters()}
    w["A_log"] = (
        torch.empty(K).uniform_(1.0, 16.0, generator=g).log()
    )  # per key channel, shared by heads
    w["o_norm.weight"] = 1.0 + 0.1 * torch.randn(K, generator=g)
    layer.load_state_dict(w)
    x = torch.randn(9, H, generator=g)
    st = {
        "cq": torch.zeros(NH * K, 4),
        "ck": torch.zeros(NH * K, 4),
        "cv": torch.zeros(NH * K, 4),
        "S": torch.zeros(NH, K, K),
    }
    with torch.no_grad():
        ref = torch.stack([_spec_kda_step(x[i], w, st) for i in range(9)])
        torch.testing.assert_close(
            _run(layer, x, [9]), ref, atol=1e-5, rtol=1e-5
        )  # chunked prefill
        torch.testing.assert_close(
            _run(layer, x, [1] * 9), ref, atol=1e-5, rtol=1e-5
        )  # per-token decode


def test_safe_gate_bounds_and_per_channel_rate() -> None:
    f = torch.randn(4, NH, K) * 10
    a_log, dt = torch.randn(K), torch.randn(NH * K)
    g = safe_gate(f, a_log, dt, -5.0, per_channel=True)
    assert ((g >= -5.0) & (g <= 0)).all()  # (-5, 0) in reals; fp32 saturates at the ends
    torch.testing.assert_close(
        g, -5.0 * torch.sigmoid(a_log.exp()[None, None, :] * (f + dt.view(NH, K))), atol=0, rtol=0
    )
