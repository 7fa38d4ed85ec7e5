"""numpy headers parsed by fastio's worker threads go through one lock (fastio.format.tar.npy): on CPython
3.11 concurrent ``ast.literal_eval`` calls could raise a spurious SystemError in 1 of ~6 two-thread runs.
Each test holds the lock and checks that a reader waits for it, then finishes once it is released."""

import io
import tarfile
import threading

import numpy as np

import fastio
from fastio.format.tar.decode import npy_header
from fastio.format.tar.index import load_tar_index
from fastio.format.tar.npy import NPY_HEADER_LOCK, load_npz


def _waits_for_the_lock(read) -> object:
    result: dict[str, object] = {}
    with NPY_HEADER_LOCK:
        thread = threading.Thread(target=lambda: result.setdefault("value", read()))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive() and not result, "read a numpy header without the lock"
    thread.join(10)
    assert not thread.is_alive()
    return result["value"]


def test_npy_header_is_parsed_under_the_lock():
    buffer = io.BytesIO()
    np.save(buffer, np.arange(7, dtype=np.int16).reshape(7, 1))
    dtype, shape, fortran, offset = _waits_for_the_lock(lambda: npy_header(buffer.getvalue()))
    assert (dtype, shape, fortran) == (np.dtype(np.int16), (7, 1), False) and offset > 10


def test_load_npz_and_tar_indexes_read_under_the_lock(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal(5), "b": rng.integers(0, 9, (2, 3))}
    np.savez(tmp_path / "x.npz", **arrays)
    loaded = _waits_for_the_lock(lambda: load_npz(tmp_path / "x.npz"))
    assert loaded.keys() == arrays.keys() and all(np.array_equal(loaded[k], arrays[k]) for k in arrays)

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for i in range(3):
            payload = str(i).encode()
            info = tarfile.TarInfo(f"k{i}.cls")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    fastio.index_tar(str(tmp_path / "s.tar"))
    index = _waits_for_the_lock(lambda: load_tar_index(str(tmp_path / "s.tar"), build=False))
    assert list(index.keys) == ["k0", "k1", "k2"]
