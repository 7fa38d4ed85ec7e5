"""`make bench` (benchmarks/run_all.py): the short and full profiles, where results go, what is skipped
without root, and the progress lines, with the benchmarks replaced by stand-ins (nothing is measured)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import harness, netlab, run_all

_NOW = time.struct_time((2025, 3, 4, 5, 6, 7, 1, 63, 0))
_NOT_ROOT = "netlab needs root to create network namespaces (run as root to get the 1 Gbit/s link)"
_REPO = Path(__file__).resolve().parent.parent
# every two-rank configuration but torch_powersgd_r4, which fails over gloo
_HOOKS = "allreduce,noop,torch_fp16,torch_powersgd_r4_1bucket,bf16_cast,topk_0.01,quant8,quant4,sign,"
_HOOKS += "powersgd_r4,auto"
_SHORT = {
    "bench_kernels": ["--repeat", "3"],
    "bench_loader": [
        "--samples", "200000", "--var-samples", "20000", "--tar-samples", "20000",
        "--dataloader-samples", "20000", "--webloader-samples", "5000", "--peer-seconds", "0.5",
        "--pack-docs", "10000",
    ],
    "bench_images": ["--quick"],
    "bench_shuffle": ["--epochs", "1"],
    "bench_ft": [],
    "bench_parquet": ["--repeats", "2", "--hf-rows", "5000"],
    "bench_diloco_seeds": ["--rows", "diloco_q4_defaults", "--seeds", "0", "--steps", "30",
                           "--choice-rows", ""],
    "bench_hooks": ["--quick", "--network", "both", "--configs", _HOOKS],
    "bench_convergence": [
        "--methods", "none,cadam,diloco_q4", "--steps", "250", "--warmup-steps", "2", "--timed-steps", "6",
    ],
    "bench_fsdp": [
        "--parts", "loss,speed,hsdp", "--loss-steps", "40", "--loss-methods", "dense,q8",
        "--loss-layouts", "fp32", "--width", "1024", "--depth", "6", "--warmup", "1", "--timed", "2",
        "--speed-layouts", "fp32,bf16-keep", "--network", "1gbit", "--hsdp-methods", "dense,q8",
    ],
    "bench_remote": ["--gigabytes", "0.5", "--shard-mb", "32", "--probe-mb", "128", "--repeats", "1"],
}


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
        [f"{b.name}.{e}" for b in run_all.SUITE for e in ("json", "md")] + ["guard.json", "guard.md"]
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
        "bench_kernels": _SHORT["bench_kernels"],
        "bench_loader": _SHORT["bench_loader"],
        "bench_images": _SHORT["bench_images"],
        "bench_shuffle": _SHORT["bench_shuffle"],
        "bench_ft": _SHORT["bench_ft"],
        "bench_parquet": _SHORT["bench_parquet"],
        "bench_diloco_seeds": _SHORT["bench_diloco_seeds"],
        "bench_hooks": ["--quick", "--network", "loopback", "--configs", _HOOKS],
        "bench_convergence": [*_SHORT["bench_convergence"], "--skip-speed"],
        "bench_fsdp": [*_SHORT["bench_fsdp"][:-3], "loopback", *_SHORT["bench_fsdp"][-2:]],
    }
    skips = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skip ")]
    assert skips == [
        f"skip bench_hooks netlab and nodes networks (1gbit links): {_NOT_ROOT}",
        f"skip bench_convergence speed runs (shaped links): {_NOT_ROOT}",
        f"skip bench_fsdp 1gbit link and HSDP nodes: {_NOT_ROOT}",
        f"skip bench_remote entirely (HTTP behind a 1gbit link): {_NOT_ROOT}",
    ]


def test_missing_ip_or_tc_skips_the_same_parts_as_root(monkeypatch):
    _as(monkeypatch, uid=0, tools=False)
    steps = run_all.plan(run_all.SUITE, netlab.unavailable_reason())
    skipped = ["bench_hooks", "bench_convergence", "bench_fsdp", "bench_remote"]
    assert [s.name for s in steps if s.skip] == skipped
    assert all("`ip` command" in s.skip for s in steps if s.skip)


def test_full_as_root_passes_no_arguments(monkeypatch):
    _as(monkeypatch, uid=0, tools=True)
    steps = run_all.plan(run_all.SUITE, netlab.unavailable_reason(), full=True)
    assert [(s.name, s.argv, s.skip) for s in steps] == [(b.name, [], None) for b in run_all.SUITE]


def test_full_without_root_passes_only_what_leaves_netlab_out(monkeypatch):
    _as(monkeypatch, uid=1000, tools=True)
    steps = run_all.plan(run_all.SUITE, netlab.unavailable_reason(), full=True)
    assert {s.name: s.argv for s in steps} == {
        "bench_kernels": [],
        "bench_loader": [],
        "bench_images": [],
        "bench_shuffle": [],
        "bench_ft": [],
        "bench_parquet": [],
        "bench_diloco_seeds": [],
        "bench_hooks": ["--network", "loopback"],
        "bench_convergence": ["--skip-speed"],
        "bench_fsdp": ["--network", "loopback"],
        "bench_remote": None,
    }


def test_the_short_profile_is_the_default_as_root(ran, monkeypatch, capsys):
    _as(monkeypatch, uid=0, tools=True)
    assert run_all.main([]) == 0
    assert ran == _SHORT
    out = capsys.readouterr().out
    assert "Short profile" in out and "make bench FULL=1" in out


@pytest.mark.parametrize("flags", [["--full"], ["--update-results"], ["--full", "--update-results"]])
def test_full_and_update_results_run_every_benchmark_with_its_defaults(flags, ran, monkeypatch, capsys):
    _as(monkeypatch, uid=0, tools=True)
    assert run_all.main(flags) == 0
    assert ran == {name: [] for name in _SHORT}
    assert "Full profile" in capsys.readouterr().out


@pytest.mark.parametrize("uid", [0, 1000])
def test_the_short_profile_is_estimated_under_20_minutes(uid, monkeypatch):
    _as(monkeypatch, uid=uid, tools=True)
    assert 0 < run_all.short_minutes(run_all.SUITE, netlab.unavailable_reason()) <= 20


@pytest.mark.parametrize("bench", run_all.SUITE, ids=lambda b: b.name)
def test_every_short_profile_option_exists(bench, monkeypatch):
    """Each short-profile flag is one of the benchmark's own options (its parser is read, nothing runs)."""
    seen: list[argparse.ArgumentParser] = []
    real_parse = argparse.ArgumentParser.parse_args

    def capture(parser: argparse.ArgumentParser, args=None, namespace=None):
        seen.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(f"benchmarks.{bench.name}").main(list(bench.short))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real_parse)
    (parser,) = seen
    options = {option for action in parser._actions for option in action.option_strings}
    assert {token for token in bench.short if token.startswith("--")} <= options
    parsed = parser.parse_args(list(bench.short))  # values of the right type, no conflicts
    assert parsed is not None


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    "variables, flags",
    [([], ""), (["FULL=1"], "--full"), (["UPDATE_RESULTS=1"], "--update-results"),
     (["FULL=yes", "UPDATE_RESULTS=true"], "--full --update-results")],
)
def test_make_bench_passes_full_and_update_results(variables, flags):
    dry = subprocess.run(
        ["make", "-n", "-W", "Makefile", "bench", *variables], cwd=_REPO, capture_output=True, text=True
    )
    (line,) = [line for line in dry.stdout.splitlines() if "benchmarks.run_all" in line]
    assert line.split("benchmarks.run_all", 1)[1].split() == flags.split()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_installs_what_the_benchmarks_import(tmp_path):
    """From nothing (a venv that does not exist yet), ``make bench`` installs the remote extras too: without
    aiohttp bench_shuffle and bench_remote failed on a fresh clone (their shards are read over HTTP)."""
    # not as a sub-make of `make test` (whose MAKEFLAGS would add "Entering directory" lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(
        ["make", "-n", "bench", f"VENV={tmp_path / 'venv'}"],
        cwd=_REPO, capture_output=True, text=True, env=env,
    )  # fmt: skip
    lines = dry.stdout.splitlines()
    installs = [line for line in lines if "pip install" in line]
    for needed in ("aiohttp", "fsspec", "torchdata", "numpy", "-e ."):
        assert any(needed in line for line in installs), f"make bench does not install {needed}: {installs}"
    runs = [i for i, line in enumerate(lines) if "-m benchmarks.run_all" in line]
    assert runs and all(i < runs[0] for i, line in enumerate(lines) if "pip install" in line), lines


