"""ShardWriter and ShardReader round trips: every dtype and shape, variable-length fields, schema checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fastio
from fastio.format.shards.reader import ShardSet

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
]
SHAPES = [(), (1,), (7,), (3, 5), (2, 1, 3)]


def _values(dtype: str, shape: tuple[int, ...], i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 1e3).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_round_trip_every_dtype_and_shape(tmp_path, dtype):
    schema = {f"f{k}": (dtype, shape) for k, shape in enumerate(SHAPES)}
    samples = [
        {f"f{k}": _values(dtype, shape, 31 * i + k) for k, shape in enumerate(SHAPES)} for i in range(11)
    ]
    with fastio.ShardWriter(tmp_path, schema=schema, max_samples=4) as writer:
        for s in samples:
            writer.write(s)
    shards = ShardSet(tmp_path, verify=True)
    assert shards.shard_sizes == [4, 4, 3]
    for name in schema:
        column = np.concatenate([r.fixed(name) for r in shards.readers])
        np.testing.assert_array_equal(column, np.stack([s[name] for s in samples]))
        assert column.dtype == np.dtype(dtype)


def test_variable_fields_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    samples = [
        {
            "tokens": rng.integers(-5, 5, size=int(rng.integers(0, 9)), dtype=np.int32),
            "pairs": rng.standard_normal((int(rng.integers(1, 4)), 2)).astype(np.float32),
            "raw": bytes(rng.integers(0, 256, size=int(rng.integers(0, 20)), dtype=np.uint8)),
            "name": "ünïcode-" * int(rng.integers(0, 3)),
        }
        for _ in range(23)
    ]
    schema = {
        "tokens": ("int32", None),
        "pairs": fastio.Field.array("float32", (2,)),
        "raw": "bytes",
        "name": "str",
    }
    with fastio.ShardWriter(tmp_path, schema=schema, max_samples=5) as writer:
        for s in samples:
            writer.write(s)
    shards = ShardSet(tmp_path, verify=True)
    got = [(r, j) for r in shards.readers for j in range(r.num_samples)]
    for (reader, j), expected in zip(got, samples, strict=True):
        np.testing.assert_array_equal(reader.variable("tokens", j), expected["tokens"])
        np.testing.assert_array_equal(reader.variable("pairs", j), expected["pairs"])
        assert reader.variable("raw", j) == expected["raw"]
        assert reader.variable("name", j) == expected["name"]


def test_schema_inferred_from_first_sample(tmp_path):
    with fastio.ShardWriter(tmp_path) as writer:
        writer.write(
            {"x": torch.arange(6, dtype=torch.float32).view(2, 3), "y": 3, "s": 0.5, "t": b"ab", "u": "z"}
        )
    schema = json.loads((tmp_path / "index.json").read_text())["schema"]
    assert schema["x"] == {"kind": "fixed", "dtype": "<f4", "shape": [2, 3]}
    assert schema["y"]["dtype"] == "<i8" and schema["s"]["dtype"] == "<f8"
    assert schema["t"]["kind"] == "bytes" and schema["u"]["kind"] == "str"


def test_max_bytes_splits_shards(tmp_path):
    with fastio.ShardWriter(tmp_path, max_bytes=1000) as writer:
        for i in range(10):
            writer.write({"x": np.full(100, i, np.int32)})  # 400 bytes each: 3 per shard
    assert ShardSet(tmp_path).shard_sizes == [3, 3, 3, 1]


def test_wrong_sample_raises_schema_mismatch(tmp_path):
    writer = fastio.ShardWriter(tmp_path, schema={"x": ("uint8", (4,)), "t": "bytes"})
    writer.write({"x": np.arange(4, dtype=np.uint8) + 1, "t": b"a"})
    with pytest.raises(fastio.SchemaMismatchError, match=r"'x'.*uint8 \(4,\).*\(5,\)"):
        writer.write({"x": np.arange(5, dtype=np.uint8), "t": b"a"})
    with pytest.raises(fastio.SchemaMismatchError, match="'t'"):
        writer.write({"x": np.arange(4, dtype=np.uint8), "t": "not bytes"})
    with pytest.raises(fastio.SchemaMismatchError, match="fields"):
        writer.write({"x": np.arange(4, dtype=np.uint8)})
    with pytest.raises(fastio.SchemaMismatchError, match="float64"):
        writer.write({"x": np.arange(4, dtype=np.float64), "t": b"a"})


def test_writer_refuses_existing_set_and_failed_writer_leaves_no_index(tmp_path):
    with fastio.ShardWriter(tmp_path / "a") as writer:
        writer.write({"x": 1})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fastio.ShardWriter(tmp_path / "a")
    with pytest.raises(RuntimeError):
        with fastio.ShardWriter(tmp_path / "b", max_samples=2) as writer:
            for i in range(5):
                writer.write({"x": i})
            raise RuntimeError("job died")
    assert not (tmp_path / "b" / "index.json").exists()
    with pytest.raises(fastio.MissingIndexError, match="index.json"):
        ShardSet(tmp_path / "b")


def test_write_many_equals_write(tmp_path):
    rng = np.random.default_rng(2)
    xs = rng.integers(0, 255, size=(29, 2, 3), dtype=np.uint8)
    toks = [np.arange(i % 4, dtype=np.int32) + i for i in range(29)]
    with fastio.ShardWriter(
        tmp_path / "many", max_samples=10, schema={"x": ("uint8", (2, 3)), "t": ("int32", None)}
    ) as writer:
        writer.write_many({"x": xs[:5], "t": toks[:5]})
        writer.write_many({"x": xs[5:], "t": toks[5:]})
    with fastio.ShardWriter(
        tmp_path / "one", max_samples=10, schema={"x": ("uint8", (2, 3)), "t": ("int32", None)}
    ) as writer:
        for x, t in zip(xs, toks, strict=True):
            writer.write({"x": x, "t": t})
    many, one = ShardSet(tmp_path / "many", verify=True), ShardSet(tmp_path / "one", verify=True)
    assert many.shard_sizes == one.shard_sizes == [10, 10, 9]
    for a, b in zip(many.readers, one.readers, strict=True):
        np.testing.assert_array_equal(a.fixed("x"), b.fixed("x"))
        for j in range(a.num_samples):
            np.testing.assert_array_equal(a.variable("t", j), b.variable("t", j))
    with pytest.raises(ValueError, match="differ in length"):
        fastio.ShardWriter(tmp_path / "bad").write_many({"x": xs[:3], "t": toks[:2]})
