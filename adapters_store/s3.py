"""An S3-compatible bucket as the adapter store (`--adapter-store s3://BUCKET/PREFIX`), through boto3.

Endpoint, credentials and region come from the standard AWS settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or a profile), as for the aws CLI. A store that cannot be reached or
refuses the credentials raises StoreUnavailable naming the store and why; after such a failure every call fails at
once for DOWN_S, so a serving thread that needs the store does not wait out the same timeouts again.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from .objects import ObjectStore, StoreUnavailable

T = TypeVar("T")

DOWN_S = 2.0
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
_EXISTS = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})


def _code(e: ClientError) -> str:
    """The S3 error code of a failed call ("NoSuchKey", "PreconditionFailed"...), "" when it has none."""
    return str(e.response.get("Error", {}).get("Code", ""))


_REFUSED = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidClientTokenId",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "403",
    }
)


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET/PREFIX; the prefix '' or ending in '/'."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"not an s3 URL: {url!r} (s3://BUCKET/PREFIX)")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def make_client() -> Any:
    """A client from the standard AWS settings; timeouts short enough that an unreachable store fails in seconds."""
    config = Config(
        connect_timeout=3,
        read_timeout=60,
        retries={"mode": "standard", "max_attempts": 2},
        s3={"addressing_style": "path"},  # what MinIO, SeaweedFS and Ceph serve; AWS serves it too
    )
    return boto3.session.Session().client("s3", config=config)


class S3Objects(ObjectStore):
    remote = True

    def __init__(self, bucket: str, prefix: str = "", client: Any = None) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.client = client if client is not None else make_client()
        self.endpoint = str(self.client.meta.endpoint_url)
        self._down_until, self._down_why = 0.0, ""
        self._mu = threading.Lock()

    @classmethod
    def from_url(cls, url: str, client: Any = None) -> S3Objects:
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, client)

    def cache_name(self) -> str:
        return hashlib.sha256(f"{self.endpoint} {self.url}".encode()).hexdigest()[:16]

    def _call(self, fn: Callable[[], T]) -> T:
        with self._mu:
            if time.monotonic() < self._down_until:
                raise StoreUnavailable(self._down_why)
        try:
            return fn()
        except ClientError as e:
            code = _code(e)
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code in _REFUSED or status == 403:
                self._trip(
                    f"the adapter store {self.url} refused the credentials ({code or status}): check "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                )
            if code == "NoSuchBucket":
                self._trip(f"the adapter store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}")
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
                self._trip(f"the adapter store {self.url} is unavailable ({code or status}) at {self.endpoint}")
            raise
        except NoCredentialsError:
            self._trip(
                f"the adapter store {self.url}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )
        except BotoCoreError as e:  # connection refused or timed out, a body cut off
            self._trip(f"the adapter store {self.url} is unreachable at {self.endpoint}: {e}")

    def _trip(self, why: str) -> NoReturn:
        with self._mu:
            self._down_until, self._down_why = time.monotonic() + DOWN_S, why
        raise StoreUnavailable(why)

    def check(self) -> None:
        try:
            self._call(lambda: self.client.head_bucket(Bucket=self.bucket))
        except ClientError as e:
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if status == 404:
                raise StoreUnavailable(
                    f"the adapter store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}"
                ) from None
            raise StoreUnavailable(f"the adapter store {self.url}: {e}") from None

    def get(self, key: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return bytes(self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read())
            except ClientError as e:
                if _code(e) in _MISSING:
                    return None
                raise

        return self._call(read)

    def put(self, key: str, data: bytes) -> None:
        self._call(lambda: self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data))

    def put_new(self, key: str, data: bytes) -> bool:
        def create() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if _code(e) in _EXISTS:
                    return False
                raise

        return self._call(create)

    def upload(self, key: str, path: Path) -> None:
        def send() -> None:
            with path.open("rb") as fh:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=fh)

        self._call(send)

    def download(self, key: str, dest: Path) -> None:
        def fetch() -> None:
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"]
            except ClientError as e:
                if _code(e) in _MISSING:
                    raise FileNotFoundError(f"{self.url}{key}: no such object") from None
                raise
            with dest.open("wb") as fh:
                shutil.copyfileobj(body, fh, 1 << 20)

        self._call(fetch)

    def list(self, prefix: str) -> list[str]:
        def pages() -> list[str]:
            keys = []
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            ):
                keys += [str(o["Key"])[len(self.prefix) :] for o in page.get("Contents", [])]
            return keys

        return self._call(pages)

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix` with its size in bytes (what `list` names, read before any is fetched)."""

        def pages() -> dict[str, int]:
            found: dict[str, int] = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            ):
                found |= {str(o["Key"])[len(self.prefix) :]: int(o["Size"]) for o in page.get("Contents", [])}
            return found

        return self._call(pages)

    def delete(self, key: str) -> None:
        self._call(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key))
