"""Build a draft source from a `--draft` value or the `[draft]` settings.

`--draft` takes off | auto | self[:N] | ngram | dspark | cross:STORE[,WIDE] | a store path. A named
source is forced on (policy "on"); `auto` picks the best source there is and
drafts only while it pays. Opening another store is the caller's (`open_store`,
a callable from path to a model net), after a memory check here: a draft whose
spine would not fit the memory available is refused with a log line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltafind.engine.draft.base import DraftError, DraftSource
from deltafind.engine.draft.ngram import NgramSource
from deltafind.engine.draft.policy import PolicyOptions
from deltafind.engine.draft.self_draft import SelfDraftSource
from deltafind.engine.draft.store_draft import StoreDraftSource
from deltafind.log import get_logger
from deltafind.store.manifest import SPINE_NAME, TOKENIZER_DIR

log = get_logger(__name__)
MEMORY_RESERVE = 0.10  # of available memory, left free after a draft spine is loaded
OpenStore = Callable[[Path], torch.nn.Module]
# Opens cross-tokenizer draft stores (probe[, wide]) with both tokenizers: only the wiring holds text.
OpenCross = Callable[[list[Path]], DraftSource]


def available_bytes(device: str | torch.device = "cpu") -> int:
    """Memory a new allocation can take now: free device memory, or MemAvailable on the host."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def admit_store(
    path: Path, device: str | torch.device = "cpu", available: int | None = None
) -> int:
    """Refuse (DraftError, logged) a draft store whose spine does not fit; returns its spine bytes."""
    spine = path / SPINE_NAME
    if not spine.is_file():
        raise DraftError(
            f"{path}: not a deltafind store (no {SPINE_NAME}); make one with `deltafind setup --from ... --store {path}`"
        )
    need = spine.stat().st_size
    free = available_bytes(device) if available is None else available
    if need > free * (1 - MEMORY_RESERVE):
        log.warning(
            "draft_refused",
            store=str(path),
            reason="memory",
            spine_bytes=need,
            available_bytes=free,
        )
        raise DraftError(
            f"{path}: the draft's spine needs {need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are available "
            f"(keeping {MEMORY_RESERVE:.0%} free); use a smaller draft, or --draft ngram"
        )
    return need


def _vocab_of(store: Path) -> dict[str, int] | None:
    """Token -> id of a store's tokenizer (tokenizer.json's model vocab plus added tokens), if it has one."""
    path = store / TOKENIZER_DIR / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    if not isinstance(vocab, dict):
        return None
    for tok in data.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
    return vocab


def check_same_vocab(draft: Path, target: Path | None) -> None:
    """A same-tokenizer draft must map every target token to the same id."""
    if target is None:
        return
    a, b = _vocab_of(target), _vocab_of(draft)
    if a is None or b is None:
        return  # a tokenizer without a vocab table (tiktoken): the vocabulary size check stands alone
    diff = [t for t, i in a.items() if b.get(t) != i]
    if diff:
        raise DraftError(
            f"{draft}: its tokenizer gives {len(diff)} of the target's {len(a)} tokens other ids "
            f"(e.g. {diff[0]!r}); a store draft must share the target's tokenizer"
        )


def _dspark_store(target_store: Path | None) -> bool:
    return target_store is not None and (target_store / "draft" / "dspark").is_dir()


