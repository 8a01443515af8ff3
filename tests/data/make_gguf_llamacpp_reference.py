"""Make tests/data/gguf_arch_llamacpp_reference.npz: llama.cpp's teacher-forced logits on the small
random GGUFs of tests/gguf_models.py, one per architecture deltafind imports from GGUF, and on their fp32
twins (every block tensor decoded by gguf-py, so llama.cpp does not quantize activations either).

The independent oracle of tests/oracle/test_gguf_archs.py. Each GGUF is written by gguf-py from a fixed
seed (llama.cpp's names, a Q4_K_M-like mix of block types), whole and split in two; llama.cpp (through
llama-cpp-python) evaluates TOKENS in one pass on both and must give the same logits on each, which are
stored with the whole file's sha256 (the test rebuilds the file and checks it is the same one).

llama-cpp-python is an oracle/bench-only dependency (never imported by deltafind/); building it costs
~6 min of CI per run, so CI reads these references instead:

    pip install --no-deps llama-cpp-python==0.3.36 diskcache     # builds llama.cpp from source

Run from the repo root:  python tests/data/make_gguf_llamacpp_reference.py
"""

from __future__ import annotations

import hashlib
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gguf_models import HEAD_KINDS, MAKERS, VOCAB, head_only, widened

OUT = Path(__file__).with_name("gguf_arch_llamacpp_reference.npz")
SEED = 7
N_TOKENS = 48
TOKENS = [int(t) for t in np.random.default_rng(SEED).integers(0, VOCAB - 1, N_TOKENS)]


N_HEAD_TOKENS = 8


def llamacpp_logits(path: Path, n: int = N_TOKENS) -> np.ndarray:
    from llama_cpp import Llama

    # An fp32 KV cache (GGML_TYPE_F32 = 0): llama.cpp's default f16 cache rounds MLA's latent and these random
    # models' large keys enough to move deepseek2's logits by ~5 % of their spread, an effect of the cache
    # and not of the weights this oracle checks.
    llm = Llama(
        model_path=str(path),
        n_ctx=128,
        n_batch=128,
        n_threads=2,
        logits_all=True,
        seed=0,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    llm.eval(TOKENS[:n])
    out = np.array(llm.scores[:n], dtype=np.float32)
    llm.close()
    return out


def main() -> None:
    import llama_cpp

    arrays: dict[str, np.ndarray] = {"tokens": np.array(TOKENS, dtype=np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, make in sorted(MAKERS.items()):
            whole = make(SEED).write(Path(tmp) / f"{arch}.gguf")[0]
            (Path(tmp) / "split").mkdir(exist_ok=True)
            shards = make(SEED).write(Path(tmp) / "split" / f"{arch}.gguf", shards=2)
            logits = llamacpp_logits(whole)
            split = llamacpp_logits(shards[0])
            assert np.array_equal(logits, split), (
                f"{arch}: llama.cpp gives other logits on the split file"
            )
            assert np.isfinite(logits).all(), arch
            arrays[f"{arch}_logits"] = logits
            (Path(tmp) / "f32").mkdir(exist_ok=True)
            twin = widened(make(SEED)).write(Path(tmp) / "f32" / f"{arch}.gguf")[0]
            arrays[f"{arch}_f32_logits"] = llamacpp_logits(twin)
            arrays[f"{arch}_f32_sha256"] = np.array(hashlib.sha256(twin.read_bytes()).hexdigest())
            arrays[f"{arch}_sha256"] = np.array(hashlib.sha256(whole.read_bytes()).hexdigest())
            top2 = np.sort(logits, axis=-1)[:, -2:]
            print(
                f"{arch}: logits std {logits.std():.3f}, median top-2 margin {np.median(top2[:, 1] - top2[:, 0]):.3f}"
            )
        for kind in HEAD_KINDS:  # each block type llama.cpp and deltafind must read alike
            path = head_only(kind, SEED).write(Path(tmp) / f"head_{kind}.gguf")[0]
            arrays[f"head_{kind}_logits"] = llamacpp_logits(path, N_HEAD_TOKENS)
            arrays[f"head_{kind}_sha256"] = np.array(hashlib.sha256(path.read_bytes()).hexdigest())
    arrays["made_with"] = np.array(
        f"llama-cpp-python {llama_cpp.__version__}, {platform.machine()}, numpy {np.__version__}"
    )
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
