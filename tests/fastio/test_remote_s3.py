"""Remote sources on S3: moto's standalone server on 127.0.0.1 (tests/fastio/_moto.py) read through s3fs
with ``endpoint_url``, the way s3fs's own tests reach moto. Batches from ``s3://`` URLs equal the same shards
read locally; a missing key is a named error with the URL and the store's code; credentials come from the
environment or from ``storage_options`` and never appear in an error."""

from __future__ import annotations

import gzip
import io
import sys
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("s3fs", reason="S3 URLs go through fsspec's s3fs: pip install s3fs")
pytest.importorskip("moto.server", reason="the S3 tests need moto's server: pip install 'moto[server]'")
pytest.importorskip("boto3", reason="the S3 tests upload with boto3: pip install boto3")

import fastio  # noqa: E402
from fastio.remote import RemoteAccessError, RemoteNotFoundError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _moto import MotoS3  # noqa: E402

TAR_SAMPLES, TAR_SHARD_SAMPLES = 40, 7


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with MotoS3() as running:
        yield running


def _plain(value: Any) -> Any:
    """A batch field as plain Python values, so two batches compare with ``==`` whatever their types."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _epoch(loader: fastio.StreamLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return [{name: _plain(field) for name, field in batch.items()} for batch in loader]


def _write_tars(directory: Path, suffix: str) -> list[Path]:
    """WebDataset tar shards of ``TAR_SAMPLES`` samples (``x.npy`` random int16, ``cls``, ``txt``) in shards
    of ``TAR_SHARD_SAMPLES``, as ``.tar`` or gzip-compressed ``.tar.gz``."""
    rng = np.random.default_rng(zlib.crc32(b"test_remote_s3 tars"))
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, first in enumerate(range(0, TAR_SAMPLES, TAR_SHARD_SAMPLES)):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(first, min(first + TAR_SHARD_SAMPLES, TAR_SAMPLES)):
                npy = io.BytesIO()
                np.save(npy, rng.integers(-(2**15), 2**15, size=(3, 5), dtype=np.int16))
                members = {"x.npy": npy.getvalue(), "cls": b"%d" % (i % 10), "txt": b"sample %d" % i}
                for ext, payload in members.items():
                    info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        path = directory / f"shard-{shard:03d}{suffix}"
        data = raw.getvalue()
        path.write_bytes(gzip.compress(data, mtime=0) if suffix == ".tar.gz" else data)
        paths.append(path)
    return paths


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fastio_shards_from_s3_give_the_local_batches(s3, shard_dir, tmp_path, num_workers):
    prefix = f"shards-w{num_workers}"
    s3.upload_dir(shard_dir, prefix)
    options = {"batch_size": 10, "shuffle": "shard", "seed": 5, "num_workers": num_workers}
    local = fastio.StreamLoader(shard_dir, **options)
    remote = fastio.StreamLoader(
        s3.url(f"{prefix}/"),
        remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=s3.storage_options),
        **options,
    )
    for epoch in (0, 1):  # epoch 1 reads the cache
        assert _epoch(remote, epoch) == _epoch(local, epoch)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_webdataset_tars_from_s3_give_the_local_batches(s3, tmp_path, suffix):
    local_tars = _write_tars(tmp_path / "local", ".tar")
    uploaded = _write_tars(tmp_path / "upload", suffix)
    prefix = f"tars{suffix.replace('.', '-')}"
    s3.upload_dir(tmp_path / "upload", prefix)
    last = len(uploaded) - 1
    options = {"batch_size": 6, "shuffle": "shard", "seed": 3}
    local = fastio.StreamLoader(str(tmp_path / "local" / f"shard-{{000..{last:03d}}}.tar"), **options)
    remote = fastio.StreamLoader(
        s3.url(f"{prefix}/shard-{{000..{last:03d}}}{suffix}"),
        remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=s3.storage_options),
        **options,
    )
    assert len(local_tars) == len(uploaded)
    batches = _epoch(remote, 0)
    assert batches == _epoch(local, 0)
    assert sorted(key for b in batches for key in b["__key__"]) == [f"s{i:05d}" for i in range(TAR_SAMPLES)]


def test_missing_shard_key_raises_a_named_error_with_url_and_code(s3, shard_dir, tmp_path):
    prefix = "shards-missing"
    keys = s3.upload_dir(shard_dir, prefix)
    victim = next(k for k in keys if k.endswith(".fio") and k != keys[0])
    s3.delete(victim)
    loader = fastio.StreamLoader(
        s3.url(f"{prefix}/"),
        batch_size=8,
        remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=s3.storage_options),
    )
    with pytest.raises(RemoteNotFoundError) as caught:
        for _ in loader:
            pass
    assert s3.url(victim) in str(caught.value) and caught.value.url == s3.url(victim)
    assert caught.value.code in {"404", "NoSuchKey", "FileNotFoundError"}
    assert caught.value.code in str(caught.value)


def test_missing_dataset_fails_when_the_loader_opens_it(s3, tmp_path):
    with pytest.raises(RemoteNotFoundError, match="s3://fastio-test/no-such-dataset/"):
        fastio.StreamLoader(
            s3.url("no-such-dataset/"),
            remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=s3.storage_options),
        )


def test_credentials_from_storage_options_work_and_stay_out_of_errors(
    s3, shard_dir, tmp_path, monkeypatch, fio
):
    prefix = "shards-credentials"
    keys = s3.upload_dir(shard_dir, prefix)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # only storage_options carry credentials now
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    secret = "do-not-print-this-secret"
    storage = {**s3.storage_options, "key": "testing-key-id", "secret": secret}
    loader = fastio.StreamLoader(
        s3.url(f"{prefix}/"),
        batch_size=16,
        remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=storage),
    )
    assert sum(len(batch["y"]) for batch in loader) == fio.NUM_SAMPLES
    s3.delete(keys[-1])
    loader = fastio.StreamLoader(
        s3.url(f"{prefix}/"),
        batch_size=16,
        remote=fastio.RemoteOptions(cache_dir=tmp_path / "fresh-cache", storage_options=storage),
    )
    with pytest.raises(RemoteNotFoundError) as caught:
        for _ in loader:
            pass
    assert caught.value.url == s3.url(keys[-1])
    assert secret not in str(caught.value) and secret not in repr(caught.value)


def test_denied_access_raises_a_named_error_with_url_and_code(s3, shard_dir, tmp_path, monkeypatch):
    import moto.settings

    prefix = "shards-denied"
    s3.upload_dir(shard_dir, prefix)
    # From here moto checks signatures, and the dummy key is no IAM user's: every request is refused.
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    secret = "another-secret-never-printed"
    storage = {**s3.storage_options, "key": "AKIAUNKNOWNKEY000000", "secret": secret}
    with pytest.raises(RemoteAccessError) as caught:
        fastio.StreamLoader(
            s3.url(f"{prefix}/"),
            remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache", storage_options=storage),
        )
    assert caught.value.url.startswith(s3.url(f"{prefix}/"))
    assert caught.value.code in {"403", "InvalidAccessKeyId", "AccessDenied"}
    assert caught.value.code in str(caught.value)
    assert secret not in str(caught.value) and secret not in repr(caught.value)