def make_draft_source(
    spec: str,
    net: torch.nn.Module,
    *,
    target_store: Path | None = None,
    open_store: OpenStore | None = None,
    device: str | torch.device = "cpu",
    open_cross: OpenCross | None = None,
) -> tuple[DraftSource | None, str]:
    """(source, policy mode) for a `--draft` value; raises DraftError naming the fix."""
    spec = spec.strip()
    if spec.startswith("cross:"):
        return cross_source(spec, open_cross, device), "on"
    if spec == "off":
        return None, "off"
    if spec == "auto":
        return auto_source(net, target_store), "auto"
    if spec == "ngram":
        return NgramSource(), "on"
    if spec == "self" or spec.startswith("self:"):
        layers = spec.partition(":")[2]
        if layers and not layers.isdigit():
            raise DraftError(f"--draft self:N takes a layer count (got {spec!r})")
        return SelfDraftSource(net, int(layers) if layers else None), "on"
    if spec == "dspark":
        if target_store is None:
            raise DraftError(
                "--draft dspark needs the target's store (its DSpark checkpoint lives in <store>/draft/dspark)"
            )
        from deltafind.engine.draft.dspark import DSparkSource

        return DSparkSource.open(target_store, net), "on"
    path = Path(spec).expanduser()
    if not path.exists():
        raise DraftError(
            f"--draft {spec!r}: expected off, auto, self[:N], ngram, dspark, cross:STORE[,WIDE] "
            "or the path of a draft store"
        )
    return store_source(path, net, target_store, open_store, device), "on"


def store_source(
    path: Path,
    net: torch.nn.Module,
    target_store: Path | None,
    open_store: OpenStore | None,
    device: str | torch.device = "cpu",
) -> StoreDraftSource:
    if open_store is None:
        raise DraftError("a store draft needs a way to open stores (internal: pass open_store)")
    admit_store(path, device)
    check_same_vocab(path, target_store)
    draft_net = open_store(path)
    return StoreDraftSource(draft_net, f"store:{path}", net.vocab_size)


def cross_source(
    spec: str, open_cross: OpenCross | None, device: str | torch.device = "cpu"
) -> DraftSource:
    """`cross:PROBE[,WIDE]`: docs/kimi-k3-drafting-io.md §7.7's cross-tokenizer draft (engine/draft/cross.py), raw completions only."""
    paths = [Path(p.strip()).expanduser() for p in spec.partition(":")[2].split(",") if p.strip()]
    if not 1 <= len(paths) <= 2:
        raise DraftError(
            f"--draft {spec!r}: cross: takes a draft store, or a probe and a wide one (cross:SMALL,LARGE)"
        )
    if open_cross is None:
        raise DraftError(
            f"--draft {spec!r}: cross-tokenizer drafts are for raw completions, and this caller cannot keep "
            "them off chat requests; use them with `deltafind run --prompt` (no --chat) or the Python API"
        )
    free = available_bytes(device)
    for p in paths:  # both spines must fit together
        free -= admit_store(p, device, free)
    return open_cross(paths)


def auto_source(net: torch.nn.Module, target_store: Path | None) -> DraftSource | None:
    """The source `auto` uses: DSpark where the store has one (Kimi K3), else the n-gram draft.

    The layer-skip self-draft is not chosen by auto: on the demo model it never paid
    (tests/bench/RESULTS.md, "Speculative decoding"); name it with --draft self.
    """
    if _dspark_store(target_store):
        try:
            from deltafind.engine.draft.dspark import DSparkSource

            return DSparkSource.open(target_store, net)  # type: ignore[arg-type]
        except DraftError as e:
            log.warning("draft_unavailable", source="dspark", error=str(e), fallback="ngram")
    return NgramSource()


def source_from_settings(
    settings: Any,
    net: torch.nn.Module,
    *,
    target_store: Path | None = None,
    open_store: OpenStore | None = None,
    device: str | torch.device = "cpu",
    open_cross: OpenCross | None = None,
) -> tuple[DraftSource | None, PolicyOptions]:
    """The `[draft]` section (mode, source, max_width) as a source and its policy.

    mode "on" fails (DraftError) when the source cannot be built; "auto" logs and runs without.
    """
    mode, source_spec = settings.mode, settings.source
    if mode == "off":
        return None, PolicyOptions(mode="auto", max_width=settings.max_width)
    try:
        source, _ = make_draft_source(
            source_spec,
            net,
            target_store=target_store,
            open_store=open_store,
            device=device,
            open_cross=open_cross,
        )
    except DraftError as e:
        if mode == "on":
            raise
        log.warning("draft_unavailable", source=source_spec, error=str(e), fallback="target_only")
        source = None
    return source, PolicyOptions(mode=mode, max_width=settings.max_width)
