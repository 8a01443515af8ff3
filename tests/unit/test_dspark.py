"""DSpark (docs/kimi-k3-drafting-io.md §7.2-7.5) against a reference written here from the spec's formulas in the
non-absorbed form (kv_b expanded to per-head K and V, float64 throughout), on small random
bf16 weights; YaRN's numbers for the released config; the store import's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltafind.errors import StoreError
from deltafind.importer.dspark_import import import_dspark, synthetic_config, write_synthetic_dspark
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import dspark, kimi_k3
from deltafind.store.dspark import CONFIG_NAME, DRAFT_DIR, REAL, WEIGHTS_NAME, load_dspark, roster
from tests.conftest import deltafind_cmd

F64 = torch.float64
SMALL = {
    **REAL,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "vocab_size": 64,
    "draft_vocab_size": 64,
    "target_hidden_size": 48,
    "target_num_hidden_layers": 7,
    "target_layer_ids": [0, 2, 3, 5, 6],
    "mask_token_id": 61,
    "markov_rank": 8,
    "num_hidden_layers": 5,
    "num_target_layers": 5,
}


def _random_model(cfg: dict, seed: int = 0) -> tuple[dspark.Model, torch.Tensor, torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    model = dspark.Model(dspark.ModelArgs.from_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model = model.to(torch.bfloat16)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    embed = (
        torch.randn(v, h, generator=g).bfloat16().float()
    )  # K3's table: bf16 values, held widened
    head = torch.nn.Linear(h, v, bias=False)
    head.weight.data = (3 * torch.randn(v, h, generator=g) / math.sqrt(h)).bfloat16().float()
    model.attach(embed, head)
    return model, embed, head


# ---- the reference: docs/kimi-k3-drafting-io.md §7.3-7.5 as written, float64, K and V expanded per head ----


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.to(F64)
    return w.to(F64) * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_inv_freq(rope: dict, dim: int) -> tuple[torch.Tensor, int, int]:
    theta, factor, orig = (
        rope["rope_theta"],
        rope["factor"],
        rope["original_max_position_embeddings"],
    )
    i = torch.arange(dim // 2, dtype=F64)
    base = theta ** (-2 * i / dim)
    interp = base / factor

    def corr(r: float) -> float:
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(theta))

    low, high = (
        max(math.floor(corr(rope["beta_fast"])), 0),
        min(math.ceil(corr(rope["beta_slow"])), dim - 1),
    )
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    return interp * (1 - extra) + base * extra, low, high


def ref_rotate(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i+1) rotated by pos * inv_i; x [T, ..., d]."""
    x = x.to(F64)
    angle = pos.to(F64)[:, None] * inv[None, :]  # [T, d/2]
    angle = angle.view(angle.shape[0], *([1] * (x.dim() - 2)), angle.shape[1])
    c, s = angle.cos(), angle.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x1 * c + x0 * s
    return out


def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(F64) @ w.to(F64).T


