"""`make bench` (benchmarks/run_all.py): where results go and what is skipped without root, with the
benchmarks replaced by stand-ins (nothing is measured)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import harness, netlab, run_all

_NOW = time.struct_time((2025, 3, 4, 5, 6, 7, 1, 63, 0))
_NOT_ROOT = "netlab needs root to create network namespaces (run as root to get the 1 Gbit/s link)"


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, list[str]]:
    """Stand-ins for every benchmark: each records its argv and writes one result through the harness.
    Run folders land under ``tmp_path``; the output setting is restored afterwards."""
    calls: dict[str, list[str]] = {}

    def stand_in(name: str) -> SimpleNamespace:
        def main(argv: list[str]) -> str:
            calls[name] = list(argv)
            return harness.write_results(name, [harness.Row("case", "backend", "speed", 1.0, "x/s")])

        return SimpleNamespace(main=main)

    monkeypatch.setattr(run_all.importlib, "import_module", lambda module: stand_in(module.split(".")[-1]))
    monkeypatch.setattr(harness, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(harness, "_plot", lambda *args: None)
    monkeypatch.delenv(harness.OUTPUT_ENV, raising=False)
    return calls


def _as(monkeypatch: pytest.MonkeyPatch, *, uid: int, tools: bool) -> None:
    monkeypatch.setattr(netlab.os, "geteuid", lambda: uid)
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: f"/usr/sbin/{tool}" if tools else None)


def test_results_go_to_a_new_run_folder_by_default(ran, monkeypatch, tmp_path, capsys):
    _as(monkeypatch, uid=0, tools=True)
    assert run_all.main([]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{b.name}.{e}" for b in run_all.SUITE for e in ("json", "md")
    )
    assert not (tmp_path / "results").exists()
    out = capsys.readouterr().out
    assert f"Results go to {folder}" in out and "make bench UPDATE_RESULTS=1" in out


def test_update_results_writes_the_committed_folder(ran, monkeypatch, tmp_path, capsys):
    _as(monkeypatch, uid=0, tools=True)
    assert run_all.main(["--update-results"]) == 0
    assert (tmp_path / "results" / "bench_kernels.json").exists() and not (tmp_path / "runs").exists()
    assert f"Results go to {tmp_path / 'results'}" in capsys.readouterr().out


def test_the_run_folder_is_named_by_the_utc_time(monkeypatch):
    monkeypatch.delenv(harness.OUTPUT_ENV, raising=False)
    assert run_all.choose_output(False, {}, _NOW) == harness.RUNS_DIR / "20250304-050607Z"


def test_an_output_folder_in_the_environment_is_used(tmp_path):
    chosen = run_all.choose_output(False, {harness.OUTPUT_ENV: str(tmp_path / "mine")}, _NOW)
    assert chosen == tmp_path / "mine"
    assert run_all.choose_output(True, {harness.OUTPUT_ENV: str(tmp_path)}, _NOW) == harness.RESULTS_DIR


def test_the_harness_writes_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv(harness.OUTPUT_ENV, str(tmp_path / "chosen"))
    assert harness.output_dir() == tmp_path / "chosen"
    monkeypatch.delenv(harness.OUTPUT_ENV)
    assert harness.output_dir().parent == harness.RUNS_DIR


def test_without_root_netlab_parts_are_skipped_with_one_line_each(ran, monkeypatch, capsys):
    _as(monkeypatch, uid=1000, tools=True)
    assert run_all.main([]) == 0
    assert ran == {
        "bench_kernels": [],
        "bench_loader": [],
        "bench_images": [],
        "bench_hooks": ["--network", "loopback"],
        "bench_convergence": ["--skip-speed"],
    }
    skips = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skip ")]
    assert skips == [
        f"skip bench_hooks netlab and nodes networks (1gbit links): {_NOT_ROOT}",
        f"skip bench_convergence speed runs (shaped links): {_NOT_ROOT}",
        f"skip bench_remote entirely (HTTP behind a 1gbit link): {_NOT_ROOT}",
    ]


def test_missing_ip_or_tc_skips_the_same_parts_as_root(monkeypatch):
    _as(monkeypatch, uid=0, tools=False)
    steps = run_all.plan(run_all.SUITE, netlab.unavailable_reason())
    assert [s.name for s in steps if s.skip] == ["bench_hooks", "bench_convergence", "bench_remote"]
    assert all("`ip` command" in s.skip for s in steps if s.skip)


def test_as_root_with_ip_and_tc_everything_runs_in_full(monkeypatch):
    _as(monkeypatch, uid=0, tools=True)
    steps = run_all.plan(run_all.SUITE, netlab.unavailable_reason())
    assert [(s.name, s.argv, s.skip) for s in steps] == [(b.name, [], None) for b in run_all.SUITE]


def test_a_failing_benchmark_does_not_stop_the_others(ran, monkeypatch, capsys):
    _as(monkeypatch, uid=0, tools=True)
    real = run_all.importlib.import_module

    def import_module(module: str) -> SimpleNamespace:
        if module.endswith("bench_loader"):
            return SimpleNamespace(main=lambda argv: 1 / 0)
        return real(module)

    monkeypatch.setattr(run_all.importlib, "import_module", import_module)
    assert run_all.main([]) == 1
    assert "bench_loader FAILED: ZeroDivisionError" in capsys.readouterr().err
    assert "bench_remote" in ran
