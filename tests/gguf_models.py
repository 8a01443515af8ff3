"""Small random GGUFs in llama.cpp's own layout, written with gguf-py, for the GGUF import tests.

Each architecture deltafind imports (`llama`, `qwen3`, `qwen3moe`, `deepseek2`) with llama.cpp's tensor
names and metadata keys, a Q4_K_M-like mix of block types (Q4_K, Q6_K, Q8_0, Q5_K, F16, F32 norms),
whole or split into shards as gguf-split names them. Block bytes are random with sane scales, so
deltafind and llama.cpp decode the very same weights.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# (offset, count) of each block's f16 scale fields, which must be finite and small
_F16_FIELDS = {
    "Q4_K": [(0, 2)],
    "Q5_K": [(0, 2)],
    "Q6_K": [(208, 1)],
    "Q8_0": [(0, 1)],
    "Q2_K": [(80, 2)],
    "Q3_K": [(108, 1)],
    "IQ4_NL": [(0, 1)],
    "IQ4_XS": [(0, 1)],
    "Q4_0": [(0, 1)],
    "Q5_0": [(0, 1)],
    "IQ2_XXS": [(0, 1)],
    "IQ3_XXS": [(0, 1)],
    "TQ2_0": [(64, 1)],
    "IQ1_S": [(0, 1)],
    "IQ2_XS": [(0, 1)],
    "IQ2_S": [(0, 1)],
    "IQ3_S": [(0, 1)],
}
H, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB = 256, 4, 2, 64, 512, 320
EXPERTS, TOP_K, EXPERT_FF, LAYERS = 8, 2, 256, 3


def random_blocks(
    rng: np.random.Generator, kind: str, shape: tuple[int, ...], scale: float
) -> np.ndarray:
    """Random `kind` blocks for a [..., rows, cols] matrix: uint8 [..., rows, row_bytes]."""
    per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    *lead, cols = shape
    n_blocks = int(np.prod(lead)) * (cols // per)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off, count in _F16_FIELDS.get(kind, []):
        d = (rng.uniform(0.5, 1.0, size=(n_blocks, count)) * scale).astype(np.float16)
        raw[:, off : off + 2 * count] = d.view(np.uint8).reshape(n_blocks, 2 * count)
    if kind == "IQ1_M":  # d lies in the top nibbles of the last four u16 (bytes 49, 51, 53, 55)
        d = (rng.uniform(0.5, 1.0, size=n_blocks) * scale).astype(np.float16).view(np.uint16)
        for i in range(4):
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (
                ((d >> (4 * i)) & 0xF).astype(np.uint8) << 4
            )
    if kind == "Q6_K":  # int8 sub-block scales: keep them small and positive-ish
        raw[:, 192:208] = rng.integers(-8, 24, size=(n_blocks, 16)).astype(np.int8).view(np.uint8)
    return raw.reshape(*lead, cols // per * size)


class Builder:
    """Tensors and metadata of one random GGUF, then `write` (whole or in shards)."""

    def __init__(self, arch: str, seed: int, vocab: int = VOCAB) -> None:
        self.arch, self.rng, self.vocab = arch, np.random.default_rng(seed), vocab
        self.tensors: list[tuple[str, np.ndarray, Q | None]] = []
        self.kv: list[tuple[str, object]] = []

    def meta(self, key: str, value: object) -> None:
        self.kv.append((f"{self.arch}.{key}", value))

    def weight(
        self, name: str, shape: tuple[int, ...], kind: str = "F32", scale: float | None = None
    ) -> None:
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        if kind in ("F32", "F16"):
            arr = (self.rng.standard_normal(shape) * scale).astype(
                np.float32 if kind == "F32" else np.float16
            )
            self.tensors.append((name, arr, None))
        else:  # block scale d such that the decoded weights have roughly `scale` spread
            self.tensors.append((name, random_blocks(self.rng, kind, shape, scale / 8), Q[kind]))

    def norm(self, name: str, n: int) -> None:
        self.tensors.append(
            (name, (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32), None)
        )

    def write(self, path: Path, shards: int = 1) -> list[Path]:
        per = -(-len(self.tensors) // shards) if shards > 1 else 0
        w = gguf.GGUFWriter(str(path), self.arch, split_max_tensors=per)
        for key, value in self.kv:
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            else:
                w.add_float32(key, float(value))
        _add_vocab(w, self.vocab)
        for name, arr, raw in self.tensors:
            w.add_tensor(name, arr, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf")) if shards > 1 else [path]


def _add_vocab(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of `vocab` tokens: the 256 bytes, some merges, control tokens that pad
    it to a real model's size (bench_moe_vs_llamacpp.py), an end-of-text token."""
    from deltafind.tokenizer.bpe import spell_bytes

    tokens = [spell_bytes(bytes([b])) for b in range(256)]
    letters = [spell_bytes(c.encode()) for c in " etaoinshr"]
    merges = [f"{a} {b}" for a in letters for b in letters if a != b][: VOCAB - 257]
    tokens += [m.replace(" ", "") for m in merges]
    pads = [f"<|pad{i}|>" for i in range(vocab - 1 - len(tokens))]
    tokens += [*pads, "<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [1] * (vocab - 1 - len(pads)) + [3] * (len(pads) + 1)
    )  # pads and the last one are control tokens
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 1)
    w.add_add_bos_token(False)


