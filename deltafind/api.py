"""The Python API: open a store, get logits, generate, tokenize.

    from deltafind import Model
    model = Model.open("~/.cache/deltafind/demo")
    ids = model.tokenizer.encode("The capital of France is")
    print(model.tokenizer.decode(model.generate(ids, max_new_tokens=16)))

`Model` is the handle a caller holds (generate, stream, snapshot, heat, close); what it holds
is built from `Settings` by compose.py, the composition root every entry point shares.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltafind.compose import draft_settings, make_model, settings_with
from deltafind.config import DraftSettings, Settings
from deltafind.engine.draft.base import DraftError, DraftSource
from deltafind.engine.draft.cross import CrossDraftModel, CrossTokenizerSource, TextCodec
from deltafind.engine.draft.load import source_from_settings
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.generate import ONE_AT_A_TIME, generate
from deltafind.engine.prefill import PrefillPlan
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.stats import EngineStats, GenerationStats
from deltafind.errors import StoreError
from deltafind.log import get_logger
from deltafind.models.ops import fast_math
from deltafind.models.ops.batch import SequenceCache, forward_step
from deltafind.models.ops.cpu_kernels import kernel_status
from deltafind.store.experts import StoreExperts, prefetch_options
from deltafind.store.heat import hottest, read_heat, update_heat
from deltafind.store.manifest import Manifest
from deltafind.store.spine import MemoryLock, SpineStreamer
from deltafind.tokenizer import Tokenizer

log = get_logger(__name__)


class Model:
    """A store opened for inference: the resident spine plus streamed experts."""

    def __init__(
        self,
        store_dir: Path,
        manifest: Manifest,
        net: torch.nn.Module,
        experts: StoreExperts,
        tokenizer: Tokenizer,
        settings: Settings,
    ) -> None:
        self.store_dir, self.manifest, self.net, self.experts, self.tokenizer = (
            store_dir,
            manifest,
            net,
            experts,
            tokenizer,
        )
        self.settings = settings  # what it was opened with (reload: apply_live)
        self.last_stats = GenerationStats()
        self.spine: SpineStreamer | None = None  # streams the layers past the resident prefix
        self.draft: DraftSource | None = (
            None  # speculative decoding (engine/speculative.py), see open_draft
        )
        self.draft_policy = PolicyOptions()
        self.last_draft_stats = DraftStats()
        self.last_engine_stats = EngineStats()
        self._draft_models: list[Model] = []
        self._drafts_by_spec: dict[
            str, tuple[DraftSource | None, PolicyOptions]
        ] = {}  # generate(draft=) builds each once
        self.memory_lock = MemoryLock()
        self.cluster: Any = None  # the expert nodes' provider when [cluster] role = "coordinator"
        self.prefill = PrefillPlan(
            1 << 62, 1, 0
        )  # set at load from the memory left (engine/prefill.py)

    @classmethod
    def open(
        cls,
        store: str | Path | None = None,
        settings: Settings | None = None,
        *,
        trace_path: str | Path | None = None,
        **overrides: Any,
    ) -> Model:
        """Load the spine of the store at `store` (else `[model] store`); experts stream on demand.

        Everything comes from `settings` (default: `load_settings()`, the config file and DELTAFIND_*
        variables), with `overrides` on top: any setting by its Python name (its key, or section_key:
        docs/configuration.md; expert_bytes=None keeps every expert read), and the section forms
        device (its kind), prefetch (bool), drives (DriveOptions per store drive) and draft (a
        `--draft` value). `trace_path` appends a router trace (JSONL).
        """
        return make_model(cls, settings_with(settings, store, overrides), trace_path)

    def open_draft(self, draft: DraftSettings) -> None:
        """The one draft opener: `[draft]` (mode, source, max_width) as this model's draft source and policy.

        mode "on" fails (StoreError) when the source cannot draft; "auto" logs and goes on without.
        Output never changes: the same tokens under greedy, the same distribution under sampling.
        A cross-tokenizer draft (`raw_only`) is for raw prompts: chat requests never use it.
        """
        device, dtype = (
            self.net.lm_head.weight.device,
            str(self.net.lm_head.weight.dtype).removeprefix("torch."),
        )

        def open_model(path: Path) -> Model:
            m = Model.open(path, device=str(device), dtype=dtype, draft="off")
            self._draft_models.append(m)  # closed with the target
            return m

        try:
            self.draft, self.draft_policy = source_from_settings(
                draft,
                self.net,
                target_store=self.store_dir,
                open_store=lambda p: open_model(p).net,
                device=device,
                open_cross=lambda paths: open_cross_draft(self.tokenizer, paths, open_model),
            )
        except DraftError as e:
            raise StoreError(
                f"[draft] mode = \"on\" but source {draft.source!r} cannot draft: {e}; "
                "set [draft] mode = \"auto\" (or --draft off) to run without it"
            ) from e
        if self.draft is not None:
            log.info(
                "draft_ready",
                source=self.draft.name,
                mode=self.draft_policy.mode,
                max_width=self.draft_policy.max_width,
            )

    def apply_live(self, settings: Settings, live: Sequence[str]) -> None:
        """Apply reloaded `[cache]`/`[prefetch]` keys named in `live` (call between engine steps)."""
        c, ex = settings.cache, self.experts
        if "cache.expert_bytes" in live:
            ex.set_cache_budget(None if c.expert_bytes is None else int(c.expert_bytes))
            # chosen at open
            if c.expert_bytes is not None and int(c.expert_bytes) < ex.resident.dense_bytes:
                log.warning(
                    "expert_bytes_below_dense_held",
                    expert_bytes=int(c.expert_bytes),
                    dense_held_bytes=ex.resident.dense_bytes,
                    fix="restart the daemon to hold fewer dense layers under the new [cache] expert_bytes",
                )
        if any(k.startswith("prefetch.") for k in live):
            ex.prefetch_options = prefetch_options(settings)
        if "cache.pin_bytes" in live:
            ex.resident.unpin()
            if int(c.pin_bytes):
                ex.resident.pin(hottest(read_heat(self.store_dir)), int(c.pin_bytes))
        self.settings = settings

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.tokenizer.eos_token_ids)

    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] for the whole sequence, computed without a cache."""
        with torch.inference_mode():
            return forward_step(
                self.net, SequenceCache(self.net.num_layers), token_ids, all_logits=True
            ).float()

    def stream(self, token_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield new tokens as they are chosen (on the engine core, synchronously); figures land in
        `last_stats`, `last_draft_stats` and `last_engine_stats` (the core's snapshot source)."""
        self.last_stats, self.last_draft_stats, self.last_engine_stats = (
            GenerationStats(),
            DraftStats(),
            EngineStats(),
        )
        limits = replace(
            ONE_AT_A_TIME,
            prefill=replace(self.prefill, cap=self.settings.server.max_prefill_tokens),
        )
        yield from generate(
            self.net,
            token_ids,
            params,
            self.eos_token_ids,
            self.last_stats,
            draft=self.draft,
            limits=limits,
            draft_policy=self.draft_policy,
            draft_stats=self.last_draft_stats,
            engine_stats=self.last_engine_stats,
        )

    def generate(
        self,
        token_ids: Sequence[int],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        draft: str | None = None,
    ) -> list[int]:
        """New token ids (EOS included when it ends the sequence); `draft` (a `--draft` value) for this call only."""
        params = SamplingParams(
            max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids)
        )
        if draft is None:
            return list(self.stream(token_ids, params))
        saved = self.draft, self.draft_policy
        try:
            if draft not in self._drafts_by_spec:
                self.open_draft(draft_settings(draft, self.draft_policy.max_width))
                self._drafts_by_spec[draft] = (self.draft, self.draft_policy)
            self.draft, self.draft_policy = self._drafts_by_spec[draft]
            return list(self.stream(token_ids, params))
        finally:
            self.draft, self.draft_policy = saved

    def snapshot(self) -> dict[str, Any]:
        """The store's figures as JSON-ready data (status --json, bench --json, --stats, /metrics): expert
        cache, pin tier and dense layers held, reads, prefetch, drives and the streamed spine."""
        ex = self.experts
        e, layers = ex.stats, list(ex.stats.layers.values())
        needed = sum(r.needed for r in layers)
        remote, total = (
            ex.reader.remote,
            self.manifest.expert_bytes(),
        )  # streaming fills as it serves
        out: dict[str, Any] = {
            "cache_requested": e.requested,
            "cache_hits": e.cache_hits,
            "pinned_hits": e.pinned_hits,
            "cache_hit_rate": (e.cache_hits + e.pinned_hits) / e.requested if e.requested else 0.0,
            "cache_used_bytes": ex.cache.used_bytes,
            "cache_budget_bytes": ex.cache.budget_bytes or 0,
            "cache_experts": len(ex.cache),
            "pinned_bytes": ex.resident.pinned_bytes,
            "experts_read": e.read,
            "dense_held_layers": len(ex.resident.layers),
            "dense_held_bytes": ex.resident.dense_bytes,
            "bytes_read": e.bytes_read,
            "io_wait_s": e.wait_s,
            "prefetch_issued": e.prefetch_issued,
            "prefetch_used": e.prefetch_used,
            "prefetch_wasted": e.prefetch_wasted,
            "prefetch_recall": sum(r.hits for r in layers) / needed if needed else 0.0,
            "prefetch_gated": e.prefetch_gated,
            "prefetch_gate": ex.gate.snapshot(),  # per-layer recall/precision, drive load
            "drives": [
                {
                    "index": i,
                    "path": str(path),
                    "healthy": os.access(path, os.R_OK) and i not in ex.reader.problems,
                    "problem": ex.reader.problems.get(i, ""),
                    "reads": d.reads,
                    "bytes_read": d.bytes,
                    "read_gb_s": d.gb_s,
                }
                for i, (path, d) in enumerate(zip(ex.reader.paths, ex.reader.stats, strict=True))
            ],
            "store_bytes_total": total,
            "store_bytes_present": remote.present_bytes() if remote is not None else total,
            "spine_int8": self.settings.cache.spine_int8,
            "math": fast_math.mode(),  # what runs: "exact" where the mode asked for is unavailable
            "math_requested": self.settings.device.math,
            "math_note": fast_math.status_note(self.settings.device.math),
            "cpu_kernels": kernel_status(),
        }
        if self.cluster is not None:
            out["nodes"] = self.cluster.status()
        if (sp := self.spine) is not None:
            out["spine"] = {
                "resident_layers": sp.plan.resident_layers,
                "num_layers": sp.plan.num_layers,
                "layer_reads": sp.layers_read,
                "bytes_read": sp.bytes_read,
                "wait_s": sp.wait_s,
            }
        return out

    def take_uses(self) -> dict[tuple[int, int], int]:
        """The expert uses counted since the last take (on the engine thread: it owns the counts)."""
        uses = dict(self.experts.uses)
        self.experts.uses.clear()  # the store's own counter, emptied in place (never replaced)
        return uses

    def write_heat(self, uses: dict[tuple[int, int], int]) -> None:
        """Merge `uses` into the heat file; any thread (the file I/O stays off the engine thread)."""
        if not uses:
            return
        try:
            update_heat(self.store_dir, uses, self.settings.cache.heat_decay)
        except OSError as e:
            log.warning("heat_not_saved", store=str(self.store_dir), error=e.strerror)

    def close(self) -> None:
        for m in self._draft_models:
            m.close()
        self._draft_models = []
        if self.cluster is not None:
            self.cluster.close()
        self.write_heat(self.take_uses())  # a read-only store is logged, not fatal
        self.experts.close()
        if self.spine is not None:
            self.spine.close()
        self.memory_lock.unlock()


def text_codec(tokenizer: Tokenizer, add_bos: bool | None = False) -> TextCodec:
    """`tokenizer` as a cross-tokenizer draft sees it: a raw prompt's encoding (special-token text stays text).

    The target's codec leaves BOS out (the source sets a leading BOS aside itself);
    a draft's keeps its own BOS rule (`add_bos=None`), so it reads text as it was trained to.
    """
    return TextCodec(
        lambda text: tokenizer.encode(text, add_bos=add_bos),
        lambda ids: tokenizer.decode(list(ids)),
        tokenizer.bos_token_id,
    )


def open_cross_draft(
    target: Tokenizer,
    stores: Sequence[str | Path],
    open_model: Callable[[Path], Model] | None = None,
) -> CrossTokenizerSource:
    """The cross-tokenizer draft (docs/kimi-k3-drafting-io.md §7.7) for raw completions: one store, or a probe store then a wide one.

    The drafts may be any family with any tokenizer; they meet the target only as text.
    Closing the source closes their stores, unless `open_model` opened them (then they are the caller's).
    """
    opened: list[Model] = []
    try:
        for path in stores:
            opened.append(
                open_model(Path(path))
                if open_model
                else Model.open(path, device="cpu", dtype="float32")
            )
    except BaseException:
        if open_model is None:
            for m in opened:
                m.close()
        raise
    drafts = [
        CrossDraftModel(
            m.net,
            text_codec(m.tokenizer, add_bos=None),
            frozenset(m.eos_token_ids),
            min(8192, m.net.args.max_position_embeddings),  # a draft reads 8192 positions at most
        )
        for m in opened
    ]
    name = "cross:" + ",".join(str(p) for p in stores)
    return CrossTokenizerSource(
        text_codec(target), drafts, name, closers=[] if open_model else [m.close for m in opened]
    )
