"""The object-store interface and its two backends: a local directory and S3 (or any S3-compatible server).

Every write of one object is atomic: a reader sees the old bytes or the new bytes, never a mix. Multi-object
artifacts (checkpoints, partial pools) are committed one level up by writing their manifest last.
Backend errors are translated here into the project's tree (laminar.errors).
"""

from __future__ import annotations

import abc
import hashlib
import io
import os
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil

from laminar.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from laminar.private import private_dir

MiB = 1024 * 1024
_TMP_PREFIX = ".tmp-"
# A local store's temp file (LocalObjectStore.put) is named .tmp-<name>~<host>~<pid>~<random>: the writer. One left
# by a writer that died (killed mid-write) is removed by the next list() that walks its directory; one whose writer
# runs on this host is a write in progress and kept however old; one whose writer cannot be checked from here
# (another host sharing the directory, or a name from before the writer was recorded) is removed once its last
# change is older than this.
STALE_TMP_S = 15 * 60.0
_HOST = socket.gethostname().replace("~", "-").replace("/", "-")


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`; the checksum every manifest and ref carries."""
    return hashlib.sha256(data).hexdigest()


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"object key must be a non-empty relative path not ending in '/', got {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"object key {key!r} has an empty, '.' or '..' segment; build keys with laminar.storage.keys")
    if any(part.startswith(_TMP_PREFIX) for part in key.split("/")):
        raise ValueError(f"object key {key!r} has a segment starting with {_TMP_PREFIX!r}, which is reserved")
    return key


class ObjectStore(abc.ABC):
    """A flat key -> bytes store. Keys are '/'-separated relative paths built by laminar.storage.keys."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write `data` at `key` atomically, replacing any previous object."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes at `key`; ObjectNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is committed at `key`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with `prefix` (a plain string prefix, not a directory)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; deleting an absent key is not an error (same as S3)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of the object at `key`; ObjectNotFoundError if absent."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where this store points, for messages: "file:///path" or "s3://bucket/prefix at <endpoint>"."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class LocalObjectStore(ObjectStore):
    """Objects as files under `root`; writes go to a temp file in the same directory, then os.replace. Readers never
    see a temp file (list skips them, no key may name one); list() removes those of writers that died."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        try:
            private_dir(self.root)
        except OSError as exc:
            raise StoreError(f"cannot create local store root {self.root}: {exc}; "
                             f"pick a writable directory for the store url") from exc

    def describe(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_TMP_PREFIX}{path.name}~{_HOST}~{os.getpid()}~")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StoreError(f"writing {key} ({len(data)} bytes) to {self.describe()} failed: {exc}; "
                             f"check free space and permissions under {self.root}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFoundError(f"object {key} not found in {self.describe()}") from exc
        except OSError as exc:
            raise StoreError(f"reading {key} from {self.describe()} failed: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFoundError(f"object {key} not found in {self.describe()}")
        return path.stat().st_size

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"deleting {key} from {self.describe()} failed: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        # Walk only the deepest directory the prefix pins down: "runs/r1/check" -> runs/r1/.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base_dir.split("/")) if base_dir else self.root
        if not start.is_dir():
            return []
        keys = []
        now = time.time()
        for dirpath, _dirnames, filenames in os.walk(start):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_PREFIX):  # never an object; removed once its write is known to be dead
                    _remove_if_stale(Path(dirpath) / name, now)
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


def _remove_if_stale(tmp: Path, now: float, stale_s: float = STALE_TMP_S) -> bool:
    """Remove a local store's temp file whose write can no longer finish (module constants say when); True if it
    was removed. A temp file that is gone already (its write finished or failed meanwhile) is no error."""
    try:
        changed = tmp.stat().st_mtime
        parts = tmp.name.rsplit("~", 3)
        if len(parts) == 4 and parts[1] == _HOST and parts[2].isdigit():
            if _writes(int(parts[2]), changed):
                return False  # a write in progress, however long it takes
        elif now - changed < stale_s:
            return False  # a writer this host cannot see: only an old one is taken as dead
        tmp.unlink()
        return True
    except (FileNotFoundError, ValueError):
        return False
    except OSError:  # not ours to remove (permissions): a reader still ignores it
        return False


def _writes(pid: int, changed: float) -> bool:
    """Whether process `pid` of this host can be the writer of a temp file last changed at `changed`: it runs and
    started before that (a process started later was given the pid of a writer that died)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= changed + 1.0
    except psutil.Error:
        return False


def open_store(url: str, endpoint_url: str | None = None) -> ObjectStore:
    """Open a store from a url: "file:///abs/path", a plain path, or "s3://bucket/prefix".

    `endpoint_url` points S3 at a non-AWS server (MinIO, moto, the dev stack); ignored for local stores.
    """
    if "://" not in url:
        if not url:
            raise StoreError("store url is empty; use file:///abs/path, a plain path, or s3://bucket/prefix")
        return LocalObjectStore(url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"store url {url!r} names host {parsed.netloc!r}; a file url needs an absolute "
                             f"path with three slashes, e.g. file:///var/laminar/store")
        return LocalObjectStore(parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"store url {url!r} has no bucket; use s3://bucket or s3://bucket/prefix")
        return S3ObjectStore(parsed.netloc, prefix=parsed.path, endpoint_url=endpoint_url)
    raise StoreError(f"store url {url!r} has unsupported scheme {parsed.scheme!r}; "
                     f"use file:///abs/path, a plain path, or s3://bucket/prefix")


# -- S3 ----------------------------------------------------------------------------------------------

class S3ObjectStore(ObjectStore):
    """Objects in an S3 bucket under `prefix`, through boto3 with the standard AWS credential chain.

    Objects of at least `multipart_threshold_bytes` are uploaded in parts. Transient failures (connection
    errors, HTTP 5xx, throttling) are retried by botocore's adaptive retry mode, up to `max_attempts`
    attempts in all, with jittered exponential backoff (50 ms base, 1 s for throttling) and client-side
    rate limiting once the server throttles.
    """

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 region: str | None = None, max_attempts: int = 5, multipart_threshold_bytes: int = 8 * MiB,
                 connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket or "/" in bucket:
            raise StoreError(f"S3 bucket name {bucket!r} is invalid; give the bare bucket name, e.g. 'laminar'")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or None
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.max_attempts = max_attempts
        self.multipart_threshold_bytes = multipart_threshold_bytes
        # S3 rejects parts under 5 MiB (except the last), so parts are at least that big.
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold_bytes,
                                        multipart_chunksize=max(multipart_threshold_bytes, 5 * MiB))
        config = Config(
            retries={"total_max_attempts": max_attempts, "mode": "adaptive"},
            connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
            s3={"addressing_style": "path"} if self.endpoint_url else {},
        )
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)
        self._bucket_verified = False

    @property
    def endpoint(self) -> str:
        return self.endpoint_url or f"the AWS S3 endpoint of region {self.region}"

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"

    def _full(self, key: str) -> str:
        return self.prefix + _check_key(key)

    # -- operations ----------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        if len(data) >= self.multipart_threshold_bytes:
            self._call("put", key, lambda: self._client.upload_fileobj(
                io.BytesIO(data), self.bucket, full, Config=self._transfer))
        else:
            self._call("put", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data))

    def get(self, key: str) -> bytes:
        full = self._full(key)
        return self._call("get", key, lambda: self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full))

    def list(self, prefix: str = "") -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        contents = self._call("list", prefix or "<all>", lambda: [o for page in pages for o in page.get("Contents", [])])
        return sorted(obj["Key"][len(self.prefix):] for obj in contents)

    def _head(self, key: str) -> dict:
        full = self._full(key)
        return self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full))

    # -- error translation (botocore has already retried transient failures) --------------------------

    def _call(self, op: str, key: str, fn):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, op, key) from exc

    def _bucket_missing(self) -> bool:
        """Whether the bucket is absent; asked once to tell a missing key from a missing bucket on a HEAD 404."""
        from botocore.exceptions import ClientError

        if self._bucket_verified:
            return False
        try:
            self._call("head_bucket", "<bucket>", lambda: self._client.head_bucket(Bucket=self.bucket))
        except BucketNotFoundError:
            return True
        except StoreError as exc:
            if isinstance(exc.__cause__, ClientError):
                return False  # e.g. 403 on head_bucket: exists but not ours to probe; report the key
            raise
        self._bucket_verified = True
        return False

    def _translate(self, exc: Exception, op: str, key: str) -> StoreError:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, NoCredentialsError

        where = f"bucket {self.bucket!r} at endpoint {self.endpoint}"
        if isinstance(exc, NoCredentialsError):
            return StoreError(f"S3 {op} of {key} in {where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY (or an AWS profile) for the process")
        if isinstance(exc, ConnectionError | HTTPClientError):
            return StoreUnavailableError(
                f"S3 endpoint {self.endpoint} is unreachable for bucket {self.bucket!r} ({op} {key}) after up to "
                f"{self.max_attempts} attempt(s): {exc}; check LAMINAR_S3_ENDPOINT and that the S3 server is running")
        if not isinstance(exc, ClientError):
            return StoreError(f"S3 {op} of {key} in {where} failed: {exc}")
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        missing_bucket = BucketNotFoundError(
            f"S3 bucket {self.bucket!r} does not exist at endpoint {self.endpoint}; create it (e.g. "
            f"`aws s3 mb s3://{self.bucket}` against that endpoint) or point the store url at an existing bucket")
        if code == "NoSuchBucket" or (op == "head_bucket" and status == 404):
            return missing_bucket
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            if op == "head" and self._bucket_missing():
                return missing_bucket
            return ObjectNotFoundError(f"object {key} not found in {self.describe()}")
        if status >= 500 or status == 429:  # still failing after botocore's retries
            attempts = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
            return StoreUnavailableError(f"S3 {op} of {key} in {where} kept failing after {attempts} attempt(s): "
                                         f"{code} (HTTP {status}); the server is overloaded or failing, retry later")
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(f"S3 {op} of {key} in {where} was denied: {code} (HTTP {status}); check the AWS "
                              f"credentials and the bucket policy")
        return StoreError(f"S3 {op} of {key} in {where} failed: {code} (HTTP {status}): {exc}")
