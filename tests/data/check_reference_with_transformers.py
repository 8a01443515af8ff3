"""Cross-check smollm2_llamacpp_reference.json against a second, independent engine.

Dequantizes the demo GGUF with gguf.quants.dequantize into a float32 transformers
LlamaForCausalLM (undoing llama.cpp's rope permutation of the Q and K rows), runs the
reference's own token ids teacher-forced, and reports how often transformers' top-1
equals llama.cpp's top-1, overall and by llama.cpp's top1-top2 logit margin. The
answer tells an engine test which margin makes "the top choice is clear".

Needs only numpy, torch, gguf and transformers (no llama-cpp-python, no accelerate):
    python tests/data/check_reference_with_transformers.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from make_llamacpp_reference import OUT as REF_PATH  # noqa: E402
from make_llamacpp_reference import demo_gguf_path, sha256  # noqa: E402

THRESHOLDS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's permute() for rope-interleaved Q/K rows."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_transformers_model(path: Path):
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    r = gguf.GGUFReader(str(path))

    def f(key):
        return r.fields[key].contents()

    n_head, n_kv = int(f("llama.attention.head_count")), int(f("llama.attention.head_count_kv"))
    names = {t.name for t in r.tensors}
    cfg = LlamaConfig(
        vocab_size=int(f("llama.vocab_size")),
        hidden_size=int(f("llama.embedding_length")),
        intermediate_size=int(f("llama.feed_forward_length")),
        num_hidden_layers=int(f("llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=int(f("llama.rope.dimension_count")),
        rms_norm_eps=float(f("llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(f("llama.rope.freq_base"))},
        max_position_embeddings=int(f("llama.context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(f("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(f("tokenizer.ggml.eos_token_id")),
        attn_implementation="eager",
    )
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    state = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m:
            kind = m.group(2)
            if kind == "attn_q":
                w = unpermute(w, n_head)
            elif kind == "attn_k":
                w = unpermute(w, n_kv)
            state[f"model.layers.{m.group(1)}.{per_layer[kind]}.weight"] = torch.from_numpy(
                w.copy()
            )
        else:
            state[fixed[t.name]] = torch.from_numpy(w.copy())
    model = LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", type=Path, default=REF_PATH)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ref = json.loads(args.ref.read_text(encoding="utf-8"))
    path = demo_gguf_path()
    assert sha256(path) == ref["gguf_sha256"], (
        "GGUF differs from the one the reference was made with"
    )
    model = load_transformers_model(path)

    pos = ref["positions"]
    ids = torch.tensor([[p["token"] for p in pos]])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    hf_top1 = logits.argmax(-1).tolist()
    hf_top2 = logits.topk(2, -1)
    hf_margin = (hf_top2.values[:, 0] - hf_top2.values[:, 1]).tolist()
    lc_top1 = [p["top1"] for p in pos]
    lc_margin = np.array([p["margin"] for p in pos])
    agree = np.array([a == b for a, b in zip(hf_top1, lc_top1, strict=True)])
    # llama.cpp's top-1 logit vs transformers' logit for the same token (absolute scale).
    d_logit = np.array(
        [abs(float(logits[i, p["top1"]]) - p["top5_logits"][0]) for i, p in enumerate(pos)]
    )
    # The same pair's margin under transformers: how far an engine's margin can drift.
    d_margin = np.array(
        [
            abs(float(logits[i, p["top5"][0]] - logits[i, p["top5"][1]]) - p["margin"])
            for i, p in enumerate(pos)
        ]
    )
    in_top5 = np.mean([h in p["top5"] for h, p in zip(hf_top1, pos, strict=True)])

    by_margin = {}
    for th in THRESHOLDS:
        sel = lc_margin > th
        by_margin[f"lc_margin>{th}"] = {
            "n": int(sel.sum()),
            "agree": int(agree[sel].sum()),
            "rate": round(float(agree[sel].mean()), 4) if sel.any() else None,
        }
    disagreements = [
        {
            "pos": int(i),
            "lc_top1": lc_top1[i],
            "hf_top1": hf_top1[i],
            "lc_margin": pos[i]["margin"],
            "hf_margin": round(hf_margin[i], 4),
        }
        for i in np.flatnonzero(~agree)
    ]

    # Greedy continuation of the prompt with transformers (full recompute, no cache: exact).
    seq = list(ref["prompt_ids"])
    for _ in range(len(ref["continuation_ids"])):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    hf_cont = seq[len(ref["prompt_ids"]) :]

    print(
        json.dumps(
            {
                "positions": len(pos),
                "top1_agree": int(agree.sum()),
                "top1_agree_rate": round(float(agree.mean()), 4),
                "hf_top1_in_lc_top5_rate": round(float(in_top5), 4),
                "by_lc_margin": by_margin,
                "max_lc_margin_among_disagreements": max(
                    (d["lc_margin"] for d in disagreements), default=None
                ),
                "top1_logit_abs_diff": {
                    "median": round(float(np.median(d_logit)), 4),
                    "max": round(float(d_logit.max()), 4),
                },
                "pair_margin_abs_diff": {
                    "median": round(float(np.median(d_margin)), 4),
                    "p95": round(float(np.quantile(d_margin, 0.95)), 4),
                    "max": round(float(d_margin.max()), 4),
                },
                "disagreements": disagreements,
                "continuation_equal": hf_cont == ref["continuation_ids"],
                "hf_continuation_ids": hf_cont,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
