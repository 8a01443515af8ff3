"""Qwen3 dense: the Llama layout plus per-head q/k RMSNorm before rope."""

from __future__ import annotations

from deltafind.models import llama

ModelArgs = llama.ModelArgs


class Model(llama.Model):
    qk_norm = True


weight_names = llama.weight_names
