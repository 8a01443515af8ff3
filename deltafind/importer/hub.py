"""Checkpoints from a Hugging Face-compatible hub: `setup --from ORG/NAME[:QUANT][@REVISION]`.

`resolve_repo` pins the revision to a commit and lists the files with the sizes
and hashes the hub publishes; `HubRepo.download` fetches one file through
huggingface_hub (its cache, resume, HF_ENDPOINT/HF_TOKEN/HF_HUB_OFFLINE,
progress) and verifies it. `HubSource` is the `Source` setup imports from:
tensor metadata from the shards' headers (fetched by range), tensors from
shards downloaded one at a time, or by range for a streaming install. From a
GGUF repository (`:QUANT`, picked by importer/hub_gguf.py) `fetch_gguf` downloads whole files,
or, streaming, importer/hub_gguf.py's `GGUFHubSource` reads them by range.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.hub_gguf import GGUFHubSource, is_model_gguf, local_gguf, pick_quant
from deltafind.importer.sources import Source, import_names, tensor_info
from deltafind.importer.spine_writer import write_safetensors
from deltafind.store.remote import RangeClient, RemoteTensor, parse_header, read_shard_header

HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?(?:@(?P<rev>[\w./-]+))?$"
)
INDEX = "model.safetensors.index.json"
STAGING_DIR = ".hub-staging"  # spine tensors of shards already freed by --delete-source
HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class HubFile:
    size: int | None
    sha256: str | None  # LFS files: sha256 of the content (the hub's X-Linked-Etag)
    blob_id: str | None  # git blob sha1 (small files kept in git)


@dataclass
class HubRepo:
    """One repository pinned at a commit, with the metadata of its files."""

    repo_id: str
    commit: str
    files: dict[str, HubFile]
    endpoint: str
    progress: bool = True
    verified: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"hf:{self.repo_id}@{self.commit}"

    def shard_names(self) -> list[str]:
        if INDEX in self.files:
            index = json.loads(self.download(INDEX).read_text())
            names = sorted(set(index.get("weight_map", {}).values()))
        else:
            names = sorted(f for f in self.files if f.endswith(".safetensors") and "/" not in f)
        if not names:
            raise StoreError(
                f"{self.label}: no *.safetensors files at the top of the repository (pytorch .bin checkpoints are not supported)"
            )
        missing = [n for n in names if n not in self.files]
        if missing:
            raise StoreError(
                f"{self.label}: {INDEX} lists {missing[:3]}, which the repository does not have"
            )
        return names

    def download(self, filename: str) -> Path:
        """The file in the local HF cache: downloaded (resuming a partial one), verified."""
        if filename in self.verified and (path := self.cached(filename)) is not None:
            return path
        meta = self.files.get(filename)
        fetch = (
            self._download_lfs
            if meta is not None and meta.sha256 and meta.size is not None
            else self._download_small
        )
        path = fetch(filename)
        problem = self._check(filename, path)
        if problem:  # a corrupt or stale copy: drop it and fetch it once more from the start
            print(f"deltafind: {filename}: {problem}; downloading it again", file=sys.stderr)
            _drop_cached(path)
            path = fetch(filename)
            problem = self._check(filename, path)
            if problem:
                _drop_cached(path)
                raise StoreError(
                    f"{self.label} {filename}: {problem} twice; the hub or a proxy serves corrupt bytes — try again later or another HF_ENDPOINT"
                )
        self.verified.add(filename)
        return path

    def _download_small(self, filename: str) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, filename, revision=self.commit))

    def _download_lfs(self, filename: str) -> Path:
        """A weight shard into the HF cache's layout (blobs/<sha256>, snapshots/<commit>/<file>), through a
        partial file that survives a killed setup: huggingface_hub restarts such a file from byte 0."""
        meta = self.files[filename]
        assert meta.sha256 and meta.size is not None
        repo_dir = _cache_folder(self.repo_id)
        blob, link = (
            repo_dir / "blobs" / meta.sha256,
            repo_dir / "snapshots" / self.commit / filename,
        )
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            part = blob.with_name(blob.name + ".deltafind-partial")
            RangeClient(self.repo_id, self.commit, self.endpoint).download(
                filename, part, meta.size, self.progress
            )
            os.replace(part, blob)
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        return link

    def _check(self, filename: str, path: Path) -> str | None:
        meta = self.files.get(filename)
        if meta is None:
            return None
        size = path.stat().st_size
        if meta.size is not None and size != meta.size:
            return f"size {size}, the hub says {meta.size}"
        if meta.sha256:
            got = _file_digest(path, hashlib.sha256())
            return (
                None
                if got == meta.sha256
                else f"sha256 {got[:16]}…, the hub says {meta.sha256[:16]}…"
            )
        if meta.blob_id:
            got = _file_digest(path, hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False))
            return (
                None
                if got == meta.blob_id
                else f"git blob id {got[:12]}…, the hub says {meta.blob_id[:12]}…"
            )
        return None

    def drop(self, filename: str) -> None:
        """Free a downloaded file (--delete-source) from the cache."""
        if (path := self.cached(filename)) is not None:
            _drop_cached(path)

    def cached(self, filename: str) -> Path | None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, filename, revision=self.commit)
        return Path(cached) if isinstance(cached, str) else None


def _file_digest(path: Path, h: Any) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_local_header(path: Path, filename: str) -> tuple[int, dict[str, RemoteTensor]]:
    """The safetensors header of a local copy of `filename`, as `read_shard_header` reads a remote one."""
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        return parse_header(filename, hlen, f.read(hlen))


def _cache_folder(repo_id: str) -> Path:
    """The repository's folder in the HF cache (blobs/, snapshots/, refs/)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _drop_cached(path: Path) -> None:
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def parse_hub_ref(text: str) -> tuple[str, str | None, str | None] | None:
    """`ORG/NAME[:QUANT][@REVISION]` -> (repo id, revision, GGUF quant); None when `text` does not look like one."""
    m = HUB_ID.match(text)
    return None if m is None else (m["repo"], m["rev"], m["quant"])


