"""A real S3 endpoint for the tests: moto's standalone server (``moto[server]``'s ``ThreadedMotoServer``, the
S3 API over HTTP, what s3fs's own tests use) on 127.0.0.1 on a free port, in a thread of the test process.

While it runs, the environment holds dummy credentials (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, the
names botocore reads first), a region, no profile or config file, and instance metadata disabled, so neither
boto3 nor s3fs looks anywhere but the environment and 127.0.0.1. Clients reach the server through
``endpoint_url``: boto3's argument of that name, and s3fs's (``storage_options={"endpoint_url": ...}``).

Example::

    with MotoS3() as s3:
        s3.upload_dir(shard_dir, "train")
        remote = fastio.RemoteOptions(storage_options=s3.storage_options)
        loader = fastio.StreamLoader(s3.url("train/"), remote=remote, ...)
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

__all__ = ["DUMMY_ENV", "MotoS3"]

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1",
    "no_proxy": "127.0.0.1",
}
_CLEARED_ENV = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
)


class MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket, the dummy environment set while it runs.

    Args:
        bucket: the bucket created at start.

    Attributes (once started):
        endpoint_url: ``http://127.0.0.1:<port>``.
        storage_options: what s3fs needs to reach it (``{"endpoint_url": ...}``).
        client: a boto3 S3 client on it.
    """

    def __init__(self, bucket: str = "fastio-test") -> None:
        self.bucket = bucket
        self.endpoint_url = ""
        self.client: Any = None
        self._server: Any = None
        self._env = pytest.MonkeyPatch()

    @property
    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint_url}

    def url(self, key: str) -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{key}"

    def start(self) -> MotoS3:
        server_module = pytest.importorskip(
            "moto.server", reason="the S3 tests need moto's server: pip install 'moto[server]'"
        )
        boto3 = pytest.importorskip("boto3", reason="the S3 tests upload with boto3: pip install boto3")
        for name, value in DUMMY_ENV.items():
            self._env.setenv(name, value)
        for name in _CLEARED_ENV:
            self._env.delenv(name, raising=False)
        self._server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        self.client = boto3.client("s3", endpoint_url=self.endpoint_url)
        self.client.create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        """Stop the server and restore the environment; safe to call more than once."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._env.undo()

    def upload_dir(self, directory: Path, prefix: str) -> list[str]:
        """Upload every file directly in ``directory`` as ``<prefix>/<name>``; return the keys."""
        keys = []
        for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
            key = f"{prefix.rstrip('/')}/{path.name}"
            self.client.upload_file(str(path), self.bucket, key)
            keys.append(key)
        return keys

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def __enter__(self) -> MotoS3:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
