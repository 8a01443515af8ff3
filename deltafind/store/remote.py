"""Byte ranges of a hub repository's files over HTTP: the one way deltafind reads a remote shard.

`RangeClient.get` fetches `[start, end)` of a file at a pinned commit through
huggingface_hub's session (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, proxies),
checks the answer is exactly that range, and retries transient failures with
exponential backoff. `read_shard_header` reads a safetensors header by range.
Knows HTTP and the safetensors layout; never the store's records or models.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from deltafind.errors import StoreError

RETRIES = 5
BACKOFF_S = 0.5  # first wait; doubles per retry, capped at MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0
TIMEOUT_S = 60.0
PERMANENT = (401, 403, 404, 416)  # retrying cannot fix these


class RemoteError(StoreError):
    """A range could not be fetched (after retries); the message names the URL and the range."""


@dataclass(frozen=True)
class RemoteTensor:
    file: str
    name: str  # as in the shard's header
    dtype: str  # safetensors dtype code, e.g. BF16, U8
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


class RangeClient:
    """Ranges of files of `repo_id` at `commit` (a pinned revision: the bytes never change under us)."""

    def __init__(
        self,
        repo_id: str,
        commit: str,
        endpoint: str | None = None,
        retries: int = RETRIES,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        from huggingface_hub import constants

        self.repo_id, self.commit = repo_id, commit
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, filename, revision=self.commit, endpoint=self.endpoint)

    def get(self, filename: str, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of `filename`; raises `RemoteError` naming the URL once retries are spent."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = self.url(filename)
        where = f"{url} bytes {start}-{end - 1}"
        headers = {
            **build_hf_headers(),
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
        }
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                r = get_session().get(
                    url, headers=headers, follow_redirects=True, timeout=TIMEOUT_S
                )
                hf_raise_for_status(r)
                return _check_range(r, start, end)
            except OfflineModeIsEnabled as e:
                raise RemoteError(
                    f"{where}: HF_HUB_OFFLINE is set, so it cannot be fetched; unset it, or complete the store first with `deltafind setup --fill`"
                ) from e
            except HfHubHTTPError as e:
                code = e.response.status_code if e.response is not None else None
                if code in PERMANENT:
                    hint = (
                        " (set HF_TOKEN to a token that can read this repository)"
                        if code in (401, 403)
                        else ""
                    )
                    raise RemoteError(f"{where}: HTTP {code}{hint}") from e
                last = e
            except (httpx2.HTTPError, _BadRange) as e:
                last = e
        raise RemoteError(
            f"{where}: {type(last).__name__}: {last} (gave up after {self.retries + 1} tries)"
        ) from last

    def download(self, filename: str, dest: Path, size: int, progress: bool = True) -> None:
        """Append the rest of `filename` to `dest` until it holds `size` bytes: a rerun after a kill,
        or a retry after a dropped connection, asks only for what `dest` lacks."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
        from tqdm import tqdm

        url = self.url(filename)
        have = dest.stat().st_size if dest.exists() else 0
        if have > size:  # not a prefix of this file
            dest.unlink()
            have = 0
        last: Exception | None = None
        failures = 0
        with tqdm(
            total=size,
            initial=have,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=filename,
            disable=not progress,
            mininterval=1.0,
        ) as bar:
            while have < size:
                if failures > self.retries:
                    raise RemoteError(
                        f"{url}: {type(last).__name__}: {last} (gave up after {failures} tries; run setup again to resume from byte {have})"
                    ) from last
                if failures:
                    time.sleep(min(self.backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S))
                headers = {
                    **build_hf_headers(),
                    "Range": f"bytes={have}-",
                    "Accept-Encoding": "identity",
                }
                try:
                    with get_session().stream(
                        "GET", url, headers=headers, follow_redirects=True, timeout=TIMEOUT_S
                    ) as r:
                        hf_raise_for_status(r)
                        if r.status_code != 206 or not r.headers.get(
                            "Content-Range", ""
                        ).startswith(f"bytes {have}-"):
                            raise _BadRange(
                                f"HTTP {r.status_code} with Content-Range {r.headers.get('Content-Range')!r}, asked for bytes {have}-"
                            )
                        with open(dest, "ab") as f:
                            for chunk in r.iter_bytes():
                                f.write(chunk)
                                have += len(chunk)
                                bar.update(len(chunk))
                                failures = 0  # progress: the retry budget is for a stuck transfer
                            f.flush()
                            os.fsync(f.fileno())
                except HfHubHTTPError as e:
                    code = e.response.status_code if e.response is not None else None
                    if code in PERMANENT:
                        raise RemoteError(f"{url}: HTTP {code}") from e
                    last, failures = e, failures + 1
                except (httpx2.HTTPError, _BadRange) as e:
                    last, failures = e, failures + 1
                have = dest.stat().st_size
        if have != size:
            raise RemoteError(f"{url}: {have} bytes received, the hub lists {size}")


class _BadRange(Exception):
    """The server answered, but not with exactly the bytes asked for (retried)."""


def _check_range(r: object, start: int, end: int) -> bytes:
    status, headers, body = r.status_code, r.headers, r.content  # type: ignore[attr-defined]
    if status != 206:
        raise _BadRange(
            f"HTTP {status} instead of 206 Partial Content (the server ignored the Range header)"
        )
    got = headers.get("Content-Range", "")
    if not got.startswith(f"bytes {start}-{end - 1}/"):
        raise _BadRange(f"Content-Range {got!r}, asked for bytes {start}-{end - 1}")
    if len(body) != end - start:
        raise _BadRange(f"{len(body)} bytes received, {end - start} expected")
    return body


def read_shard_header(client: RangeClient, filename: str) -> tuple[int, dict[str, RemoteTensor]]:
    """The safetensors header of a remote shard: (data start, tensors by header name)."""
    hlen = int.from_bytes(client.get(filename, 0, 8), "little")
    if not 2 <= hlen <= 1 << 30:
        raise StoreError(f"{client.url(filename)}: not a safetensors file (header length {hlen})")
    return parse_header(filename, hlen, client.get(filename, 8, 8 + hlen))


def parse_header(filename: str, hlen: int, raw: bytes) -> tuple[int, dict[str, RemoteTensor]]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{filename}: unreadable safetensors header ({e})") from e
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = RemoteTensor(
            filename, name, meta["dtype"], tuple(meta["shape"]), base + a, base + b
        )
    return base, out