def resolve_repo(repo_id: str, revision: str | None) -> HubRepo:
    """Pin `revision` (default main) to its commit and list the files with their sizes and hashes."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision or 'main'} on {constants.ENDPOINT}"
    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError as e:
        raise StoreError(
            f"{where}: the repository is gated; accept its terms on the hub and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise StoreError(
            f"{where}: no such repository, or it is private (set HF_TOKEN to a token that can read it)"
        ) from e
    except RevisionNotFoundError as e:
        raise StoreError(f"{where}: no such revision (give a branch, tag or commit after @)") from e
    except HfHubHTTPError as e:
        raise StoreError(f"{where}: the hub answered {e}") from e
    except OSError as e:  # connection refused, DNS, TLS: httpx's errors are OSErrors underneath
        raise StoreError(
            f"{where}: cannot reach the hub ({e}); check the network or HF_ENDPOINT"
        ) from e
    files = {
        s.rfilename: HubFile(s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    }
    _remember_ref(repo_id, revision or "main", str(info.sha))
    return HubRepo(repo_id, str(info.sha), files, constants.ENDPOINT)


def _remember_ref(repo_id: str, revision: str, commit: str) -> None:
    """Record revision -> commit in the HF cache, as huggingface_hub does, so HF_HUB_OFFLINE finds the
    files we download by commit (pinned, so a branch moving mid-download cannot mix two commits)."""
    if revision == commit:
        return
    ref = _cache_folder(repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def open_checkpoint(
    spec: str,
    store_dir: Path,
    streaming: bool = False,
    delete_source: bool = False,
    progress: bool = True,
) -> Path | Source:
    """`--from` as given: a local folder/GGUF path (as before), or a hub repo id; a GGUF repository
    (`:QUANT` given, or GGUF files and no *.safetensors) gives the local path of the quant's first shard."""
    path = Path(spec).expanduser()
    ref = None if path.exists() else parse_hub_ref(spec)
    if ref is None:
        if streaming or delete_source:
            raise StoreError(
                f"{spec}: --streaming and --delete-source take a hub repo id (ORG/NAME[@REVISION]), not a local path"
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
            return GGUFHubSource(repo, pick_quant(repo.files, quant, repo.label), store_dir)
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
    the store and the shard is freed once its experts are read, so peak disk
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
        self.data_start: dict[str, int] = {}
        for f in self.shards:
            self.data_start[f], tensors = self._header(f)
            raw.update(tensors)
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

    def _header(self, filename: str) -> tuple[int, dict[str, RemoteTensor]]:
        local = self.repo.cached(filename)
        return (
            read_shard_header(self.client, filename)
            if local is None
            else read_local_header(local, filename)
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(
            f"{self.repo.label}\n".encode() + json.dumps(self.config, sort_keys=True).encode()
        ).hexdigest()

    def begin_import(self, spine: list[str]) -> None:
        self._spine = set(spine)
        for name, t in self.remote.items():
            if name not in self._spine:
                self._pending.setdefault(t.file, set()).add(name)
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
        out = self._shard(t.file).get_tensor(t.name)
        pending = self._pending.get(t.file)
        if pending is not None:
            pending.discard(name)
            if not pending and self.delete_source:
                self._free(t.file)
        return out

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
        from safetensors import safe_open

        names = {
            n: self.tensors[n]
            for n in self._spine
            if self.remote[n].file == filename and n not in self._staged
        }
        if not names:
            return
        self.staging.mkdir(exist_ok=True)
        dest = self.staging / (filename.replace("/", "_") + ".part.safetensors")
        tmp = dest.with_suffix(".tmp")
        write_safetensors(tmp, names, lambda n: h.get_tensor(self.remote[n].name))
        os.replace(tmp, dest)
        staged = safe_open(str(dest), "pt")
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
