"""Shards truncated while mapped: reading one must raise a named fastio error that names the file, never
kill the process with SIGBUS, while a SIGBUS the guard did not cause still reaches the handler before it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fastio

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_inputs import END, NATIVE, npy_bytes, rng_for, tar_member  # noqa: E402

# -- 6. a shard truncated while mapped ---------------------------------------------------------------------


def _run_child(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fastio.__file__).parents[1]), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


TRUNCATE_WHILE_ITERATING = """
    import os, sys
    import fastio
    loader = fastio.StreamLoader(
        {source!r}, batch_size=4, num_workers={workers}, worker_mode={mode!r}, prefetch=1
    )
    it = iter(loader)
    next(it)
    os.truncate({victim!r}, 600)
    try:
        for _ in it:
            pass
    except fastio.CorruptShardError as err:
        print("caught:", err)
        sys.exit(0)
    print("no error")
    sys.exit(3)
"""


def _fio_set(tmp_path: Path) -> tuple[str, str]:
    with fastio.ShardWriter(
        tmp_path / "s", max_samples=64, schema={"x": ("uint8", (512,)), "t": "bytes"}
    ) as w:
        rng = rng_for("truncate fio")
        for i in range(128):
            w.write({"x": rng.integers(0, 256, 512, dtype=np.uint8), "t": b"%d" % i * 40})
    return str(tmp_path / "s"), str(tmp_path / "s" / "shard-000000.fio")


def _tar_set(tmp_path: Path) -> tuple[str, str]:
    rng = rng_for("truncate tar")
    blob = b"".join(
        tar_member(f"k{i:03d}.x.npy".encode(), npy_bytes(rng.standard_normal(64)))
        + tar_member(f"k{i:03d}.txt".encode(), b"t")
        for i in range(64)
    )
    (tmp_path / "a.tar").write_bytes(blob + END)
    return str(tmp_path / "a.tar"), str(tmp_path / "a.tar")


# Workers gather ahead of the consumer, so the truncation can land inside a copy: only the native guard
# turns that into an error (the torch fallback checks the size before each copy, which closes the window
# only when nothing gathers concurrently, as with num_workers=0).
@pytest.mark.parametrize(
    ("workers", "mode"),
    [(0, "thread"), pytest.param(2, "thread", marks=NATIVE), pytest.param(2, "process", marks=NATIVE)],
)
@pytest.mark.parametrize("kind", ["fio", "tar"])
def test_shard_truncated_while_iterating_raises_instead_of_sigbus(tmp_path, kind, workers, mode):
    source, victim = (_fio_set if kind == "fio" else _tar_set)(tmp_path)
    script = TRUNCATE_WHILE_ITERATING.format(source=source, victim=victim, workers=workers, mode=mode)
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-3000:])
    assert "truncated while mapped" in child.stdout and Path(victim).name in child.stdout


@NATIVE
@pytest.mark.parametrize("threads", [1, 3])
def test_native_gather_turns_sigbus_into_an_error(tmp_path, threads):
    """The fstat check is bypassed, so the copy itself faults: the guard must name the file."""
    path = tmp_path / "big.bin"
    path.write_bytes(rng_for(("sigbus", threads)).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    script = f"""
        import os, sys
        import numpy as np, torch
        import fastio
        from fastio.files import gather, mapped
        f = mapped.MappedFile({str(path)!r})
        table = mapped.MappedTable([f])
        f.check_size = lambda: None
        os.truncate({str(path)!r}, 4096)
        offsets = np.arange(200, dtype=np.int64) * 4096
        out = torch.empty(200, 4096, dtype=torch.uint8)
        try:
            gather.gather_rows(table, np.zeros(200, np.int32), offsets, 4096, out, {threads})
        except fastio.CorruptShardError as err:
            print("caught:", err)
        lengths = np.full(200, 4096, np.int64)
        try:
            gather.gather_ranges(table, np.zeros(200, np.int32), offsets, lengths, out.view(-1), {threads})
        except fastio.CorruptShardError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert child.stdout.count("SIGBUS reading sample 1 at byte 4096") == 2, child.stdout
    assert "big.bin" in child.stdout


@NATIVE
def test_sigbus_in_the_output_is_not_blamed_on_the_shard(tmp_path):
    source, target = tmp_path / "src.bin", tmp_path / "out.bin"
    source.write_bytes(rng_for("output fault").integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    target.write_bytes(b"\0" * (1 << 20))
    script = f"""
        import mmap, os
        import numpy as np, torch
        import fastio
        from fastio.files import gather, mapped
        table = mapped.MappedTable([mapped.MappedFile({str(source)!r})])
        with open({str(target)!r}, "r+b") as fh:
            shared = mmap.mmap(fh.fileno(), 0)
        out = torch.frombuffer(shared, dtype=torch.uint8).view(256, 4096)
        os.truncate({str(target)!r}, 4096)
        offsets = np.arange(256, dtype=np.int64) * 4096
        try:
            gather.gather_rows(table, np.zeros(256, np.int32), offsets, 4096, out, 1)
        except fastio.CorruptShardError as err:
            print("blamed the shard:", err)
        except RuntimeError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "caught:" in child.stdout and "output buffer's memory faulted" in child.stdout, child.stdout


@NATIVE
@pytest.mark.parametrize("faulthandler", [False, True])
def test_sigbus_outside_a_guarded_copy_still_kills(tmp_path, faulthandler):
    """The guard chains: a SIGBUS it did not cause reaches the handler before it (or the default)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x01" * 8192)
    script = f"""
        import os, signal
        {"import faulthandler; faulthandler.enable()" if faulthandler else ""}
        import numpy as np, torch
        from fastio.files import gather, mapped
        table = mapped.MappedTable([mapped.MappedFile({str(path)!r})])
        out = torch.empty(8, dtype=torch.uint8)
        gather.gather_rows(table, np.zeros(1, np.int32), np.zeros(1, np.int64), 8, out)
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == -7 and "survived" not in child.stdout, (child.returncode, child.stdout)
    if faulthandler:
        assert "Bus error" in child.stderr


def test_checksum_pass_over_a_shard_truncated_since_open(tmp_path):
    source, victim = _fio_set(tmp_path)
    script = f"""
        import os
        import fastio
        from fastio.format.shards.reader import ShardReader
        reader = ShardReader({victim!r})
        os.truncate({victim!r}, 4096)
        try:
            reader.ensure_verified()
        except fastio.CorruptShardError as err:
            print("caught:", err)
    """
    child = _run_child(script, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "shard-000000.fio" in child.stdout and "truncated while mapped" in child.stdout
