"""A GGUF checkpoint (llama.cpp), whole or split into shards, as a setup `Source` with transformers' names.

Finds and checks every shard (`split.*` keys), names tensors through gguf-py's own tables for the
architecture (importer/gguf_arch.py), cuts llama.cpp's merged 3-D expert tensors into per-expert ones and
rebuilds MLA's `kv_b_proj` from its split halves. Block formats with a kernel (store/quant.py) stay as
stored; others are refused, or dequantized to float32 when the caller asks (`GGUFOptions.widen`). An
architecture with its own tensor mapping (Kimi K3: importer/gguf_k3.py) plugs in through `Arch.tensors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltafind.errors import StoreError, UnsupportedModelError
from deltafind.importer.gguf_arch import Arch, arch_for
from deltafind.importer.sources import Source, TensorInfo, stat_fingerprint
from deltafind.log import get_logger
from deltafind.store.quant import BLOCKS, quant_tag, row_bytes

log = get_logger(__name__)
SHARD = re.compile(
    r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$"
)  # llama.cpp's llama_split_path
_REQUIRED = object()
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class GGUFOptions:
    """What a GGUF import may do beyond taking the file as it is (`deltafind setup` flags)."""

    widen: bool = False  # --widen-unsupported: block types without a kernel become float32
    llamacpp_k3: bool = False  # --accept-llamacpp-k3: run llama.cpp's reading of a Kimi K3 GGUF


def split_paths(path: Path) -> list[Path]:
    """Where every shard of the split GGUF `path` is one of lies (`NAME-00002-of-00003.gguf`), or [path]."""
    m = SHARD.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [
        path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]


def shard_paths(path: Path) -> list[Path]:
    """Every shard of the split GGUF `path` is one of, or [path] when it is whole; all must exist."""
    paths = split_paths(path)
    missing = [p.name for p in paths if not p.exists()]
    if missing and len(paths) > 1:
        raise StoreError(
            f"{path}: split GGUF shard(s) missing: {', '.join(missing)} (all {len(paths)} shards must lie in {path.parent})"
        )
    return paths


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata field's value, or `default` without one."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _reverse_rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved -> half-split rope)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFSource(Source):
    """A GGUF file or split GGUF, named as transformers names the family's checkpoints."""

    parallel_load = True  # numpy views of the mapped shards

    def __init__(self, path: Path, options: GGUFOptions | None = None) -> None:
        import gguf

        self.path = Path(path)
        self._gguf, self.options = gguf, options or GGUFOptions()
        self.files = self._find_shards()
        readers = [self._open(p) for p in self.files]
        self._check_split(readers)
        self.reader = readers[0]  # split.no 0 carries the metadata
        self.first = self.files[0]
        arch_name = self._field("general.architecture")
        self.arch: Arch = arch_for(str(arch_name), str(self.path))
        prefix = f"{arch_name}."

        def meta(key: str, default: Any = _REQUIRED) -> Any:
            value = self._field(prefix + key, default)
            if value is _REQUIRED:
                raise StoreError(
                    f"{self.first}: GGUF metadata {prefix + key} is missing; the file is not a complete {arch_name} GGUF"
                )
            return value

        by_name = {t.name: t for r in readers for t in r.tensors}
        self.config = {
            "model_type": self.arch.family,
            "architectures": [self.arch.architecture],
            **self.arch.config(
                meta, {n: t.data for n, t in by_name.items() if n == "rope_freqs.weight"}
            ),
        }
        self.config.update(
            {
                "vocab_size": int(
                    meta("vocab_size", None) or len(self._field("tokenizer.ggml.tokens", []))
                ),
                "tie_word_embeddings": "output.weight" not in by_name,
                "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            }
        )
        self._map_tensors(by_name)

    def _find_shards(self) -> list[Path]:
        return shard_paths(self.path)

    def _open(self, path: Path) -> Any:
        try:
            return self._gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package raises bare ValueErrors on bad files
            raise StoreError(f"{path}: not a readable GGUF file ({e})") from e

    def _check_split(self, readers: list[Any]) -> None:
        """Each shard says it is shard i of len(readers), and together they hold split.tensors.count tensors."""
        count = gguf_field(readers[0], "split.count")
        if len(readers) == 1 and (count or 1) == 1:
            return
        if len(readers) == 1:
            raise StoreError(
                f"{self.path}: is shard {gguf_field(readers[0], 'split.no')} of a {count}-file split GGUF but is not named "
                "NAME-0000i-of-0000N.gguf; keep gguf-split's file names so the other shards can be found"
            )
        total = gguf_field(readers[0], "split.tensors.count")
        for i, (p, r) in enumerate(zip(self.files, readers, strict=True)):
            no, n, t = (
                gguf_field(r, "split.no"),
                gguf_field(r, "split.count"),
                gguf_field(r, "split.tensors.count"),
            )
            if (no, n, t) != (i, len(readers), total):
                raise StoreError(
                    f"{p}: split.no={no} split.count={n} split.tensors.count={t}, expected {i}, {len(readers)}, {total} "
                    "(a shard of another split, or of another model); re-download that shard"
                )
        found = sum(len(r.tensors) for r in readers)
        if found != total:
            raise StoreError(
                f"{self.path}: the {len(readers)} shards hold {found} tensors, split.tensors.count says {total}; "
                "a shard is truncated or from another split; re-download the shards"
            )

    def _field(self, key: str, default: Any = None) -> Any:
        return gguf_field(self.reader, key, default)

    def _map_tensors(self, by_name: dict[str, Any]) -> None:
        """Name every tensor as transformers does, through gguf-py's TensorNameMap for this architecture."""
        self.tensors: dict[str, TensorInfo] = {}
        self._load: dict[str, tuple[Any, ...]] = {}
        self._wide: list[
            tuple[str, str, int, int]
        ] = []  # (GGUF name, kind, stored bytes, float32 bytes) without a kernel
        if self.arch.tensors is not None:
            self.arch.tensors(self, by_name)
            return
        gguf = self._gguf
        enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[
            str(self._field("general.architecture"))
        ]
        n_blocks = int(self._field(f"{gguf.MODEL_ARCH_NAMES[enum]}.block_count"))
        tmap = gguf.get_tensor_name_map(enum, n_blocks)
        to_hf = {}
        for template in self.arch.hf_names:
            for bid in range(n_blocks) if "{bid}" in template else [None]:
                hf = template.format(bid=bid)
                if (g := tmap.get_name(hf)) is not None:
                    to_hf[g] = hf
        layers = int(self.config["num_hidden_layers"])
        halves: dict[str, dict[str, Any]] = {}
        for name, t in by_name.items():
            base, dot, suffix = name.rpartition(".")
            hf = to_hf.get(base)
            if name == "rope_freqs.weight":
                continue  # read into config (importer/gguf_arch.py's llama3_rope)
            if hf is None:
                if (m := re.match(r"blk\.(\d+)\.", name)) and int(m[1]) >= layers:
                    continue  # multi-token-prediction layers after the last decoder layer: not run
                raise UnsupportedModelError(
                    f"{self.path}: GGUF tensor {name!r} has no place in deltafind's {self.arch.family} "
                    f"(architecture {self._field('general.architecture')}): the file holds a part deltafind "
                    "does not run; import the model's HuggingFace folder instead"
                )
            # transformers' DeepSeek names the router's bias `gate.e_score_correction_bias`
            hf = hf + ("_" if hf.endswith("e_score_correction") else dot) + suffix
            if hf.endswith(("k_b_proj.weight", "v_b_proj.weight")):
                halves.setdefault(hf.rsplit(".", 2)[0], {})[hf.rsplit(".", 2)[1]] = t
            elif ".mlp.experts." in hf:  # [n_expert, rows, cols]: one tensor per expert
                for e in range(int(t.shape[-1])):
                    self._add(hf.replace(".mlp.experts.", f".mlp.experts.{e}."), t, e)
            else:
                self._add(hf, t, None)
        for attn, parts in halves.items():
            self._add_kv_b(f"{attn}.kv_b_proj.weight", parts)
        self._check_wide()

    def _check_wide(self) -> None:
        if not self._wide:
            return
        kinds = sorted({k for _, k, _, _ in self._wide})
        stored, wide = sum(s for *_, s, _ in self._wide), sum(w for *_, w in self._wide)
        cost = f"{wide:,} bytes as float32 instead of {stored:,} as stored ({wide / max(stored, 1):.1f}x)"
        if self.options.widen:
            log.warning(
                "gguf_widened",
                kinds=kinds,
                tensors=len({n for n, *_ in self._wide}),
                stored_bytes=stored,
                widened_bytes=wide,
            )
            return
        name, kind = self._wide[0][:2]
        raise UnsupportedModelError(
            f"{self.path}: tensor {name} is {kind}, a block type deltafind has no kernel for (kept as stored: "
            f"{', '.join([*_FLOATS, *BLOCKS])}; without a kernel in this file: {', '.join(kinds)}); `deltafind setup --widen-unsupported` "
            f"imports such tensors as float32: {cost}"
        )

    def _add(self, hf: str, t: Any, expert: int | None) -> None:
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))[1 if expert is not None else 0 :]
        if kind in BLOCKS and len(shape) == 2 and shape[1] % BLOCKS[kind][0] == 0:
            info = TensorInfo(
                torch.uint8, (shape[0], row_bytes(kind, shape[1])), quant_tag(kind, shape[1])
            )
        elif kind in _FLOATS:
            info = TensorInfo(_FLOATS[kind], shape)
        else:  # no kernel: float32 if the caller asked (`widen`), refused after every tensor is seen
            info = TensorInfo(torch.float32, shape)
            self._wide.append(
                (
                    t.name,
                    kind,
                    int(t.n_bytes) // (int(t.shape[-1]) if expert is not None else 1),
                    info.nbytes,
                )
            )
        self.tensors[hf] = info
        self._load[hf] = (t, expert)

    def _add_kv_b(self, hf: str, parts: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        """llama.cpp stores MLA's kv_b_proj as k_b [heads, kv_lora, nope] (transposed) and v_b [heads, v, kv_lora].
        `dtype`: what the rebuilt tensor is kept as (the caller knows the values fit it exactly)."""
        if set(parts) != {"k_b_proj", "v_b_proj"}:
            raise StoreError(
                f"{self.path}: {hf} has only {sorted(parts)} of its GGUF halves attn_k_b/attn_v_b"
            )
        cfg = self.config.get("text_config", self.config)  # Kimi K3 nests the text model's config
        heads, lora = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"])
        nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        self.tensors[hf] = TensorInfo(dtype, (heads * (nope + v), lora))
        self._load[hf] = ("kv_b", parts["k_b_proj"], parts["v_b_proj"], heads, lora, nope, v)

    def _array(self, t: Any, expert: int | None) -> np.ndarray:
        """The tensor's values as float32 (or its blocks/floats as stored), one expert's slice if asked."""
        data = t.data if expert is None else t.data[expert]
        kind = t.tensor_type.name
        if kind in _FLOATS:
            return np.asarray(data).view(np.int16) if kind == "BF16" else np.asarray(data)
        return self._gguf.quants.dequantize(np.asarray(data), t.tensor_type).astype(np.float32)

    def _widened(self, t: Any) -> torch.Tensor:
        """A whole tensor's values as fp32, exactly: BF16 from its bits (`_array` gives them as int16)."""
        w = torch.from_numpy(np.array(self._array(t, None)))
        return (w.view(torch.bfloat16) if t.tensor_type.name == "BF16" else w).float()

    def load(self, name: str) -> torch.Tensor:
        entry, info = self._load[name], self.tensors[name]
        if entry[0] == "kv_b":
            _, kb, vb, heads, lora, nope, v = entry
            k = self._widened(kb).reshape(heads, lora, nope).transpose(1, 2)
            vv = self._widened(vb).reshape(heads, v, lora)
            return torch.cat([k, vv], dim=1).reshape(info.shape).to(info.dtype).contiguous()
        # (tensor, expert, loader): an architecture's own mapping (Arch.tensors)
        if len(entry) == 3:
            return entry[2](*entry[:2], info).contiguous()
        t, expert = entry
        if info.quant:  # the blocks, byte for byte, one row of blocks per matrix row
            arr = np.asarray(t.data if expert is None else t.data[expert], dtype=np.uint8)
        else:
            arr = self._array(t, expert)
        w = torch.from_numpy(np.array(arr)).reshape(
            info.shape
        )  # a copy: the file is mapped read-only
        if info.dtype == torch.bfloat16:
            w = w.view(torch.bfloat16)
        if self.arch.rope_permuted and name.endswith("self_attn.q_proj.weight"):
            w = _reverse_rope_permute(w, int(self.config["num_attention_heads"]))
        elif self.arch.rope_permuted and name.endswith("self_attn.k_proj.weight"):
            w = _reverse_rope_permute(w, int(self.config["num_key_value_heads"]))
        return w.contiguous()

    def fingerprint(self) -> str:
        return stat_fingerprint(self.files)

    def write_tokenizer(self, dest: Path) -> list[str]:
        from deltafind.tokenizer import write_tokenizer_from_gguf

        return write_tokenizer_from_gguf(self.first, dest, self.reader)
