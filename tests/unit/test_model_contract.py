"""Every registered family keeps the model contract (deltafind/models/contract.py).

Each family's Model is built on the meta device from a tiny config (transformers' own config
classes, K3's synthetic one) and checked for every member code outside models/ uses.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from deltafind.models.contract import FamilyArgs, FamilyModel, RoutedExperts, token_widths
from deltafind.models.registry import FAMILIES, family_module
from deltafind.provider import ExpertProvider

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)


def tiny_config(model_type: str) -> dict:
    import transformers as T

    if model_type == "kimi_k3":
        from deltafind.importer.synthetic_k3 import SHAPES, text_config

        return text_config(SHAPES["tiny"])
    cls, extra = {
        "llama": (T.LlamaConfig, {}),
        "qwen2": (T.Qwen2Config, {}),
        "qwen3": (T.Qwen3Config, {"head_dim": 16}),
        "qwen3_moe": (T.Qwen3MoeConfig, {**MOE, "num_experts": 8, "mlp_only_layers": [0]}),
        "deepseek_v3": (
            T.DeepseekV3Config,
            {
                **MOE,
                "n_routed_experts": 8,
                "n_group": 2,
                "topk_group": 1,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "first_k_dense_replace": 1,
            },
        ),
        "kimi_k2": (
            T.DeepseekV3Config,
            {
                **MOE,
                "n_routed_experts": 8,
                "n_group": 1,
                "topk_group": 1,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "first_k_dense_replace": 1,
            },
        ),
        "olmoe": (T.OlmoeConfig, {"num_experts": 8, "num_experts_per_tok": 2}),
    }[model_type]
    return cls(**{**TINY, **extra}).to_dict()


class Counts(ExpertProvider):
    dtype = torch.bfloat16

    def num_experts(self, layer_idx: int) -> int:
        return 8


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_keeps_the_model_contract(model_type: str) -> None:
    family = family_module(model_type)
    args = family.ModelArgs.from_config(tiny_config(model_type))
    with torch.device("meta"):
        net = family.Model(args, Counts())
    assert isinstance(net, FamilyModel), (
        f"{model_type}: Model must subclass models/contract.py's FamilyModel"
    )
    for name, kind in inspect.get_annotations(FamilyArgs, eval_str=True).items():
        assert isinstance(getattr(args, name, None), kind), (
            f"{model_type}: ModelArgs.{name} must be a {kind.__name__}"
        )
    assert all(w >= 0 for w in token_widths(args)) and token_widths(args)[0] == args.hidden_size
    assert isinstance(net.lm_head, nn.Linear) and isinstance(net.embed_tokens, nn.Embedding)
    assert net.vocab_size == args.vocab_size and net.device.type == "meta"
    assert net.num_layers == args.num_hidden_layers
    assert net.recurrent is (model_type == "kimi_k3"), (
        f"{model_type}: `recurrent` must say whether a layer's state cannot be rewound"
    )
    params = inspect.signature(net.forward).parameters
    assert list(params) == ["input_ids", "batch", "all_logits", "num_layers"], (
        f"{model_type}: forward's signature left the contract"
    )
    runs = net.routed_runs()
    assert all(callable(r) for r in runs.values())
    routed = {m.layer_idx for m in net.modules() if isinstance(m, RoutedExperts)}
    assert set(runs) == routed and (routed or model_type in ("llama", "qwen2", "qwen3")), (
        f"{model_type}: its routed layers are not RoutedExperts"
    )
    assert all(isinstance(m.gate, nn.Module) for m in net.modules() if isinstance(m, RoutedExperts))