class Reference:
    def __init__(
        self, model: dspark.Model, cfg: dict, embed: torch.Tensor, head: torch.nn.Linear
    ) -> None:
        self.p = {n: t.detach() for n, t in model.state_dict().items()}
        self.cfg, self.embed, self.head = cfg, embed, head
        self.inv, _, _ = ref_inv_freq(cfg["rope_parameters"], cfg["qk_rope_head_dim"])
        m = (
            0.1
            * math.log(cfg["rope_parameters"]["factor"])
            * cfg["rope_parameters"]["mscale_all_dim"]
            + 1
        )
        self.scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5 * m * m
        self.lat: list[torch.Tensor] = []
        self.pe: list[torch.Tensor] = []

    def context(self, rows: torch.Tensor) -> None:
        c, p, kvr = self.cfg, self.p, self.cfg["kv_lora_rank"]
        ctx = ref_rms(lin(rows.bfloat16(), p["context_proj.weight"]), p["context_norm.weight"])
        pos = torch.arange(rows.shape[0])
        for j in range(c["num_hidden_layers"]):
            kv = lin(ctx, p[f"layers.{j}.self_attn.kv_a_proj_with_mqa.weight"])
            self.lat.append(ref_rms(kv[:, :kvr], p[f"layers.{j}.self_attn.kv_a_layernorm.weight"]))
            self.pe.append(ref_rotate(kv[:, kvr:], pos, self.inv))

    def mla(self, j: int, n: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, kvr = self.cfg, self.cfg["kv_lora_rank"]
        w = {
            k.split(f"layers.{j}.self_attn.")[1]: v
            for k, v in self.p.items()
            if k.startswith(f"layers.{j}.self_attn.")
        }
        nh, dn, dr, dv = (
            c["num_attention_heads"],
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
        )
        r = n.shape[0]
        q = lin(
            ref_rms(lin(n, w["q_a_proj.weight"]), w["q_a_layernorm.weight"]), w["q_b_proj.weight"]
        ).view(r, nh, dn + dr)
        q = torch.cat([q[..., :dn], ref_rotate(q[..., dn:], pos, self.inv)], dim=-1)
        kvq = lin(n, w["kv_a_proj_with_mqa.weight"])
        lat = torch.cat(
            [self.lat[j], ref_rms(kvq[:, :kvr], w["kv_a_layernorm.weight"])]
        )  # [L+R, kvr]
        pe = torch.cat([self.pe[j], ref_rotate(kvq[:, kvr:], pos, self.inv)])  # [L+R, dr]
        kv = lin(lat, w["kv_b_proj.weight"]).view(-1, nh, dn + dv)
        k = torch.cat(
            [kv[..., :dn], pe[:, None, :].expand(-1, nh, dr)], dim=-1
        )  # per-head keys [L+R, NH, dn+dr]
        scores = torch.einsum("rhd,lhd->hrl", q, k) * self.scale  # no mask
        out = torch.einsum("hrl,lhv->rhv", torch.softmax(scores, -1), kv[..., dn:])
        return lin(out.reshape(r, nh * dv), w["o_proj.weight"])

    def propose(
        self, pending: int, width: int
    ) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
        c, p = self.cfg, self.p
        length = self.lat[0].shape[0]
        pos = torch.arange(length, length + 7)
        hidden = self.embed[torch.tensor([pending] + [c["mask_token_id"]] * 6)].to(F64)
        residual = None
        for j in range(c["num_hidden_layers"]):
            acc = hidden if residual is None else residual + hidden
            acc = acc + self.mla(j, ref_rms(acc, p[f"layers.{j}.input_layernorm.weight"]), pos)
            m = ref_rms(acc, p[f"layers.{j}.post_attention_layernorm.weight"])
            g, u = (
                lin(m, p[f"layers.{j}.mlp.gate_proj.weight"]),
                lin(m, p[f"layers.{j}.mlp.up_proj.weight"]),
            )
            hidden, residual = (
                lin(torch.nn.functional.silu(g) * u, p[f"layers.{j}.mlp.down_proj.weight"]),
                acc,
            )
        out = ref_rms(residual + hidden, p["final_norm.weight"])
        logits = lin(out[:width], self.head.weight)
        tokens, scores, conf, prev = [], [], [], pending
        for r in range(width):
            e = p["markov_head.markov_w1.weight"][prev].to(F64)
            s = logits[r] + p["markov_head.markov_w2.weight"].to(F64) @ e
            conf.append(
                lin(torch.cat([out[r], e]), p["confidence_head.proj.weight"])
                + p["confidence_head.proj.bias"].to(F64)
            )
            prev = int(s.argmax())
            tokens.append(prev)
            scores.append(s)
        return out, tokens, torch.stack(scores), torch.cat(conf)


# ---- tests ----


def test_yarn_numbers_of_the_released_config() -> None:
    rope = REAL["rope_parameters"]
    inv, low, high = ref_inv_freq(rope, 64)
    assert (low, high) == (15, 26)  # docs/kimi-k3-drafting-io.md §7.5
    args = dspark.ModelArgs.from_config({**REAL, "num_hidden_layers": 5})
    mine = dspark.YarnRope(args)
    torch.testing.assert_close(mine.inv_freq.double(), inv, rtol=1e-6, atol=0)
    assert mine.scale == 1.0  # yarn_mscale(32, mscale=1) / yarn_mscale(32, mscale_all_dim=1)
    assert (
        abs(0.1 * math.log(32) + 1 - 1.3466) < 1e-4
        and abs((0.1 * math.log(32) + 1) ** 2 - 1.8133) < 1e-4
    )
    assert args.softmax_scale() == pytest.approx(
        192**-0.5 * (0.1 * math.log(32) + 1) ** 2, rel=1e-12
    )
    # below `low` the frequencies are the base ones, above `high` the interpolated ones (/32)
    base = 50000.0 ** (-2 * torch.arange(32, dtype=F64) / 64)
    torch.testing.assert_close(inv[:16], base[:16])
    torch.testing.assert_close(inv[26:], base[26:] / 32)


def test_rotation_is_interleaved_pairs() -> None:
    x = torch.arange(8.0).view(1, 8).bfloat16()
    cos, sin = (
        torch.cos(torch.tensor([[0.5, 1.0, 2.0, 3.0]])),
        torch.sin(torch.tensor([[0.5, 1.0, 2.0, 3.0]])),
    )
    out = dspark.yarn_rotate(x, cos, sin)
    x0, x1 = x.float()[0, 0], x.float()[0, 1]
    assert out.dtype == torch.bfloat16
    assert out[0, 0].item() == pytest.approx((x0 * cos[0, 0] - x1 * sin[0, 0]).item(), rel=1e-2)
    assert out[0, 1].item() == pytest.approx((x1 * cos[0, 0] + x0 * sin[0, 0]).item(), rel=1e-2)


def test_rmsnorm_casts_before_the_weight() -> None:
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = (1 + torch.randn(48, generator=torch.Generator().manual_seed(2))).bfloat16()
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * w
    got = dspark.rmsnorm_bf16(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proposal_matches_the_expanded_reference(seed: int) -> None:
    model, embed, head = _random_model(SMALL, seed)
    ref = Reference(model, SMALL, embed, head)
    rows = torch.randn(11, 5 * 48, generator=torch.Generator().manual_seed(100 + seed))
    ctx = model.new_context()
    with torch.inference_mode():
        model.extend(ctx, rows[:6])  # in two steps, as commits arrive
        model.extend(ctx, rows[6:])
        ref.context(rows)
        # The cached context: bf16, one latent/pe row per position and layer.
        for j, layer in enumerate(ctx.layers):
            lat, pe = layer.view()
            assert (
                lat.dtype == pe.dtype == torch.bfloat16
                and lat.shape == (11, 16)
                and pe.shape == (11, 8)
            )
            torch.testing.assert_close(lat.double(), ref.lat[j], atol=0.05, rtol=0.02)
            torch.testing.assert_close(pe.double(), ref.pe[j], atol=0.05, rtol=0.02)
        out = model.hidden(ctx, pending=7)
        draft = model.propose(ctx, pending=7, width=7)
    want_out, want_tokens, want_scores, want_conf = ref.propose(7, 7)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 48)
    # bf16 through 5 layers against float64: a few bf16 steps of error on unit-scale values.
    err = (out.double() - want_out).abs().max().item()
    assert err < 0.1, err
    torch.testing.assert_close(draft.confidence.double(), want_conf, atol=0.1, rtol=0.05)
    assert len(draft.tokens) == 7 and ctx.length == 11  # query rows are not kept
    # K3's head on our rows vs on the reference's: bf16 error, well under the choices' margins.
    logit_err = (head(out.float()).double() - want_out @ head.weight.double().T).abs().max().item()
    assert logit_err < 0.25, logit_err
    # The chain equals the reference's wherever the reference's choice is clear of that error
    # (an unclear row may go either way; the rows after it then follow a different prev).
    checked = 0
    for r in range(7):
        top2 = want_scores[r].topk(2).values
        if (top2[0] - top2[1]).item() < 2 * logit_err and draft.tokens[r] != want_tokens[r]:
            break
        assert draft.tokens[r] == want_tokens[r], (r, draft.tokens, want_tokens)
        checked += 1
    assert checked >= 2, (draft.tokens, want_tokens)


def test_markov_chain_and_width() -> None:
    model, _, _ = _random_model(SMALL, 3)
    ctx = model.new_context()
    with torch.inference_mode():
        model.extend(ctx, torch.randn(4, 5 * 48, generator=torch.Generator().manual_seed(9)))
        wide = model.propose(ctx, 3, 7)
        for w in (1, 3, 5):
            assert (
                model.propose(ctx, 3, w).tokens == wide.tokens[:w]
            )  # a narrower block is a prefix
        with pytest.raises(ValueError, match=r"1\.\.7"):
            model.propose(ctx, 3, 8)
    ctx.truncate(2)
    assert ctx.length == 2 and all(layer.length == 2 for layer in ctx.layers)
    with pytest.raises(ValueError):
        ctx.truncate(3)


# ---- store side ----


@pytest.fixture(scope="module")
def k3_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("k3d")
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        root / "store",
        [root / "d0"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    return root / "store"


def _hf_folder(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(cfg))
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"torchspec_version": "0.1.0"})
    return path


