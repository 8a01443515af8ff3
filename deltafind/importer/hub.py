"""Checkpoints from a Hugging Face-compatible hub: `setup --from ORG/NAME[:QUANT][@REVISION]`.

`open_checkpoint` opens what `--from` names (a local one: importer/checkpoint.py, or
importer/gguf_delete.py with --delete-source); for a hub it pins the repository to a commit
(importer/hub_repo.py, which also downloads and verifies its files). `HubSource` is the
`Source` setup imports from: tensor metadata from the shards' headers (fetched by range),
tensors from shards downloaded one at a time, or by range for a streaming install. From a GGUF
repository (`:QUANT`, picked by importer/hub_gguf.py) `fetch_gguf` downloads whole files, or,
streaming, importer/hub_gguf.py's `GGUFHubSource` reads them by range.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.gguf_delete import GGUFDeletingSource, has_kept_copy
from deltafind.importer.gguf_source import GGUFOptions
from deltafind.importer.hub_gguf import GGUFHubSource, is_model_gguf, local_gguf, pick_quant
from deltafind.importer.hub_repo import HubRepo, parse_hub_ref, resolve_repo
from deltafind.importer.sources import Source, import_names, tensor_info
from deltafind.importer.spine_writer import stage_tensors
from deltafind.store.remote import RangeClient, RemoteTensor, parse_header, read_shard_header

STAGING_DIR = ".hub-staging"  # spine tensors of shards already freed by --delete-source


def read_local_header(path: Path, filename: str) -> tuple[int, dict[str, RemoteTensor]]:
    """The safetensors header of a local copy of `filename`, as `read_shard_header` reads a remote one."""
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        return parse_header(filename, hlen, f.read(hlen))


def open_checkpoint(
    spec: str,
    store_dir: Path,
    streaming: bool = False,
    delete_source: bool = False,
    progress: bool = True,
    options: GGUFOptions | None = None,
) -> Source:
    """The `Source` setup imports `--from` from, local or on a hub; `options` (importer/gguf_source.py)
    hold for every kind of GGUF source alike."""
    got = locate_checkpoint(spec, store_dir, streaming, delete_source, progress, options)
    if isinstance(got, Source):
        return got
    if delete_source:  # a local .gguf (locate_checkpoint refuses a folder)
        return GGUFDeletingSource(got.resolve(), store_dir, options)
    return open_source(got.resolve(), options)


def locate_checkpoint(
    spec: str,
    store_dir: Path,
    streaming: bool = False,
    delete_source: bool = False,
    progress: bool = True,
    options: GGUFOptions | None = None,
) -> Path | Source:
    """`--from` as given: a local folder/GGUF path (as before), or a hub repo id; a GGUF repository
    (`:QUANT` given, or GGUF files and no *.safetensors) gives the local path of the quant's first shard."""
    path = Path(spec).expanduser()
    # a shard an interrupted --delete-source setup deleted is still local
    local = path.exists() or (delete_source and has_kept_copy(path, store_dir))
    ref = None if local else parse_hub_ref(spec)
    if ref is None:
        if streaming:
            raise StoreError(
                f"{spec}: --streaming takes a hub repo id (ORG/NAME[@REVISION]), not a local path"
            )
        if delete_source and (path.is_dir() or path.suffix != ".gguf"):
            raise StoreError(
                f"{spec}: --delete-source takes a hub repo id (ORG/NAME[@REVISION]) or a local .gguf file "
                "(any shard of a split one), not a local folder"
            )
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()

    repo_id, revision, quant = ref
    if constants.is_offline_mode():
        if streaming:
            raise StoreError(
                f"{spec}: a streaming install fetches experts from the hub, but HF_HUB_OFFLINE is set; unset it"
            )
        try:  # everything must already be in the HF cache
            folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
        except LocalEntryNotFoundError as e:
            raise StoreError(
                f"{spec}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it"
            ) from e
        if quant or not any(folder.glob("*.safetensors")):
            return local_gguf(
                folder, quant, f"{spec} in the Hugging Face cache (HF_HUB_OFFLINE is set)"
            )
        return open_source(folder)
    repo = resolve_repo(repo_id, revision)
    repo.progress = progress
    if quant or (
        not any(f.endswith(".safetensors") for f in repo.files)
        and any(is_model_gguf(f) for f in repo.files)
    ):
        if delete_source:  # the GGUF import reads whole local files
            raise StoreError(
                f"{spec}: --delete-source is not supported for GGUF repositories yet; "
                "drop it to download the quant's files into the HF cache, or use --streaming"
            )
        if streaming:
            return GGUFHubSource(
                repo, pick_quant(repo.files, quant, repo.label), store_dir, options
            )
        return fetch_gguf(repo, quant)
    return HubSource(repo, store_dir, streaming=streaming, delete_source=delete_source)


def fetch_gguf(repo: HubRepo, tag: str | None) -> Path:
    """Download (resuming) and verify every shard of the quant; the local path of the first one."""
    names = pick_quant(repo.files, tag, repo.label)
    size = sum(repo.files[n].size or 0 for n in names)
    if repo.progress:
        print(
            f"deltafind: {repo.label}: {len(names)} GGUF file(s), {size / 2**30:.2f} GiB: {', '.join(names)}",
            file=sys.stderr,
        )
    paths = [repo.download(n) for n in names]
    return paths[0]