def _attention_meta(b: Builder, heads: int, kv_heads: int, theta: float = 10000.0) -> None:
    b.meta("context_length", 512)
    b.meta("embedding_length", H)
    b.meta("block_count", LAYERS)
    b.meta("attention.head_count", heads)
    b.meta("attention.head_count_kv", kv_heads)
    b.meta("attention.layer_norm_rms_epsilon", 1e-6)
    b.meta("rope.freq_base", theta)
    b.meta("vocab_size", VOCAB)


def _globals(b: Builder) -> None:
    b.weight("token_embd.weight", (VOCAB, H), "Q4_K", scale=1.0)
    b.norm("output_norm.weight", H)
    b.weight("output.weight", (VOCAB, H), "Q6_K")


def _gqa(b: Builder, i: int, qk_norm: bool, o_kind: str = "Q5_K") -> None:
    b.norm(f"blk.{i}.attn_norm.weight", H)
    b.norm(f"blk.{i}.ffn_norm.weight", H)
    b.weight(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, H), "Q4_K")
    b.weight(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, H), "Q4_K")
    b.weight(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, H), "Q6_K")
    b.weight(f"blk.{i}.attn_output.weight", (H, HEADS * HEAD_DIM), o_kind)
    if qk_norm:
        b.norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        b.norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)


def _dense_mlp(b: Builder, i: int, up_kind: str = "Q8_0", down_kind: str = "Q6_K") -> None:
    ff = FF
    b.weight(f"blk.{i}.ffn_gate.weight", (ff, H), "Q4_K")
    b.weight(f"blk.{i}.ffn_up.weight", (ff, H), up_kind)
    b.weight(f"blk.{i}.ffn_down.weight", (H, ff), down_kind)


def _experts(
    b: Builder, i: int, gate_kind: str = "Q4_K", up_kind: str = "Q4_K", down_kind: str = "Q6_K"
) -> None:
    b.weight(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, H), "F32")
    b.weight(f"blk.{i}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, H), gate_kind)
    b.weight(f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_FF, H), up_kind)
    b.weight(f"blk.{i}.ffn_down_exps.weight", (EXPERTS, H, EXPERT_FF), down_kind)


def make_llama(seed: int = 0, rope_freqs: bool = True) -> Builder:
    b = Builder("llama", seed)
    _attention_meta(b, HEADS, KV_HEADS)
    b.meta("feed_forward_length", FF)
    b.meta("rope.dimension_count", HEAD_DIM)
    _globals(b)
    if rope_freqs:  # Llama 3.1's scaling as its converter writes it (factor 8, low 1, high 4, 8192)
        inv = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        wavelen = 2 * np.pi / inv
        smooth = (64 / wavelen - 1) / (
            4 - 1
        )  # original context 64 so this small rope has a smooth band
        f = np.where(
            wavelen < 64 / 4, 1.0, np.where(wavelen > 64 / 1, 8.0, 1 / ((1 - smooth) / 8 + smooth))
        )
        b.meta("rope.scaling.original_context_length", 64)
        b.tensors.append(("rope_freqs.weight", f.astype(np.float32), None))
    for i in range(LAYERS):
        _gqa(b, i, qk_norm=False)
        _dense_mlp(b, i, up_kind="Q2_K" if i == 1 else "Q8_0")
    return b


def make_qwen2(seed: int = 0) -> Builder:
    """Qwen2/2.5 as llama.cpp's converter writes it: llama's tensors, q/k/v biases, no rope permutation."""
    b = Builder("qwen2", seed)
    _attention_meta(b, HEADS, KV_HEADS, theta=1000000.0)
    b.meta("feed_forward_length", FF)
    _globals(b)
    for i in range(LAYERS):
        _gqa(b, i, qk_norm=False)
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            b.tensors.append(
                (
                    f"blk.{i}.attn_{name}.bias",
                    (0.5 * b.rng.standard_normal(rows * HEAD_DIM)).astype(np.float32),
                    None,
                )
            )
        _dense_mlp(b, i, down_kind="IQ4_XS" if i == 1 else "Q6_K")
    return b


def make_qwen3(seed: int = 0) -> Builder:
    b = Builder("qwen3", seed)
    _attention_meta(b, HEADS, KV_HEADS, theta=1000000.0)
    b.meta("feed_forward_length", FF)
    b.meta("attention.key_length", HEAD_DIM)
    b.meta("attention.value_length", HEAD_DIM)
    _globals(b)
    for i in range(LAYERS):
        _gqa(b, i, qk_norm=True, o_kind="Q3_K" if i == 1 else "Q5_K")
        _dense_mlp(b, i, down_kind="IQ3_XXS" if i == 2 else "Q6_K")
    return b


