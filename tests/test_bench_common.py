"""benchmarks.common: the process helpers the benchmarks and the multi-process tests share."""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path

import pytest

from benchmarks.common import free_port, launch, median, rank_env, tail


@pytest.mark.parametrize(
    ("values", "expected"), [([3.0, 1.0, 2.0], 2.0), ([4.0, 1.0, 3.0, 2.0], 2.5), ([7.0], 7.0)]
)
def test_median_takes_the_middle_value_or_the_mean_of_the_two_middle_ones(values, expected) -> None:
    assert median(values) == expected


def test_median_of_nothing_is_nan() -> None:
    assert math.isnan(median([]))


def test_free_port_can_be_listened_on() -> None:
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_tail_prefers_the_lines_that_name_an_error(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text("step 1\nRuntimeError: gloo lost a peer\n\nstep 2\n")
    assert tail(log) == "RuntimeError: gloo lost a peer"
    log.write_text("step 1\nstep 2\nstep 3\nstep 4\n")
    assert tail(log, 2) == "step 3 | step 4"
    log.write_text("")
    assert tail(log) == "(no output)"


def test_rank_env_names_the_rank_and_lets_extra_override(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = rank_env(1, 2, 29500, MASTER_ADDR="10.0.0.1", GLOO_SOCKET_IFNAME="lo")
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", "29500")
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["PYTHONPATH"].endswith("/elsewhere") and env["OMP_NUM_THREADS"] == "1"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launch_reports_ranks_that_exit_cleanly(tmp_path: Path) -> None:
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    code = "import os; print('rank', os.environ['RANK'])"
    ranks = launch([_python(code)] * 2, [rank_env(r, 2, 1) for r in range(2)], logs, 60, poll_s=0.05)
    assert ranks.ok and ranks.describe() == "ok" and ranks.returncodes == (0, 0)
    assert [log.read_text().strip() for log in logs] == ["rank 0", "rank 1"]


def test_launch_kills_the_peer_of_a_failed_rank_after_the_grace(tmp_path: Path) -> None:
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    commands = [_python("raise SystemExit('ValueError: bad shard')"), _python("import time; time.sleep(60)")]
    ranks = launch(commands, [rank_env(r, 2, 1) for r in range(2)], logs, 60, fail_grace_s=0.2, poll_s=0.05)
    assert not ranks.ok and ranks.failed == (0,) and ranks.killed == (1,)
    assert ranks.seconds < 30
    assert ranks.describe() == "crashed (rank 0 exit 1): ValueError: bad shard"


def test_launch_kills_every_rank_at_the_timeout(tmp_path: Path) -> None:
    logs = [tmp_path / "rank0.log"]
    ranks = launch([_python("import time; time.sleep(60)")], [rank_env(0, 1, 1)], logs, 0.3, poll_s=0.05)
    assert ranks.killed == (0,) and ranks.failed == () and ranks.returncodes[0] < 0
    assert ranks.describe().startswith("timed out after") and "[0] killed" in ranks.describe()


def test_launch_stops_when_the_callers_check_says_so(tmp_path: Path) -> None:
    logs = [tmp_path / "rank0.log"]
    calls = []
    ranks = launch(
        [_python("import time; time.sleep(60)")],
        [rank_env(0, 1, 1)],
        logs,
        60,
        poll_s=0.05,
        stop=lambda procs: calls.append(len(procs)) or len(calls) == 3,
    )
    assert calls == [1, 1, 1] and ranks.killed == (0,)


def test_launch_wants_one_command_environment_and_log_per_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one of each per rank"):
        launch([_python("pass")] * 2, [rank_env(0, 1, 1)], [tmp_path / "a.log"], 10)