def _release_like(store: Path, tmp: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from deltafind.store.manifest import Manifest

    cfg = synthetic_config(Manifest.load(store).model_config)
    g = torch.Generator().manual_seed(5)
    tensors = {n: torch.randn(s, generator=g).bfloat16() for n, s in roster(cfg).items()}
    tensors["embed_tokens.weight"] = torch.randn(
        cfg["vocab_size"], cfg["hidden_size"], generator=g
    ).bfloat16()
    return cfg, tensors


def test_import_checks_and_skips_the_embedding(k3_store: Path, tmp_path: Path) -> None:
    cfg, tensors = _release_like(k3_store, tmp_path)
    assert len(tensors) == 68  # the released count: 67 loaded + embed_tokens
    where = import_dspark(_hf_folder(tmp_path / "hf", cfg, tensors), k3_store)
    assert where == k3_store / DRAFT_DIR and sorted(p.name for p in where.iterdir()) == [
        CONFIG_NAME,
        WEIGHTS_NAME,
    ]
    got_cfg, got = load_dspark(k3_store)
    assert got_cfg == cfg and "embed_tokens.weight" not in got
    assert set(got) == set(tensors) - {"embed_tokens.weight"} and all(
        torch.equal(got[n], tensors[n]) for n in got
    )
    assert not [
        p for p in where.parent.iterdir() if p.name.startswith(".dspark")
    ]  # no temporary folder left


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c, t: c.update(model_type="deepseek_v3"), "config.json: model_type"),
        (lambda c, t: c.update(mla_use_nope=True), "mla_use_nope"),
        (lambda c, t: c.update(hidden_size=32), "hidden_size is 32"),
        (lambda c, t: c.update(target_layer_ids=[0, 2, 3, 5, 60]), "target_layer_ids"),
        (lambda c, t: c["rope_parameters"].update(rope_type="linear"), "rope_parameters"),
        (lambda c, t: c.update(eos_token_id=1), "eos_token_id"),
        (
            lambda c, t: t.pop("layers.4.mlp.down_proj.weight"),
            "model.safetensors: tensor layers.4.mlp.down_proj.weight is missing",
        ),
        (
            lambda c, t: t.update({"lm_head.weight": torch.zeros(2, 2).bfloat16()}),
            "unexpected tensor lm_head.weight",
        ),
        (
            lambda c, t: t.update({"context_norm.weight": torch.ones(48).bfloat16()}),
            "context_norm.weight is BF16 \\[48\\]",
        ),
        (
            lambda c, t: t.update({"final_norm.weight": t["final_norm.weight"].float()}),
            "final_norm.weight is F32",
        ),
    ],
)
def test_a_wrong_checkpoint_is_refused_naming_file_and_key(
    k3_store: Path, tmp_path: Path, change, match: str
) -> None:
    before = (
        sorted(p.name for p in (k3_store / "draft").iterdir())
        if (k3_store / "draft").exists()
        else []
    )
    cfg, tensors = _release_like(k3_store, tmp_path)
    change(cfg, tensors)
    with pytest.raises(StoreError, match=match):
        import_dspark(_hf_folder(tmp_path / "bad", cfg, tensors), k3_store)
    after = (
        sorted(p.name for p in (k3_store / "draft").iterdir())
        if (k3_store / "draft").exists()
        else []
    )
    assert after == before  # nothing half-written