def make_qwen3moe(seed: int = 0) -> Builder:
    b = Builder("qwen3moe", seed)
    _attention_meta(b, HEADS, KV_HEADS)
    b.meta("attention.key_length", HEAD_DIM)
    b.meta("attention.value_length", HEAD_DIM)
    b.meta("expert_count", EXPERTS)
    b.meta("expert_used_count", TOP_K)
    b.meta("expert_feed_forward_length", EXPERT_FF)
    _globals(b)
    for i in range(LAYERS):
        _gqa(b, i, qk_norm=True)
        _experts(
            b, i, up_kind="IQ4_XS" if i == 1 else "Q4_K", down_kind="IQ2_XXS" if i == 2 else "Q6_K"
        )
    return b


Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 256, 256, 32, 32, 64


def make_deepseek2(seed: int = 0) -> Builder:
    b = Builder("deepseek2", seed)
    _attention_meta(b, HEADS, 1)  # the converter writes MLA as MQA
    b.meta("feed_forward_length", FF)
    b.meta("leading_dense_block_count", 1)
    b.meta("attention.q_lora_rank", Q_LORA)
    b.meta("attention.kv_lora_rank", KV_LORA)
    b.meta("attention.key_length", KV_LORA + ROPE)
    b.meta("attention.value_length", KV_LORA)
    b.meta("attention.key_length_mla", NOPE + ROPE)
    b.meta("attention.value_length_mla", V_DIM)
    b.meta("rope.dimension_count", ROPE)
    b.meta("expert_count", EXPERTS)
    b.meta("expert_used_count", TOP_K)
    b.meta("expert_shared_count", 1)
    b.meta("expert_feed_forward_length", EXPERT_FF)
    b.meta("expert_weights_scale", 2.5)
    b.meta("expert_weights_norm", True)
    b.meta("expert_gating_func", 2)
    _globals(b)
    for i in range(LAYERS):
        b.norm(f"blk.{i}.attn_norm.weight", H)
        b.norm(f"blk.{i}.ffn_norm.weight", H)
        b.weight(f"blk.{i}.attn_q_a.weight", (Q_LORA, H), "Q4_K")
        b.norm(f"blk.{i}.attn_q_a_norm.weight", Q_LORA)
        b.weight(f"blk.{i}.attn_q_b.weight", (HEADS * (NOPE + ROPE), Q_LORA), "Q4_K")
        b.weight(f"blk.{i}.attn_kv_a_mqa.weight", (KV_LORA + ROPE, H), "Q6_K")
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", KV_LORA)
        b.weight(
            f"blk.{i}.attn_k_b.weight", (HEADS, KV_LORA, NOPE), "Q8_0", scale=1 / np.sqrt(KV_LORA)
        )
        b.weight(f"blk.{i}.attn_v_b.weight", (HEADS, V_DIM, KV_LORA), "Q8_0")
        b.weight(f"blk.{i}.attn_output.weight", (H, HEADS * V_DIM), "Q5_K")
        if i == 0:
            _dense_mlp(b, i)
            continue
        _experts(b, i, gate_kind="Q3_K" if i == 2 else "Q4_K")
        b.tensors.append(
            (
                f"blk.{i}.exp_probs_b.bias",
                (0.1 * b.rng.standard_normal(EXPERTS)).astype(np.float32),
                None,
            )
        )
        b.weight(f"blk.{i}.ffn_gate_shexp.weight", (EXPERT_FF, H), "Q4_K")
        b.weight(f"blk.{i}.ffn_up_shexp.weight", (EXPERT_FF, H), "IQ4_NL")
        b.weight(f"blk.{i}.ffn_down_shexp.weight", (H, EXPERT_FF), "Q6_K")
    return b


MAKERS = {
    "llama": make_llama,
    "qwen2": make_qwen2,
    "qwen3": make_qwen3,
    "qwen3moe": make_qwen3moe,
    "deepseek2": make_deepseek2,
}


def widened(b: Builder) -> Builder:
    """The same model with every block tensor decoded to F32 (gguf-py's dequantize): llama.cpp then
    computes in fp32 without quantizing activations, so only float rounding separates it from deltafind."""
    out = Builder(b.arch, 0)
    out.kv = list(b.kv)
    for name, arr, raw in b.tensors:
        out.tensors.append(
            (
                name,
                arr.astype(np.float32)
                if raw is None
                else gguf.quants.dequantize(arr, raw).astype(np.float32),
                None,
            )
        )
    return out


HEAD_KINDS = (
    "Q2_K",
    "Q3_K",
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_NL",
    "IQ4_XS",
)


def head_only(kind: str, seed: int = 0) -> Builder:
    """A float llama whose output head alone is `kind` blocks: llama.cpp's logits then differ from deltafind's
    only by that one matmul's activation rounding, so the two engines' readings of the blocks are compared."""
    b = widened(make_llama(seed, rope_freqs=False))
    b.tensors = [t for t in b.tensors if t[0] != "output.weight"]
    b.weight("output.weight", (VOCAB, H), kind)
    return b
