"""Make tests/data/k3_gguf_llamacpp_reference.npz: llama.cpp's teacher-forced logits on a Kimi K3 GGUF
that llama.cpp's own converter wrote from deltafind's tiny synthetic K3 (tests/k3_gguf.py), the
independent oracle of tests/oracle/test_gguf_k3.py (docs/kimi-k3-gguf.md).

Two runs of llama.cpp (llama-cpp-python 0.3.36, `llama_model_kimi_k3`): on the converter's f32 file,
whose routed experts stay MXFP4, so llama.cpp quantizes their activations to Q8_0; and on its fp32 twin,
the same file with those experts dequantized to F32 by gguf-py, where llama.cpp computes in fp32 as
deltafind does. The file split in two by the converter must give the whole file's logits. The file's
sha256 is stored: the test converts again and checks it is the same file (the converter is
deterministic; a change to tests/k3_gguf.py's vocabulary or the synthetic K3 needs this script re-run).

llama-cpp-python is an oracle/bench-only dependency (never imported by deltafind/), ~6 min to build:

    pip install --no-deps llama-cpp-python==0.3.36 diskcache     # builds llama.cpp from source

Run from the repo root, after `make dev`:  python tests/data/make_k3_gguf_llamacpp_reference.py
"""

from __future__ import annotations

import hashlib
import platform
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2]))
# the other GGUF oracle's 48 tokens (ids < 320, inside K3's vocabulary) and its llama.cpp settings
from tests.data.make_gguf_llamacpp_reference import N_TOKENS, TOKENS, llamacpp_logits
from tests.k3_gguf import convert_k3, make_k3_hf

OUT = Path(__file__).with_name("k3_gguf_llamacpp_reference.npz")
SEED = 7  # the synthetic K3's weights


def widen(src: Path, dst: Path) -> Path:
    """`src` with every MXFP4 tensor dequantized to F32 by gguf-py; all else copied as stored."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            w.add_tensor(t.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> None:
    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_k3_hf(Path(tmp) / "hf", SEED)
        whole = convert_k3(hf, Path(tmp) / "k3.gguf", "f32")
        reader = gguf.GGUFReader(whole)
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        n_tensors = len(reader.tensors)
        (Path(tmp) / "split").mkdir()
        first = convert_k3(hf, Path(tmp) / "split" / "k3.gguf", "f32", -(-n_tensors // 2))
        assert first.name.endswith("-00001-of-00002.gguf"), first
        twin = widen(whole, Path(tmp) / "k3_f32.gguf")
        logits = llamacpp_logits(whole)
        assert np.array_equal(logits, llamacpp_logits(first)), "the split file gives other logits"
        f32 = llamacpp_logits(twin)
        assert np.isfinite(logits).all() and np.isfinite(f32).all()
        sha = hashlib.sha256(whole.read_bytes()).hexdigest()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    print(
        f"kimi-k3 {sha}: {n_tensors} tensors, vocab {vocab}; logits std {logits.std():.3f}, "
        f"median top-2 margin {np.median(top2[:, 1] - top2[:, 0]):.3f}, "
        f"MXFP4 file vs twin max |d| {np.abs(logits - f32).max():.4f}, "
        f"top-1 equal {(logits.argmax(-1) == f32.argmax(-1)).sum()}/{N_TOKENS}"
    )
    np.savez_compressed(
        OUT,
        tokens=np.array(TOKENS, dtype=np.int32),
        logits=logits,
        f32_logits=f32,
        sha256=np.array(sha),
        made_with=np.array(
            f"llama-cpp-python {llama_cpp.__version__}, gguf-py {gguf.__file__}, "
            f"{platform.machine()}, numpy {np.__version__}"
        ),
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