def test_progress_prints_the_elapsed_time_to_stderr(capsys):
    harness.progress("loss run 1 of 3")
    err = capsys.readouterr().err
    assert err.startswith("[") and err.rstrip().endswith("s] loss run 1 of 3")


def test_a_silent_block_gets_a_heartbeat_line(capsys):
    with harness.heartbeat("bench_x", every_s=0.2):
        time.sleep(0.7)
    beats = [line for line in capsys.readouterr().err.splitlines() if "bench_x: still running" in line]
    assert 2 <= len(beats) <= 4


def test_progress_lines_keep_the_heartbeat_quiet(capsys):
    with harness.heartbeat("bench_x", every_s=0.4):
        for _ in range(6):
            time.sleep(0.1)
            harness.progress("step")
    assert "still running" not in capsys.readouterr().err


def test_run_all_gives_each_benchmark_a_heartbeat(ran, monkeypatch, capsys):
    _as(monkeypatch, uid=0, tools=True)
    labels: list[str] = []
    real = harness.heartbeat

    def recorded(label: str, every_s: float = harness.HEARTBEAT_S):
        labels.append(label)
        assert every_s <= 30
        return real(label, every_s)

    monkeypatch.setattr(harness, "heartbeat", recorded)
    assert run_all.main([]) == 0
    assert labels == [b.name for b in run_all.SUITE]


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