class HubSource(Source):
    """A hub checkpoint as a setup `Source`.

    Download mode fetches each shard when setup first needs one of its tensors;
    with `delete_source` a shard's spine tensors are copied to a staging file in
    the store and the shard is freed once its experts are journaled, so peak disk
    stays near the store's size. Streaming mode reads each tensor by range.
    """

    def __init__(
        self, repo: HubRepo, store_dir: Path, streaming: bool = False, delete_source: bool = False
    ) -> None:
        self.repo, self.streaming, self.delete_source = repo, streaming, delete_source
        self.client = RangeClient(repo.repo_id, repo.commit, repo.endpoint)
        self.path = Path(repo.label)
        self.config = json.loads(repo.download("config.json").read_text())
        self.shards = repo.shard_names()
        raw: dict[str, RemoteTensor] = {}
        for f in self.shards:
            raw.update(self._header(f))
        self.remote = {name: raw[orig] for orig, name in import_names(self.config, raw).items()}
        self.tensors = {
            name: tensor_info(f"{repo.label} {t.file}", t.name, t.dtype, t.shape)
            for name, t in self.remote.items()
        }
        self.staging = Path(store_dir) / STAGING_DIR
        self._handles: dict[str, Any] = {}
        self._staged: dict[str, Any] = {}  # spine tensor -> handle of its staging file
        self._pending: dict[str, set[str]] = {}  # shard -> tensors setup has yet to read from it
        self._ahead: dict[str, Future[Path]] = {}  # the next shard, downloading in the background
        self._spine: set[str] = set()

    def _header(self, filename: str) -> dict[str, RemoteTensor]:
        local = self.repo.cached(filename)
        return (
            read_shard_header(self.client, filename)
            if local is None
            else read_local_header(local, filename)
        )[1]

    def fingerprint(self) -> str:
        return hashlib.sha256(
            f"{self.repo.label}\n".encode() + json.dumps(self.config, sort_keys=True).encode()
        ).hexdigest()

    def begin_import(self, spine: list[str], records: list[str]) -> None:
        self._spine = set(spine)
        for name in records:
            self._pending.setdefault(self.remote[name].file, set()).add(name)
        if self.delete_source and self.staging.is_dir():  # a resumed setup: shards freed last time
            from safetensors import safe_open

            for f in sorted(self.staging.glob("*.safetensors")):
                h = safe_open(str(f), "pt")
                self._staged.update(dict.fromkeys(h.keys(), h))

    def load(self, name: str) -> torch.Tensor:
        t = self.remote[name]
        if name in self._staged:
            return self._staged[name].get_tensor(name)
        if self.streaming:
            data = bytearray(self.client.get(t.file, t.start, t.end))
            dtype = self.tensors[name].dtype
            return (
                torch.frombuffer(data, dtype=dtype).reshape(t.shape)
                if data
                else torch.empty(t.shape, dtype=dtype)
            )
        return self._shard(t.file).get_tensor(t.name)

    def durable(self, names: list[str]) -> None:
        """A shard leaves the HF cache once every record made from it is journaled (not when last read:
        a setup killed in between would download it again)."""
        for name in names:
            pending = self._pending.get(file := self.remote[name].file)
            if pending:
                pending.discard(name)
                if not pending and self.delete_source:
                    self._free(file)

    def _shard(self, filename: str) -> Any:
        from safetensors import safe_open

        if filename not in self._handles:
            ahead = self._ahead.pop(filename, None)
            path = ahead.result() if ahead is not None else self.repo.download(filename)
            self._handles[filename] = h = safe_open(str(path), "pt")
            if self.delete_source:
                self._stage(filename, h)
            self._download_next(filename)
        return self._handles[filename]

    def _download_next(self, current: str) -> None:
        """Download the next shard setup will need while this one is imported (one at a time)."""
        if self._ahead:
            return
        for name in self.shards[self.shards.index(current) + 1 :]:
            if name not in self._handles and self._pending.get(name):
                fut: Future[Path] = Future()

                def run(name: str = name, fut: Future[Path] = fut) -> None:
                    try:
                        fut.set_result(self.repo.download(name))
                    except BaseException as e:  # handed to the import when it needs this shard
                        fut.set_exception(e)

                # A daemon thread: a failed or interrupted setup exits at once; the partial file stays for the rerun.
                threading.Thread(target=run, daemon=True, name="hub-download").start()
                self._ahead[name] = fut
                return

    def _stage(self, filename: str, h: Any) -> None:
        """Copy the shard's spine tensors into the store's staging folder, so the shard can go."""
        names = {
            n: self.tensors[n]
            for n in self._spine
            if self.remote[n].file == filename and n not in self._staged
        }
        if not names:
            return
        self.staging.mkdir(exist_ok=True)
        dest = self.staging / (filename.replace("/", "_") + ".part.safetensors")
        staged = stage_tensors(dest, names, lambda n: h.get_tensor(self.remote[n].name))
        self._staged.update(dict.fromkeys(names, staged))

    def _free(self, filename: str) -> None:
        self._handles.pop(filename, None)
        self.repo.drop(filename)

    def end_import(self) -> None:
        self._handles.clear()
        self._staged.clear()
        if self.delete_source:
            for f in self.shards:
                self.repo.drop(f)
        if self.staging.is_dir():
            shutil.rmtree(self.staging)

    def write_tokenizer(self, dest: Path) -> list[str]:
        from deltafind.tokenizer import copy_tokenizer_files
        from deltafind.tokenizer.files import TOKENIZER_FILES

        folder = None
        for name in TOKENIZER_FILES:
            if name in self.repo.files:
                folder = self.repo.download(name).parent
        return copy_tokenizer_files(folder or self.repo.download("config.json").parent, dest)
