"""The Python API: open a store, get logits, generate, tokenize.

    from deltafind import Model
    model = Model.open("~/.cache/deltafind/demo")
    ids = model.tokenizer.encode("The capital of France is")
    print(model.tokenizer.decode(model.generate(ids, max_new_tokens=16)))

Wires store, model family, engine and tokenizer together (as `cli` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from deltafind.device.device_cache import DeviceExpertCache
from deltafind.device.device_cache import spine_budget as device_spine_budget
from deltafind.device.select import START_ERRORS as DEVICE_START_ERRORS
from deltafind.device.select import DeviceError, start_device
from deltafind.device.select import release as release_device
from deltafind.engine.draft.base import DraftSource
from deltafind.engine.draft.cross import CrossDraftModel, CrossTokenizerSource, TextCodec
from deltafind.engine.draft.load import make_draft_source
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.generate import GenerationStats, forward_step, generate
from deltafind.engine.sampler import SamplingParams
from deltafind.errors import StoreError
from deltafind.log import get_logger
from deltafind.models.ops.batch import SequenceCache
from deltafind.models.ops.mxfp4 import use_compile
from deltafind.models.ops.stored import (
    adopt_stored,
    hold_dtype,
    install_quantized,
    int8_spine,
    stored_weight_names,
)
from deltafind.models.registry import family_module
from deltafind.store.experts import PrefetchOptions, StoreExperts
from deltafind.store.heat import hottest, read_heat, update_heat
from deltafind.store.manifest import SPINE_NAME, TOKENIZER_DIR, Manifest
from deltafind.store.reader import DriveOptions
from deltafind.store.spine import MemoryLock, SpineStreamer, load_resident, plan_spine, read_layout
from deltafind.store.trace import TraceWriter
from deltafind.tokenizer import Tokenizer

log = get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Model:
    """A store opened for inference: the resident spine plus streamed experts."""

    def __init__(self, store_dir: Path, manifest: Manifest, net: torch.nn.Module, experts: StoreExperts, tokenizer: Tokenizer) -> None:
        self.store_dir, self.manifest, self.net, self.experts, self.tokenizer = store_dir, manifest, net, experts, tokenizer
        self.last_stats = GenerationStats()
        self.heat_decay = 0.99
        self.spine: SpineStreamer | None = None  # streams the layers past the resident prefix
        self.draft: DraftSource | None = None  # speculative decoding (engine/speculative.py), see use_draft
        self.draft_policy = PolicyOptions()
        self.last_draft_stats = DraftStats()
        self._draft_models: list[Model] = []
        self._drafts_by_spec: dict[str, tuple[DraftSource | None, PolicyOptions]] = {}  # generate(draft=) builds each once
        self.memory_lock = MemoryLock()

    @classmethod
    def open(
        cls,
        store_dir: str | Path,
        device: str | torch.device = "cpu",
        expert_cache_bytes: int | None = None,
        dtype: str = "float32",
        drives: list[DriveOptions] | None = None,
        prefetch: PrefetchOptions | bool = True,
        direct_io: bool = True,
        pin_bytes: int = 0,
        trace_path: str | Path | None = None,
        heat_decay: float = 0.99,
        spine_bytes: int | None = None,
        mlock: bool = True,
        verify: str = "fast",
        fallback: bool = True,
        compile_kernels: bool = False,
        draft: str = "off",
        draft_max_width: int = 7,
        spine_int8: bool = False,
    ) -> Model:
        """Load the spine of the store at `store_dir`; experts stream on demand.

        `expert_cache_bytes=None` keeps every expert read (unlimited cache);
        0 reads every expert every time it is used. `drives` sets per-drive
        queue depth and (for benchmarks) a read-rate cap, in the store's drive order.
        `pin_bytes` keeps the store's hottest experts (by its heat file) resident;
        `trace_path` appends a router trace (JSONL). `spine_bytes` bounds the spine's
        memory (None: all resident): the largest prefix of layers that fits stays
        resident, the rest streams layer by layer. `mlock` pins the resident spine
        where RLIMIT_MEMLOCK allows (logged once when it does not). `verify` checks each
        expert read: "fast" (xxh3_64), "full" (sha256 too) or "off" (benchmarks only). `device` is a
        `[device] kind` (auto, cpu, cuda, cuda:N, mps); if it is unusable or fails
        while the model is placed on it, `fallback` opens on the CPU instead (logged).
        `compile_kernels` torch.compiles the MXFP4 dequantisation on a GPU ([device] compile).
        """
        # every other argument, handed unchanged to the on-device attempt below (first line: nothing else is local yet)
        options = {k: v for k, v in locals().items() if k not in ("cls", "store_dir", "device", "fallback")}
        from safetensors import safe_open

        device = start_device(device)  # auto picks CUDA, then MPS, then CPU; an unusable device logs and gives the CPU
        if device.type != "cpu" and fallback:
            try:
                return cls.open(store_dir, device, **options, fallback=False)
            except DEVICE_START_ERRORS as e:
                log.error("device_failed_at_start", device=str(device), error=f"{type(e).__name__}: {e}", fallback="cpu")
                release_device(device)
                device = torch.device("cpu")

        store_dir = Path(store_dir).expanduser()
        manifest = Manifest.load(store_dir)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
        torch_dtype = DTYPES[dtype]
        family = family_module(manifest.family)
        args = family.ModelArgs.from_config(manifest.model_config)
        if isinstance(prefetch, bool):
            prefetch = PrefetchOptions(enabled=prefetch)
        trace = TraceWriter(Path(trace_path)) if trace_path else None
        # bf16/fp16 experts stay as stored in the cache (twice the experts per byte) and are computed on as stored
        hold = hold_dtype({getattr(torch, t.dtype) for r in manifest.experts for t in r.tensors}, torch_dtype)
        experts = StoreExperts(manifest, store_dir, expert_cache_bytes, hold, device, drives, prefetch, direct_io, trace, verify=verify)
        if pin_bytes:
            experts.pin(hottest(read_heat(store_dir)), pin_bytes)
        with torch.device("meta"):
            net = family.Model(args, experts)
        # Routing biases stay fp32 (as in HF: rounding them can flip expert choices); see store/spine.py.
        spine_path = store_dir / SPINE_NAME
        budget = device_spine_budget(device, spine_bytes)  # on a GPU: capped by its free memory, same prefix rule
        try:
            layout = read_layout(spine_path, torch_dtype, keep=stored_weight_names(net))
            plan = plan_spine(layout, net.num_layers, budget)
        except StoreError as e:
            if budget == spine_bytes:
                raise
            raise DeviceError(f"{device} has too little free memory for the spine's always-resident part: {e}") from e
        with safe_open(str(spine_path), "pt", device="cpu") as f:
            spine = load_resident(spine_path, plan, device, f.get_tensor)
        streamed = {t.name for i in plan.streamed for t in plan.layers[i]}
        tied = getattr(args, "tie_word_embeddings", False)
        if tied:
            spine.pop("lm_head.weight", None)
        quants = {t.name: t.quant for t in layout if t.quant}  # GGUF blocks stay blocks (models/ops/stored.py)
        install_quantized(net, quants, {n: spine.pop(n) for n in list(spine) if n in quants})
        missing, unexpected = net.load_state_dict(spine, strict=False, assign=True)
        missing = [k for k in missing if not (tied and k == "lm_head.weight") and k not in streamed and k not in quants]
        if missing or unexpected:
            raise StoreError(f"{store_dir}: spine does not fit the {manifest.family} model (missing {missing[:5]}, unexpected {unexpected[:5]}); re-import the store")
        if tied:
            net.tie_weights()
        adopt_stored(net, torch_dtype)  # bf16/fp16 matmul weights stay as stored; fp32 activations
        if spine_int8:
            log.warning("spine_int8", saved_bytes=int8_spine(net), note="row-int8 spine: NOT weight-exact ([cache] spine_int8)")
        net.eval()
        if device.type != "cpu":  # the expert cache lives in device memory, sized from what is free now
            experts.cache = DeviceExpertCache(device, expert_cache_bytes)
            if compile_kernels:
                use_compile(True)
                log.info("mxfp4_compile", device=str(device))
        tokenizer = Tokenizer.load(store_dir / TOKENIZER_DIR)
        model = cls(store_dir, manifest, net, experts, tokenizer)
        model.heat_decay = heat_decay
        if plan.streamed:
            model.spine = SpineStreamer(spine_path, plan, device)
            model.spine.bind(net)
            net.spine_stream = model.spine
            log.info("spine_prefix_resident", resident_layers=plan.resident_layers, streamed_layers=len(plan.streamed),
                     resident_bytes=plan.resident_bytes, window_bytes=plan.window_bytes, budget_bytes=spine_bytes)
        if mlock:
            model.memory_lock.lock(spine.values())
        if draft != "off":
            model.use_draft(draft, draft_max_width)
        return model

    def use_draft(self, spec: str, max_width: int = 7) -> None:
        """Draft with `spec` (off | auto | self[:N] | ngram | dspark | cross:STORE[,WIDE] | a store path) from now on.

        Output never changes: the same tokens under greedy, the same distribution under sampling.
        A cross-tokenizer draft (`raw_only`) is for raw prompts: do not use it for chat.
        """
        device = self.net.lm_head.weight.device

        def open_model(path: Path) -> Model:
            m = Model.open(path, device=device, dtype=str(self.net.lm_head.weight.dtype).removeprefix("torch."))
            self._draft_models.append(m)  # closed with the target
            return m

        def open_cross(paths: list[Path]) -> CrossTokenizerSource:
            return open_cross_draft(self.tokenizer, paths, open_model=open_model)

        self.draft, mode = make_draft_source(spec, self.net, target_store=self.store_dir, open_store=lambda p: open_model(p).net,
                                             device=device, open_cross=open_cross)
        self.draft_policy = PolicyOptions(mode=mode if mode != "off" else "auto", max_width=max_width)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.tokenizer.eos_token_ids)

    def forward_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] for the whole sequence, computed without a cache."""
        with torch.inference_mode():
            return forward_step(self.net, SequenceCache(self.net.num_layers), token_ids, all_logits=True).float()

    def stream(self, token_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield new tokens as they are chosen; stats land in `self.last_stats`."""
        self.last_stats, self.last_draft_stats = GenerationStats(), DraftStats()
        yield from generate(self.net, token_ids, params, self.eos_token_ids, self.last_stats,
                            draft=self.draft, draft_policy=self.draft_policy, draft_stats=self.last_draft_stats)

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
        """New token ids (EOS included when it ends the sequence); `draft` overrides `use_draft` for this call."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids))
        if draft is None:
            return list(self.stream(token_ids, params))
        saved = self.draft, self.draft_policy
        try:
            if draft not in self._drafts_by_spec:
                self.use_draft(draft, self.draft_policy.max_width)
                self._drafts_by_spec[draft] = (self.draft, self.draft_policy)
            self.draft, self.draft_policy = self._drafts_by_spec[draft]
            return list(self.stream(token_ids, params))
        finally:
            self.draft, self.draft_policy = saved

    def save_heat(self) -> None:
        """Merge this run's expert uses into the store's heat file (a read-only store is logged, not fatal)."""
        uses, self.experts.uses = dict(self.experts.uses), type(self.experts.uses)(int)
        if not uses:
            return
        try:
            update_heat(self.store_dir, uses, self.heat_decay)
        except OSError as e:
            log.warning("heat_not_saved", store=str(self.store_dir), error=e.strerror)

    def close(self) -> None:
        for m in self._draft_models:
            m.close()
        self._draft_models = []
        self.save_heat()
        self.experts.close()
        if self.spine is not None:
            self.spine.close()
        self.memory_lock.unlock()


def text_codec(tokenizer: Tokenizer, add_bos: bool | None = False) -> TextCodec:
    """`tokenizer` as a cross-tokenizer draft sees it: a raw prompt's encoding (special-token text stays text).

    The target's codec leaves BOS out (the source sets a leading BOS aside itself);
    a draft's keeps its own BOS rule (`add_bos=None`), so it reads text as it was trained to.
    """
    return TextCodec(lambda text: tokenizer.encode(text, add_bos=add_bos), lambda ids: tokenizer.decode(list(ids)),
                     tokenizer.bos_token_id)


def open_cross_draft(target: Tokenizer, stores: Sequence[str | Path], device: str = "cpu", dtype: str = "float32",
                     max_context: int = 8192, open_model: Callable[[Path], Model] | None = None) -> CrossTokenizerSource:
    """Spec 7.7's cross-tokenizer draft for raw completions: one store, or a probe store then a wide one.

    The drafts may be any family with any tokenizer; they meet the target only as text.
    Closing the source closes their stores, unless `open_model` opened them (then they are the caller's).
    """
    opened: list[Model] = []
    try:
        for path in stores:
            opened.append(open_model(Path(path)) if open_model else Model.open(path, device=device, dtype=dtype))
    except BaseException:
        if open_model is None:
            for m in opened:
                m.close()
        raise
    drafts = [CrossDraftModel(m.net, text_codec(m.tokenizer, add_bos=None), frozenset(m.eos_token_ids),
                              min(max_context, getattr(m.net.args, "max_position_embeddings", max_context)))
              for m in opened]
    name = "cross:" + ",".join(str(p) for p in stores)
    return CrossTokenizerSource(text_codec(target), drafts, name, closers=[] if open_model else [m.close for m in opened])
