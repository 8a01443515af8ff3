"""A hub repository pinned at a commit: `ORG/NAME[:QUANT][@REVISION]` parsed and resolved.

`resolve_repo` pins the revision to a commit and lists the files with the sizes
and hashes the hub publishes; `HubRepo.download` fetches one file through
huggingface_hub (its cache, resume, HF_ENDPOINT/HF_TOKEN/HF_HUB_OFFLINE,
progress) and verifies it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from deltafind.errors import StoreError
from deltafind.store.manifest import file_digest
from deltafind.store.remote import RangeClient

HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?(?:@(?P<rev>[\w./-]+))?$"
)
INDEX = "model.safetensors.index.json"


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
            got = file_digest(path, hashlib.sha256())
            return (
                None
                if got == meta.sha256
                else f"sha256 {got[:16]}…, the hub says {meta.sha256[:16]}…"
            )
        if meta.blob_id:
            got = file_digest(path, hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False))
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
