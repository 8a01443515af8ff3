"""deepseek_v3 (and kimi_k2) against transformers' DeepseekV3ForCausalLM on tiny random checkpoints.

Each case saves a random HF model, splits the saved safetensors into spine and
experts (dense MLPs cut into slices) with a small local helper, and checks
logits, incremental decode, batching, greedy tokens and bf16. The on-disk store
path is tested elsewhere.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltafind.errors import UnsupportedModelError
from deltafind.models import deepseek_v3
from deltafind.models.ops.batch import Batch, SequenceCache
from deltafind.models.registry import family_module
from deltafind.models.transformer import make_rope
from deltafind.provider import DictExpertProvider

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

NUM_SLICES = 4
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,  # HF's default is 128, which breaks its eager attention; MLA ignores it
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,  # generate must not stop early
    pad_token_id=None,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
CASES = {
    "dense_first_grouped_yarn": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        q_lora_rank=24,
        rope_parameters=dict(YARN, mscale_all_dim=1.0),
    ),
    "plain_q_group4_no_yarn": dict(
        num_hidden_layers=2,
        first_k_dense_replace=0,
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        q_lora_rank=None,
        n_shared_experts=2,
        rope_interleave=False,
        attention_bias=True,
        routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    "kimi_like_yarn_mscale": dict(  # one group, both mscales, beta_fast == beta_slow as in Kimi K2
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        q_lora_rank=24,
        routed_scaling_factor=2.827,
        rms_norm_eps=1e-2,  # the latent norms keep eps 1e-6 in HF: this catches mixing them up
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0, beta_fast=1.0, beta_slow=1.0),
    ),
}

PROJ = r"(gate_proj|up_proj|down_proj)"
EXPERT_RE = re.compile(rf"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.{PROJ}\.weight")
DENSE_RE = re.compile(rf"model\.layers\.(\d+)\.mlp\.{PROJ}\.weight")


def split_checkpoint(
    path: Path, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], DictExpertProvider]:
    """Spine tensors and a provider of routed experts plus dense-MLP slices, from saved safetensors."""
    spine: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in load_file(path / "model.safetensors").items():
        if m := EXPERT_RE.fullmatch(name):
            experts[(int(m[1]), int(m[2]))][m[3]] = t.to(dtype)
        elif m := DENSE_RE.fullmatch(name):
            dim = 1 if m[2] == "down_proj" else 0  # slice the intermediate dim
            for s, part in enumerate(t.chunk(NUM_SLICES, dim=dim)):
                experts[(int(m[1]), s)][m[2]] = part.to(dtype).contiguous()
        else:
            spine[name] = t
    return spine, DictExpertProvider(experts)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and non-degenerate routing: HF's init is tiny and leaves the bias zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # fused experts are [E, out, in]: the last dim is fan-in everywhere
                p.copy_(noise / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core box they spin for seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_ours(path: Path, dtype: torch.dtype = torch.float32) -> deepseek_v3.Model:
    """Our model from a saved HF folder; the router stays fp32 as HF keeps it."""
    args = deepseek_v3.ModelArgs.from_config(json.loads((path / "config.json").read_text()))
    spine, experts = split_checkpoint(path, dtype)
    keep_fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    spine = {k: v if k.endswith(keep_fp32) else v.to(dtype) for k, v in spine.items()}
    with torch.device("meta"):
        model = deepseek_v3.Model(args, experts)
    model.load_state_dict(spine, assign=True, strict=True)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(HF model, our model, saved folder) with the same weights, for one case."""
    config = transformers.DeepseekV3Config(**(BASE | CASES[request.param]))
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize(hf, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_ours(path), path


def tokens(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def full_logits(model: deepseek_v3.Model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, Batch.of([(SequenceCache(model.num_layers), len(ids))]), all_logits=True)


@torch.no_grad()
def test_logits_match_transformers(case):
    hf, ours, _ = case
    ids = tokens(16)
    expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(ours, ids), expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_incremental_decode_matches_full_recompute(case):
    _, ours, _ = case
    ids = tokens(16)
    cache = SequenceCache(ours.num_layers)
    last = ours(ids[:8], Batch.of([(cache, 8)]))[0]
    for n in range(8, 17):
        torch.testing.assert_close(last, full_logits(ours, ids[:n])[-1], atol=1e-5, rtol=0)
        if n < 16:
            last = ours(ids[n : n + 1], Batch.of([(cache, 1)]))[0]
    assert cache.length == 16


@torch.no_grad()
def test_two_sequences_in_one_batch_match_separate_runs(case):
    _, ours, _ = case
    a, b = tokens(5, seed=4), tokens(11, seed=5)
    caches = [SequenceCache(ours.num_layers) for _ in range(2)]
    both = ours(torch.cat([a, b]), Batch.of([(caches[0], 5), (caches[1], 11)]))  # [2, V]
    torch.testing.assert_close(both[0], full_logits(ours, a)[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1], full_logits(ours, b)[-1], atol=1e-5, rtol=0)


@torch.no_grad()
def test_greedy_tokens_match_generate(case):
    hf, ours, _ = case
    prompt = tokens(8, seed=3)
    mask = torch.ones(1, 8, dtype=torch.long)
    expected = hf.generate(prompt[None], attention_mask=mask, do_sample=False, max_new_tokens=16)
    expected = expected[0, 8:].tolist()
    cache, got = SequenceCache(ours.num_layers), []
    step = prompt
    for _ in range(16):
        next_id = int(ours(step, Batch.of([(cache, len(step))]))[0].argmax())
        got.append(next_id)
        step = torch.tensor([next_id])
    assert got == expected


@torch.no_grad()
def test_bf16_runs_in_bf16_and_is_no_worse_than_transformers_bf16(case):
    hf, _, path = case
    ours = load_ours(path, torch.bfloat16)
    seen = []
    ours.model.norm.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )  # the last hidden state
    ids = tokens(16)
    reference = hf(ids[None]).logits[0]
    hf_bf16 = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_error = (hf_bf16(ids[None]).logits[0].float() - reference).abs().max().item()
    our_error = (full_logits(ours, ids) - reference).abs().max().item()
    assert seen == [torch.bfloat16]
    assert our_error <= 2 * hf_error + 1e-2, (our_error, hf_error)


OLD_STYLE = dict(  # DeepSeek's and Kimi K2's own config.json spelling
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
    topk_group=1, rope_theta=50000.0, max_position_embeddings=32 * 4096, topk_method="noaux_tc",
    scoring_func="sigmoid", num_nextn_predict_layers=1, ep_size=1, aux_loss_alpha=0.001,
    rope_scaling=dict(type="yarn", factor=32.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0),
)  # fmt: skip


def test_config_keys_old_and_new_names():
    args = deepseek_v3.ModelArgs.from_config(OLD_STYLE)
    assert args.rope["rope_type"] == "yarn" and args.rope["rope_theta"] == 50000.0
    assert args.rope_interleave and args.n_routed_experts == 8
    renamed = {k: v for k, v in OLD_STYLE.items() if k != "n_routed_experts"} | {
        "num_local_experts": 16
    }
    assert deepseek_v3.ModelArgs.from_config(renamed).n_routed_experts == 16
    with pytest.raises(UnsupportedModelError, match="softmax"):
        deepseek_v3.ModelArgs.from_config(OLD_STYLE | {"scoring_func": "softmax"})
    assert family_module("kimi_k2") is deepseek_v3


def test_yarn_without_factor_uses_the_length_ratio():
    no_factor = OLD_STYLE | {
        "rope_scaling": {k: v for k, v in OLD_STYLE["rope_scaling"].items() if k != "factor"}
    }
    ropes = [make_rope(deepseek_v3.ModelArgs.from_config(c), dim=8) for c in (OLD_STYLE, no_factor)]
    torch.testing.assert_close(ropes[0].inv_freq, ropes[1].inv_freq, rtol=0, atol=0)
    assert ropes[0].scale == ropes[1].scale == 1.0  # mscale == mscale_all_dim


def test_sanitize_drops_mtp_layers():
    args = deepseek_v3.ModelArgs.from_config(OLD_STYLE)
    names = [
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.2.eh_proj.weight",
        "model.norm.weight",
    ]
    kept = deepseek_v3.sanitize(args, dict.fromkeys(names, torch.zeros(1)))
    assert sorted(kept) == [n for n in names if not n.startswith("model.layers.2.")]
