"""`setup --from ORG/NAME:QUANT` from a GGUF repository on a loopback hub (tests/hub_server.py).

The repository holds a tiny llama GGUF written by gguf-py (Q8_0 weights) beside other quants,
one of them split in two by gguf-py's own splitter inside a folder named after the quant, as
the large uploads are. A store made from the hub is compared with the import of the same
file from disk; the quant is picked as llama.cpp's `-hf` picks it (common/download.cpp). A qwen3moe
GGUF split in two installs `--streaming`: its experts come by range from inside the shards and
decode as the whole import does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from deltafind import Model
from deltafind.errors import StoreError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.gguf_source import GGUFOptions
from deltafind.importer.hub_gguf import pick_quant
from deltafind.importer.setup import setup_store
from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd
from tests.gguf_models import make_qwen3moe
from tests.hub_server import COMMIT, TOKEN, FakeHub

REPO = "org/tiny-GGUF"
MOE = "org/moe-GGUF"
MOE_SHARDS = [f"moe-Q4_K_M-{i:05d}-of-00002.gguf" for i in (1, 2)]
WIDE = "org/wide-GGUF"  # a spine tensor in TQ2_0, a block type deltafind has no kernel for
PROMPT_IDS = [
    104,
    101,
    108,
    108,
    111,
    32,
]  # greedy decodes 6 different tokens from it, not one repeated
GENERATE = "import sys; from deltafind import Model; m = Model.open(sys.argv[1]); print(m.generate({ids}, max_new_tokens=8))"
SPLIT = ["Q2_K/tiny-Q2_K-00001-of-00002.gguf", "Q2_K/tiny-Q2_K-00002-of-00002.gguf"]
OPEN = (
    "import sys; from pathlib import Path; from deltafind.importer.hub import locate_checkpoint; "
    "[print(locate_checkpoint(spec, Path(sys.argv[1]), progress=False)) for spec in sys.argv[2:]]"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: a closed vocabulary with no merges."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_llama_gguf(path: Path, seed: int = 0, split_max_tensors: int = 0) -> None:
    """A 2-layer llama GGUF in llama.cpp's names: Q8_0 matrices, F32 norms, F16 embeddings."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv, layers = 64, 128, 4, 2, 2
    vocab = ["<s>", "</s>", *_bytes_to_unicode()]
    w = gguf.GGUFWriter(str(path), arch="llama", split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3, 3] + [1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def q8(rows: int, cols: int) -> np.ndarray:
        return gguf.quants.quantize(
            (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32),
            gguf.GGMLQuantizationType.Q8_0,
        )

    w.add_tensor(
        "token_embd.weight", (rng.standard_normal((len(vocab), hidden)) * 0.2).astype(np.float16)
    )
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    hd = hidden // heads
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv * hd, hidden),
        "attn_v": (kv * hd, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, (rows, cols) in shapes.items():
            w.add_tensor(
                f"blk.{i}.{name}.weight", q8(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-repo")
    write_llama_gguf(folder / "tiny-Q8_0.gguf")
    (folder / "tiny-Q4_K_M.gguf").write_bytes(
        b"GGUF" + bytes(range(256)) * 64
    )  # the default quant: must not be fetched for :Q8_0
    (folder / "mmproj-tiny-F16.gguf").write_bytes(
        b"GGUF" + b"\0" * 1024
    )  # a projector, never a model
    (folder / "Q2_K").mkdir()
    write_llama_gguf(
        folder / "Q2_K" / "tiny-Q2_K.gguf", seed=1, split_max_tensors=10
    )  # gguf-py writes -0000N-of-00002
    assert sorted(p.relative_to(folder).as_posix() for p in (folder / "Q2_K").iterdir()) == SPLIT
    (folder / "README.md").write_text("a model card\n")
    return folder


@pytest.fixture(scope="module")
def moe_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3moe GGUF (Q4_K/IQ4_XS/IQ2_XXS/Q6_K experts) split in two, as gguf-split names the shards."""
    folder = tmp_path_factory.mktemp("moe-repo")
    assert [
        p.name for p in make_qwen3moe(seed=3).write(folder / "moe-Q4_K_M.gguf", shards=2)
    ] == MOE_SHARDS
    return folder


@pytest.fixture(scope="module")
def wide_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3moe GGUF whose layer-0 attention output is TQ2_0: imported only when widening is asked."""
    folder = tmp_path_factory.mktemp("wide-repo")
    b = make_qwen3moe(seed=4)
    b.tensors = [t for t in b.tensors if t[0] != "blk.0.attn_output.weight"]
    b.weight("blk.0.attn_output.weight", (256, 256), "TQ2_0")
    b.write(folder / "wide-Q4_K_M.gguf")
    return folder


@pytest.fixture(scope="module")
def hub(repo: Path, moe_repo: Path, wide_repo: Path) -> FakeHub:
    with FakeHub({REPO: repo, MOE: moe_repo, WIDE: wide_repo}) as h:
        yield h


@pytest.fixture()
def env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    hub.faults.__init__()
    hub.log.clear()
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path / "hf-home"),
    }


def _fetched(hub: FakeHub) -> set[str]:
    return {
        r.path.split(f"/resolve/{COMMIT}/", 1)[-1]
        for r in hub.log
        if r.method == "GET" and "/resolve/" in r.path
    }


def test_a_quant_is_downloaded_verified_and_imports_as_the_local_file(
    hub: FakeHub, env: dict[str, str], repo: Path, tmp_path: Path
) -> None:
    ref = setup_store(repo / "tiny-Q8_0.gguf", tmp_path / "ref", progress=False)
    hub.faults.corrupt_at["tiny-Q8_0.gguf"] = (
        5000  # one flipped byte: caught by the hub's sha256, fetched again
    )
    proc = deltafind_cmd(
        "setup", "--from", f"{REPO}:q8_0", "--store", str(tmp_path / "s"), env=env
    )  # any case, as llama.cpp
    assert proc.returncode == 0, proc.stderr
    assert "sha256" in proc.stderr and "downloading it again" in proc.stderr
    got = Manifest.load(tmp_path / "s")
    assert got.spine_sha256 == ref.spine_sha256
    assert [(r.key, r.sha256) for r in got.experts] == [(r.key, r.sha256) for r in ref.experts]
    assert _fetched(hub) == {
        "tiny-Q8_0.gguf"
    }  # not the other quants, the projector or the model card
    # Offline, the same spec comes from the HF cache without a request.
    hub.log.clear()
    proc = deltafind_cmd(
        "setup",
        "--from",
        f"{REPO}:Q8_0",
        "--store",
        str(tmp_path / "offline"),
        "--quiet",
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert Manifest.load(tmp_path / "offline").spine_sha256 == ref.spine_sha256 and hub.log == []


def test_every_shard_of_a_split_quant_is_downloaded_and_the_first_goes_to_the_import(
    hub: FakeHub, env: dict[str, str], repo: Path, tmp_path: Path
) -> None:
    hub.faults.drop_after[SPLIT[1]] = (
        4000  # the second shard's connection drops: resumed from there
    )
    proc = subprocess.run(
        [sys.executable, "-c", OPEN, str(tmp_path / "s"), f"{REPO}:q2_k@main", REPO],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    first, default = (Path(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert default.name == "tiny-Q4_K_M.gguf"  # no tag, no *.safetensors: llama.cpp's default quant
    assert first.name == Path(SPLIT[0]).name and first.parent.name == "Q2_K"
    for (
        name
    ) in SPLIT:  # both shards side by side in the snapshot, byte for byte what the hub serves
        assert (first.parent / Path(name).name).read_bytes() == (repo / name).read_bytes()
    assert _fetched(hub) == {*SPLIT, "tiny-Q4_K_M.gguf"}
    resumed = [r.range for r in hub.requests(SPLIT[1]) if r.range and r.range.endswith("-")]
    assert resumed == ["bytes=0-", "bytes=4000-"]


def test_a_missing_quant_or_delete_source_is_refused_before_any_download(
    env: dict[str, str], hub: FakeHub, tmp_path: Path
) -> None:
    proc = deltafind_cmd(
        "setup", "--from", f"{REPO}:IQ1_S", "--store", str(tmp_path / "s"), env=env
    )
    assert proc.returncode != 0
    assert "'IQ1_S' is not in the repository; it has: Q2_K, Q4_K_M, Q8_0" in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "s").exists() and not [r for r in hub.log if "/resolve/" in r.path]
    proc = deltafind_cmd(
        "setup",
        "--from",
        f"{REPO}:Q8_0",
        "--store",
        str(tmp_path / "s"),
        "--delete-source",
        env=env,
    )
    assert (
        proc.returncode != 0
        and "--delete-source is not supported for GGUF repositories yet" in proc.stderr
    )


def _generate(store: Path, env: dict[str, str]) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE.format(ids=PROMPT_IDS), str(store)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_streaming_install_fetches_each_expert_from_inside_its_shard(
    hub: FakeHub, env: dict[str, str], moe_repo: Path, tmp_path: Path
) -> None:
    ref = setup_store(moe_repo / MOE_SHARDS[0], tmp_path / "ref", progress=False)
    want = Model.open(tmp_path / "ref").generate(PROMPT_IDS, max_new_tokens=8)
    proc = deltafind_cmd(
        "setup",
        "--from",
        f"{MOE}:Q4_K_M",
        "--store",
        str(tmp_path / "s"),
        "--streaming",
        "--quiet",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    store = tmp_path / "s"
    assert (
        Manifest.load(store).spine_sha256 == ref.spine_sha256
    )  # q/k rows reordered as the whole import does
    assert not (store / ".hub-gguf-headers").exists()
    sizes = {n: (moe_repo / n).stat().st_size for n in MOE_SHARDS}
    fetched = sum(r.sent for n in MOE_SHARDS for r in hub.requests(n) if r.range)
    assert fetched < sum(sizes.values()) / 2  # headers and spine only: the experts stay on the hub
    hub.log.clear()
    assert _generate(store, env) == want
    expert_gets = [r for n in MOE_SHARDS for r in hub.requests(n) if r.range]
    assert expert_gets and all(
        r.sent < sizes[n] for n in MOE_SHARDS for r in hub.requests(n) if r.range
    )  # ranges, never a whole shard
    fetched_now = {
        (d["layer"], d["expert"]): d["sha256"]
        for d in map(json.loads, (store / "present.jsonl").read_text().splitlines())
    }
    assert (
        fetched_now and fetched_now.items() <= {r.key: r.sha256 for r in ref.experts}.items()
    )  # byte for byte the whole import's records
    meta = json.loads((store / "remote.json").read_text())
    present = set(fetched_now)
    needed = sum(
        b - a for layer, e, parts in meta["experts"] if (layer, e) in present for _, a, b in parts
    )
    # at most twice the experts' bytes: not every expert between one's gate, up and down slices
    assert sum(r.sent for r in expert_gets) <= 2 * needed
    file, start, _ = next(
        p for layer, e, parts in meta["experts"] if (layer, e) not in present for p in parts
    )
    hub.faults.corrupt_at[file] = (
        start + 10
    )  # a flipped byte in an expert --fill fetches: caught by the shard's sha256
    proc = deltafind_cmd("setup", "--fill", "--store", str(store), "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    got = Manifest.load(store)
    assert (
        file not in hub.faults.corrupt_at
    )  # the flipped byte was served, and that expert refetched
    assert not got.source.get("remote") and [(r.key, r.sha256) for r in got.experts] == [
        (r.key, r.sha256) for r in ref.experts
    ]


def test_a_streaming_install_widens_what_has_no_kernel_only_when_asked(
    env: dict[str, str], wide_repo: Path, tmp_path: Path
) -> None:
    ref = setup_store(
        open_source(wide_repo / "wide-Q4_K_M.gguf", GGUFOptions(widen=True)),
        tmp_path / "ref",
        progress=False,
    )
    args = ("setup", "--from", f"{WIDE}:Q4_K_M", "--streaming", "--quiet")
    proc = deltafind_cmd(*args, "--store", str(tmp_path / "refused"), env=env)
    assert proc.returncode != 0
    assert (
        "blk.0.attn_output.weight is TQ2_0" in proc.stderr and "--widen-unsupported" in proc.stderr
    )
    proc = deltafind_cmd(*args, "--store", str(tmp_path / "s"), "--widen-unsupported", env=env)
    assert proc.returncode == 0, proc.stderr
    got = Manifest.load(tmp_path / "s")
    assert got.spine_sha256 == ref.spine_sha256  # widened to float32 as the whole import widens it
    with safe_open(str(tmp_path / "s" / "spine.safetensors"), "pt") as f:
        o_proj = f.get_slice("model.layers.0.self_attn.o_proj.weight")
        assert (o_proj.get_dtype(), o_proj.get_shape()) == ("F32", [256, 256])


# llama.cpp's choice of files (common/download.cpp find_best_model / get_split_files), on file lists
UNSLOTH = [
    "README.md",
    "Qwen3-30B-A3B-Q4_K_M.gguf",
    "Qwen3-30B-A3B-UD-Q4_K_M.gguf",
    "Qwen3-30B-A3B-Q8_0.gguf",
    "mmproj-F16.gguf",
    "imatrix_unsloth.gguf",
    "Qwen3-30B-A3B-Q4_K_S.gguf",
    *(f"BF16/Qwen3-30B-A3B-BF16-{i:05d}-of-00003.gguf" for i in (3, 1, 2)),
]


@pytest.mark.parametrize(
    ("tag", "want"),
    [
        (
            "q4_k_m",
            ["Qwen3-30B-A3B-Q4_K_M.gguf"],
        ),  # case-insensitive; the label "Q4_K_M" beats UD-Q4_K_M
        ("UD-Q4_K_M", ["Qwen3-30B-A3B-UD-Q4_K_M.gguf"]),
        (None, ["Qwen3-30B-A3B-Q4_K_M.gguf"]),  # llama.cpp's default tag
        (
            "bf16",
            [f"BF16/Qwen3-30B-A3B-BF16-{i:05d}-of-00003.gguf" for i in (1, 2, 3)],
        ),  # every shard, first first
    ],
)
def test_quant_resolution_follows_llama_cpp(tag: str | None, want: list[str]) -> None:
    assert pick_quant(UNSLOTH, tag, "r") == want


def test_lowercase_split_names_as_qwen_publishes_them() -> None:
    files = [
        *(f"qwen2.5-7b-instruct-q4_k_m-0000{i}-of-00002.gguf" for i in (1, 2)),
        "qwen2.5-7b-instruct-q2_k.gguf",
        *(f"qwen2.5-7b-instruct-fp16-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)),
    ]
    assert pick_quant(files, None, "r") == files[:2]  # the default Q4_K_M, in any case
    assert pick_quant(files, "FP16", "r") == files[3:]
    with pytest.raises(StoreError, match=r"it has: fp16, q2_k, q4_k_m "):
        pick_quant(files, "Q8_0", "r")


def test_quant_resolution_refuses_what_llama_cpp_would_guess() -> None:
    assert pick_quant(["m-Q8_0.gguf", "m-F16.gguf"], None, "r") == [
        "m-Q8_0.gguf"
    ]  # second default tag
    assert pick_quant(["only-IQ2_XXS.gguf"], None, "r") == ["only-IQ2_XXS.gguf"]  # the one model
    with pytest.raises(StoreError, match=r"no quant given.*it has: F16, IQ2_XXS"):
        pick_quant(["m-F16.gguf", "m-IQ2_XXS.gguf"], None, "r")  # llama.cpp takes the first; we ask
    with pytest.raises(
        StoreError, match=r"'Q4_K' is not in the repository; it has: .*Q4_K_M, Q4_K_S"
    ):
        pick_quant(UNSLOTH, "Q4_K", "r")  # a tag is a whole word: Q4_K is neither Q4_K_M nor Q4_K_S
    with pytest.raises(
        StoreError, match=r"'Q4' matches 2 files .* give one of the repository's quants exactly"
    ):
        pick_quant(["a/x-Q4.gguf", "b/y-Q4.gguf"], "Q4", "r")
    with pytest.raises(
        StoreError, match=r"has 3 shards but BF16/m-BF16-00002-of-00003\.gguf is not there"
    ):
        pick_quant(
            ["BF16/m-BF16-00001-of-00003.gguf", "BF16/m-BF16-00003-of-00003.gguf"], "BF16", "r"
        )
    with pytest.raises(StoreError, match=r"it has: Q4_0, Q4_1 "):
        pick_quant(["m-Q4_0.gguf", "m-Q4_1.gguf"], "Q5_0", "r")
    with pytest.raises(StoreError, match=r"no model \.gguf files"):
        pick_quant(["mmproj-F16.gguf", "README.md"], "F16", "r")
