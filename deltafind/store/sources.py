"""Checkpoint readers for setup: a HuggingFace folder or a GGUF file.

Both present the same face: an HF-style config dict, tensor metadata (name ->
dtype, shape) without loading anything, and `load(name)` for one tensor at a
time, so setup never holds more than the group it is writing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafind.errors import StoreError, UnsupportedModelError
from deltafind.store.quant import BLOCKS, quant_tag, row_bytes
from deltafind.store.spine import SAFETENSORS_DTYPES


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    quant: str = ""  # GGUF blocks kept as stored: "KIND/COLS", dtype uint8, shape [rows, row_bytes] (store/quant.py)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Source:
    """Base face of a checkpoint reader."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def write_tokenizer(self, dest: Path) -> list[str]:
        raise NotImplementedError

    def begin_import(self, spine: list[str]) -> None:
        """Setup is about to read: `spine` are the names it writes to the spine (the rest are experts)."""

    def end_import(self) -> None:
        """Setup finished: a source may free what it fetched (store/hub.py's --delete-source)."""


def _stat_fingerprint(paths: list[Path], extra: bytes = b"") -> str:
    h = hashlib.sha256(extra)
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# Multimodal wrappers (Kimi K3) keep the text model under a prefix next to vision tensors.
LANGUAGE_PREFIX = "language_model."


def import_names(config: dict[str, Any], names: Iterable[str]) -> dict[str, str]:
    """Checkpoint tensor name -> the name setup imports it under. When config.json has a
    `text_config` and the tensors carry `language_model.`, only those, without the prefix
    (the vision tower and projector are left out)."""
    names = list(names)
    if "text_config" in config and any(n.startswith(LANGUAGE_PREFIX) for n in names):
        return {n: n[len(LANGUAGE_PREFIX) :] for n in names if n.startswith(LANGUAGE_PREFIX)}
    return {n: n for n in names}


def tensor_info(where: str, name: str, dtype_code: str, shape: tuple[int, ...]) -> TensorInfo:
    """A safetensors header entry as setup imports it."""
    dtype = SAFETENSORS_DTYPES.get(dtype_code)
    if dtype is None:
        raise UnsupportedModelError(f"{where}: tensor {name} has dtype {dtype_code}, which setup cannot import yet")
    return TensorInfo(dtype, shape)


class HFSource(Source):
    """A HuggingFace model folder: config.json + *.safetensors (indexed or not) + tokenizer files,
    named as `import_names` says."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise StoreError(f"{self.path}: no config.json; --from must be a HuggingFace model folder or a .gguf file")
        self.config = json.loads(cfg.read_text())
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            self.files = [self.path / f for f in files]
        else:
            self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise StoreError(f"{self.path}: no *.safetensors files (pytorch .bin checkpoints are not supported; convert them with transformers' save_pretrained)")
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        self.tensors = {}
        raw: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for f in self.files:
            if not f.exists():
                raise StoreError(f"{f}: listed in model.safetensors.index.json but missing")
            h = self._handles[f] = safe_open(str(f), "pt")
            for name in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = h.get_slice(name)
                raw[name] = (f, sl.get_dtype(), tuple(sl.get_shape()))
        for orig, name in import_names(self.config, raw).items():
            f, dtype_code, shape = raw[orig]
            self.tensors[name] = tensor_info(str(f), orig, dtype_code, shape)
            self._where[name] = (f, orig)

    def load(self, name: str) -> torch.Tensor:
        f, orig = self._where[name]
        return self._handles[f].get_tensor(orig)

    def fingerprint(self) -> str:
        return _stat_fingerprint(self.files, (self.path / "config.json").read_bytes())

    def write_tokenizer(self, dest: Path) -> list[str]:
        from deltafind.tokenizer import copy_tokenizer_files

        return copy_tokenizer_files(self.path, dest)


# GGUF (llama.cpp) names -> HF names, for the architectures we import.
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _reverse_rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved -> half-split rope)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFSource(Source):
    """A GGUF file (llama architecture). Tensors in llama.cpp's common block formats (store/quant.py)
    stay as their blocks; F16/BF16 stay as stored; other formats are dequantized to float32."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the gguf package raises bare ValueErrors on bad files
            raise StoreError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._gguf = gguf
        arch = self._field("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(f"{self.path}: GGUF architecture {arch!r} is not supported yet (supported: llama)")
        f = lambda k, d=None: self._field(f"llama.{k}", d)  # noqa: E731
        self.n_head, self.n_head_kv = int(f("attention.head_count")), int(f("attention.head_count_kv", f("attention.head_count")))
        by_name = {t.name: t for t in self.reader.tensors}
        vocab = f("vocab_size") or len(self._field("tokenizer.ggml.tokens"))
        self.config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": int(vocab),
            "hidden_size": int(f("embedding_length")),
            "intermediate_size": int(f("feed_forward_length")),
            "num_hidden_layers": int(f("block_count")),
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_head_kv,
            "rms_norm_eps": float(f("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(f("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(f("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in by_name,
            "hidden_act": "silu",
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        self._by_hf: dict[str, Any] = {}
        self.tensors = {}
        for t in self.reader.tensors:
            hf = self._hf_name(t.name)
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            dtype = {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16}.get(t.tensor_type, torch.float32)
            self._by_hf[hf] = t
            kind = t.tensor_type.name
            if kind in BLOCKS and len(shape) == 2 and shape[1] % BLOCKS[kind][0] == 0:
                self.tensors[hf] = TensorInfo(torch.uint8, (shape[0], row_bytes(kind, shape[1])), quant_tag(kind, shape[1]))
            else:
                self.tensors[hf] = TensorInfo(dtype, shape)

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _hf_name(self, name: str) -> str:
        if name in _GGUF_GLOBAL:
            return _GGUF_GLOBAL[name]
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_BLOCK:
            return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}"
        raise UnsupportedModelError(f"{self.path}: GGUF tensor {name!r} has no known HF counterpart (e.g. rope_freqs for Llama 3.1 scaling is not supported yet)")

    def load(self, name: str) -> torch.Tensor:
        gguf = self._gguf
        t = self._by_hf[name]
        info = self.tensors[name]
        if info.quant:  # the blocks, byte for byte, one row of blocks per matrix row
            arr = np.array(t.data, dtype=np.uint8).reshape(info.shape)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            arr = np.array(t.data)
        elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
            arr = np.array(t.data).view(np.uint16)
            return torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16).reshape(info.shape)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = torch.from_numpy(np.ascontiguousarray(arr)).reshape(info.shape)
        if name.endswith("self_attn.q_proj.weight"):
            w = _reverse_rope_permute(w, self.n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _reverse_rope_permute(w, self.n_head_kv)
        return w.contiguous()

    def fingerprint(self) -> str:
        return _stat_fingerprint([self.path])

    def write_tokenizer(self, dest: Path) -> list[str]:
        from deltafind.tokenizer import write_tokenizer_from_gguf

        return write_tokenizer_from_gguf(self.path, dest)


def open_source(path: Path) -> Source:
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no such file or folder (--from takes a HuggingFace model folder or a .gguf file)")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise StoreError(f"{path}: not a GGUF file (bad magic {magic!r}); --from takes a HuggingFace model folder or a .gguf file")
        return GGUFSource(path)
    return HFSource(path)

