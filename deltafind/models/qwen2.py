"""Qwen2 / Qwen2.5 dense: the Llama layout with a bias on q, k and v (none on o_proj), as
transformers' Qwen2Attention has it whatever the config says."""

from __future__ import annotations

from dataclasses import dataclass

from deltafind.models import llama
from deltafind.provider import ExpertProvider


@dataclass
class ModelArgs(llama.ModelArgs):
    attention_bias: bool = True  # q/k/v; Qwen2 configs carry no such key


class Model(llama.Model):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        super().__init__(args, experts)
        for layer in self.model.layers:
            layer.self_attn.o_proj.register_parameter("bias", None)


weight_names = llama.weight_names