def test_released_sizes_are_required_for_the_real_target() -> None:
    from deltafind.importer.synthetic_k3 import REAL as K3_REAL
    from deltafind.importer.synthetic_k3 import text_config
    from deltafind.store.dspark import check_config

    text = text_config(
        {
            **K3_REAL,
            "layers": 93,
            "experts": 896,
            "mla": [i for i in range(1, 94) if i % 4 == 0 or i == 93],
        }
    )
    text.update(vocab_size=163840, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)
    target = {"model_type": "kimi_k3", "text_config": text}
    released = {
        **REAL,
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "mla_use_nope": False,
        "mla_use_output_gate": False,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 5,
        "num_target_layers": 5,
    }
    check_config(released, target)
    with pytest.raises(StoreError, match=r"markov_rank is 128.*docs/kimi-k3-drafting-io.md §7\.1"):
        check_config({**released, "markov_rank": 128}, target)
    assert synthetic_config(target)["target_layer_ids"] == [2, 23, 47, 71, 89]


def test_cli_synthetic_dspark_and_missing_store(k3_store: Path, tmp_path: Path) -> None:
    proc = deltafind_cmd("setup", "--synthetic", "dspark", "--store", str(k3_store), "--seed", "4")
    assert proc.returncode == 0 and "dspark ready" in proc.stdout, proc.stderr
    cfg, tensors = load_dspark(k3_store)
    assert cfg["target_layer_ids"] == [0, 2, 3, 5, 6] and cfg["hidden_size"] == 64
    write_synthetic_dspark(k3_store, seed=4)
    assert all(torch.equal(t, load_dspark(k3_store)[1][n]) for n, t in tensors.items())  # seeded
    proc = deltafind_cmd("setup", "--dspark", str(tmp_path / "nowhere"), "--store", str(k3_store))
    assert proc.returncode != 0 and "nowhere/config.json is missing" in proc.stderr
    with pytest.raises(StoreError, match="no DSpark draft"):
        load_dspark(tmp_path)  # not even a store: the manifest is checked after
