"""Kimi K3 from llama.cpp's GGUF (docs/kimi-k3-gguf.md): metadata -> the nested kimi_k3 config, and each
tensor of K3's roster (importer/synthetic_k3.py) found through gguf-py's own KIMI_K3 tables, with the
converter's transforms undone: MXFP4 blocks back into the release's packs, fused AttnRes scores, conv1d
and kv_b. `ssm_a` keeps n_head of K3's per-channel decay rates, so the import is refused unless the
caller asks for llama.cpp's reading (`GGUFOptions.llamacpp_k3`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltafind.errors import UnsupportedModelError
from deltafind.importer.sources import TensorInfo
from deltafind.importer.synthetic_k3 import QUANTIZATION_CONFIG, k3_roster

_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_FLOAT_KINDS = ("F32", "F16", "BF16")
MXFP4_BLOCK = 17  # ggml's block_mxfp4: one E8M0 byte, then 16 bytes of 32 nibbles
LLAMACPP_READING = (
    "llama.cpp's reading of Kimi K3 (ssm_a: one decay rate per head, not per channel)"
)


def _f32(x: Any) -> float:
    """A GGUF float32 field as the shortest decimal with the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def k3_config(meta: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """`kimi-k3.*` metadata -> {"text_config": ...} (docs/kimi-k3-gguf.md §2); the converter writes what
    K3's contract fixes (SiTU, sigmoid noaux_tc routing, NoPE MLA) only by asserting it."""
    n, heads = int(meta("block_count")), int(meta("attention.head_count"))
    kv = meta("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != n:
        raise UnsupportedModelError(
            f"kimi-k3.attention.head_count_kv is {kv!r}; llama.cpp's converter writes one entry per layer "
            "(0 = a KDA layer): reconvert with llama.cpp's convert_hf_to_gguf.py"
        )
    if int(meta("expert_gating_func")) != _SIGMOID:
        raise UnsupportedModelError(
            "kimi-k3.expert_gating_func is not sigmoid; K3 routes with sigmoid scores (noaux_tc)"
        )
    rope, lora = int(meta("rope.dimension_count")), int(meta("attention.kv_lora_rank"))
    if int(meta("attention.key_length", lora + rope)) != lora + rope:
        raise UnsupportedModelError(
            "kimi-k3.attention.key_length is not kv_lora_rank + rope.dimension_count (MLA's cached key)"
        )
    mla = [i + 1 for i, k in enumerate(kv) if int(k) > 0]
    lower = meta("kda.gate_lower_bound", None)  # absent: Kimi Linear's softplus gate
    text = {
        "model_type": "kimi_linear",
        "hidden_size": int(meta("embedding_length")),
        "intermediate_size": int(meta("feed_forward_length")),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "routed_expert_hidden_size": int(meta("expert_latent_length")),
        "num_hidden_layers": n,
        "num_experts": int(meta("expert_count")),
        "num_experts_per_token": int(meta("expert_used_count")),
        "num_shared_experts": int(meta("expert_shared_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": int(meta("context_length")),
        "attn_res_block_size": int(meta("attn_res.block_size")),
        "q_lora_rank": int(meta("attention.q_lora_rank")),
        "kv_lora_rank": lora,
        "qk_nope_head_dim": int(meta("attention.key_length_mla")) - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(meta("attention.value_length_mla")),
        "first_k_dense_replace": int(meta("leading_dense_block_count")),
        "moe_layer_freq": 1,  # llama.cpp runs MoE on every layer past the dense lead
        "num_expert_group": 1,
        "topk_group": int(meta("expert_group_used_count", 1)),
        "hidden_act": "situ",
        "activation_situ_beta": _f32(meta("activation.situ_beta")),
        "activation_situ_linear_beta": _f32(meta("activation.situ_linear_beta")),
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_renormalize": bool(meta("expert_weights_norm")),
        "routed_scaling_factor": _f32(meta("expert_weights_scale")),
        "latent_moe_use_norm": True,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "head_dim": int(meta("kda.head_dim")),
            "num_heads": heads,  # llama.cpp has one n_head for KDA and MLA
            "short_conv_kernel_size": int(meta("ssm.conv_kernel")),
            "use_full_rank_gate": True,
            "gate_lower_bound": None if lower is None else _f32(lower),
            "kda_layers": [i for i in range(1, n + 1) if i not in mla],
            "full_attn_layers": mla,
        },
        # the expert bytes are the release's (undone repack), so the release's scheme is true of them
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
    }
    return {"text_config": text}


def _sizes(text: dict[str, Any]) -> dict[str, Any]:
    """The roster's size keys (importer/synthetic_k3.py SHAPES) from a kimi_k3 text_config."""
    la = text["linear_attn_config"]
    return {
        "hidden": text["hidden_size"],
        "inter": text["intermediate_size"],
        "moe_inter": text["moe_intermediate_size"],
        "latent": text["routed_expert_hidden_size"],
        "heads": text["num_attention_heads"],
        "q_lora": text["q_lora_rank"],
        "kv_lora": text["kv_lora_rank"],
        "nope": text["qk_nope_head_dim"],
        "rope": text["qk_rope_head_dim"],
        "v": text["v_head_dim"],
        "kda_heads": la["num_heads"],
        "kda_dim": la["head_dim"],
        "layers": text["num_hidden_layers"],
        "mla": la["full_attn_layers"],
        "experts": text["num_experts"],
        "dense": text["first_k_dense_replace"],
    }


def mxfp4_packed(raw: np.ndarray) -> torch.Tensor:
    """ggml block_mxfp4 rows [R, nb*17] -> the release's compressed-tensors packs [R, nb*16].

    A ggml block is the E8M0 byte, then 16 bytes holding element j low and j+16 high; the release packs
    elements 2i low and 2i+1 high (docs/kimi-k3-gguf.md §1). Byte-exact both ways. Each pair of ggml
    bytes (one uint16) gives output bytes i (low nibbles) and i+8 (high nibbles): ~0.64 GiB/s on one
    core, 1.5x the nibble-by-nibble form; a real-size expert (16.7 MiB of blocks) takes ~26 ms."""
    raw = np.asarray(raw, dtype=np.uint8)
    rows, nb = raw.shape[0], raw.shape[1] // MXFP4_BLOCK
    blocks = raw.reshape(rows, nb, MXFP4_BLOCK)[..., 1:]
    q = np.ascontiguousarray(blocks).view("<u2")  # little-endian: qs[2i] is the low byte
    lo = (q & 0x000F) | ((q >> 4) & 0x00F0)  # qs[2i] low | qs[2i+1] low << 4: elements 2i, 2i+1
    hi = ((q >> 4) & 0x000F) | ((q >> 8) & 0x00F0)  # the high nibbles: elements 16+2i, 17+2i
    packed = np.concatenate((lo.astype(np.uint8), hi.astype(np.uint8)), axis=-1)
    return torch.from_numpy(packed.reshape(rows, nb * 16))


def _squeezed(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape if int(s) != 1)


class _Mapper:
    """Fills a GGUFSource's `tensors` and `_load` for K3 (entries `(tensor, expert, loader)`)."""

    def __init__(self, src: Any, by_name: dict[str, Any]) -> None:
        self.src, self.by_name, self.used = src, by_name, set()

    def need(self, name: str, what: str) -> Any:
        t = self.by_name.get(name)
        if t is None:
            raise UnsupportedModelError(
                f"{self.src.path}: GGUF tensor {name!r} ({what}) is missing; the file is not a complete "
                "Kimi K3 from llama.cpp's converter"
            )
        self.used.add(name)
        return t

    def exact_bf16(self, *ts: Any) -> bool:
        """Every value of `ts` is a bfloat16 (an F32 file of a bf16 release narrows back exactly)."""
        for t in ts:
            if t.tensor_type.name != "BF16":
                bits = self.src._widened(t).view(torch.int32)
                if bool((bits & 0xFFFF).any()):
                    return False
        return True

    def floats(self, hf: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if t.tensor_type.name not in _FLOAT_KINDS:
            raise UnsupportedModelError(
                f"{self.src.path}: {t.name} is {t.tensor_type.name}: K3's non-expert weights ship as "
                "bf16, and a block-quantized one is a lossy K3; convert with --outtype bf16 (or f32)"
            )
        if _squeezed(reversed(t.shape.tolist())) != _squeezed(shape):
            raise UnsupportedModelError(
                f"{self.src.path}: {t.name} has shape {tuple(reversed(t.shape.tolist()))}, expected "
                f"{shape} for {hf} from the file's own kimi-k3 metadata"
            )
        if dtype == torch.bfloat16 and not self.exact_bf16(t):
            dtype = torch.float32  # not a bf16 release: keep the file's values
        self.add(hf, t, None, TensorInfo(dtype, shape), self.widened)

    def widened(self, t: Any, expert: int | None, info: TensorInfo) -> torch.Tensor:
        return self.src._widened(t).reshape(info.shape).to(info.dtype)

    def add(self, hf: str, t: Any, e: int | None, info: TensorInfo, fn: Callable[..., Any]) -> None:
        self.src.tensors[hf] = info
        self.src._load[hf] = (t, e, fn)


def _ones(t: Any, expert: int | None, info: TensorInfo) -> torch.Tensor:
    """res_proj: the converter fused it into the score (res_norm), so 1 keeps the product exact."""
    return torch.ones(info.shape, dtype=info.dtype)


def _packed(t: Any, expert: int | None, info: TensorInfo) -> torch.Tensor:
    return mxfp4_packed(t.data[expert])


def _scale(t: Any, expert: int | None, info: TensorInfo) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(t.data[expert])[..., ::MXFP4_BLOCK]))


_RES = re.compile(r"(self_attention|mlp|output_attn)_res_(norm|proj)")


def map_k3(src: Any, by_name: dict[str, Any]) -> None:
    """Name, shape and type every tensor of a kimi-k3 GGUF as the HF import of the release would."""
    gguf, text, m = src._gguf, src.config["text_config"], _Mapper(src, by_name)
    M, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        if src.config.get(key) is not None:
            text[key] = src.config[key]
    if (pad := src._field("tokenizer.ggml.padding_token_id")) is not None:
        src.config["pad_token_id"] = text["pad_token_id"] = int(pad)
    la, n = text["linear_attn_config"], text["num_hidden_layers"]
    a = [m.need(names[M.SSM_A].format(bid=i - 1), "KDA's A") for i in la["kda_layers"]]
    _decay_rates(src, a, text)
    mla = {i - 1 for i in la["full_attn_layers"]}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_K3, n)
    scores = {"self_attention": M.ATTN_RES_SCORE, "mlp": M.FFN_RES_SCORE}
    scores["output_attn"] = M.OUTPUT_RES_SCORE

    def gguf_name(hf: str, mod: str, suffix: str, bid: int | None) -> str:
        if suffix == "dt_bias":  # the converter renames it dt_proj.bias first
            mod, suffix = mod + ".dt_proj", "bias"
        elif suffix == "e_score_correction_bias":
            mod, suffix = mod + ".e_score_correction", "bias"
        elif hf.endswith("self_attn.g_proj.weight"):  # one HF name, two GGUF roles by layer type
            return names[M.ATTN_GATE if bid in mla else M.SSM_G].format(bid=bid) + ".weight"
        g = tmap.get_name(mod)
        return hf if g is None else f"{g}.{suffix}"  # None: `need` names it missing

    for hf, spec in k3_roster(_sizes(text), int(text["vocab_size"])).items():
        mod, _, suffix = hf.rpartition(".")
        bid = int(b[1]) if (b := re.search(r"layers\.(\d+)\.", hf)) else None
        if ".experts." in hf:
            continue  # below: one GGUF tensor per layer and projection
        if (r := _RES.search(mod)) is not None:
            # fused n*p [H], F32: the model only ever uses that product (attnres.py): norm = it, proj = 1
            t = m.need(names[scores[r[1]]].format(bid=bid) + ".weight", "the fused AttnRes score")
            if r[2] == "norm":
                m.floats(hf, t, spec.shape, torch.float32)
            else:
                m.add(hf, t, None, TensorInfo(torch.float32, spec.shape), _ones)
        elif suffix == "A_log":
            t = a[la["kda_layers"].index(bid + 1)]
            m.floats(hf, t, (int(t.shape[0]),), torch.float32)
        elif hf.endswith("kv_b_proj.weight"):
            kb, vb = (
                m.need(gguf_name(hf, mod.replace("kv_b", x), "weight", bid), hf)
                for x in ("k_b", "v_b")
            )
            dtype = torch.bfloat16 if m.exact_bf16(kb, vb) else torch.float32
            src._add_kv_b(hf, {"k_b_proj": kb, "v_b_proj": vb}, dtype)
        else:
            m.floats(hf, m.need(gguf_name(hf, mod, suffix, bid), hf), spec.shape, spec.dtype)
    for bid in range(text["first_k_dense_replace"], n):
        for w, tid in (("w1", M.FFN_GATE_EXP), ("w2", M.FFN_DOWN_EXP), ("w3", M.FFN_UP_EXP)):
            t = m.need(names[tid].format(bid=bid) + ".weight", "routed experts")
            _add_experts(m, bid, w, t, text)
    unused = sorted(set(by_name) - m.used)
    if unused:
        raise UnsupportedModelError(
            f"{src.path}: GGUF tensor(s) {', '.join(unused[:5])} have no place in Kimi K3 as deltafind runs "
            "it: the file holds parts K3 does not have; import the model's HuggingFace folder instead"
        )


def _add_experts(m: _Mapper, bid: int, w: str, t: Any, text: dict[str, Any]) -> None:
    kind = t.tensor_type.name
    if kind != "MXFP4":
        raise UnsupportedModelError(
            f"{m.src.path}: {t.name} is {kind}: K3's routed experts ship as MXFP4 and deltafind runs them only "
            "in that exact form (this file was converted from re-encoded experts); import the HF folder"
        )
    cols, rows, count = (int(x) for x in t.shape[:3])
    if count != text["num_experts"]:
        raise UnsupportedModelError(
            f"{m.src.path}: {t.name} holds {count} experts, expert_count says {text['num_experts']}"
        )
    for e in range(count):
        p = f"model.layers.{bid}.block_sparse_moe.experts.{e}.{w}."
        m.add(p + "weight_packed", t, e, TensorInfo(torch.uint8, (rows, cols // 2)), _packed)
        m.add(p + "weight_scale", t, e, TensorInfo(torch.uint8, (rows, cols // 32)), _scale)


def _decay_rates(src: Any, a: list[Any], text: dict[str, Any]) -> None:
    """Set the model's switches for the file's ssm_a = -exp(A_log[:count]), or refuse (docs/kimi-k3-gguf.md §1)."""
    heads, k = int(text["num_attention_heads"]), int(text["linear_attn_config"]["head_dim"])
    counts = {int(t.shape[0]) for t in a}
    if len(counts) != 1 or counts - {heads, k}:
        raise UnsupportedModelError(
            f"{src.path}: the KDA layers' ssm_a hold {sorted(counts)} values; llama.cpp's converter writes "
            f"n_head ({heads}) in every layer (or kda.head_dim, {k}, per channel)"
        )
    if heads == k:
        raise UnsupportedModelError(
            f"{src.path}: ssm_a holds {k} values with n_head == kda.head_dim: whether they are per head or "
            "per channel cannot be told apart; import the model's HuggingFace folder"
        )
    text["kda_a_form"] = (
        "neg_exp"  # the stored A itself: the converter's f32 bits, no log/exp round trip
    )
    if counts == {k}:
        return  # every per-channel rate: K3 as released
    if not src.options.llamacpp_k3:
        raise UnsupportedModelError(
            f"{src.path}: llama.cpp's converter keeps {heads} of K3's {k} per-channel KDA decay rates a layer "
            "(ssm_a = -exp(A_log[:n_head]), read one per head; 96 of 128 on the released K3), so this file "
            "holds llama.cpp's reading of K3, not the release: import the HuggingFace folder for K3 as "
            "released, or pass `deltafind setup --accept-llamacpp-k3` to run llama.cpp's reading"
        )
    text["kda_a_log_per_channel"] = False
    src.config["gguf_reading"] = LLAMACPP_READING
