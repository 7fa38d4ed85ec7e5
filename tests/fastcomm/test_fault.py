"""fastcomm.fault: the timeout's sources, which errors are a lost peer, the guard and the exit path.

The end-to-end behaviour (a killed or stopped peer under a survivor, torchrun restarts) is in
tests/test_fault_tolerance.py; these are the unit-level contracts.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

import fastcomm
import fastcomm.fault as fault
from benchmarks.common import free_port


def test_timeout_comes_from_the_argument_then_the_environment_then_the_default(monkeypatch) -> None:
    monkeypatch.delenv("FASTCOMM_TIMEOUT", raising=False)
    assert fault.timeout_seconds() == fault.DEFAULT_TIMEOUT_S == 300.0
    monkeypatch.setenv("FASTCOMM_TIMEOUT", "42.5")
    assert fault.timeout_seconds() == 42.5
    assert fault.timeout_seconds(7) == 7.0
    assert fault.timeout_seconds(timedelta(minutes=2)) == 120.0


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_a_bad_timeout_in_the_environment_is_named(monkeypatch, value: str) -> None:
    monkeypatch.setenv("FASTCOMM_TIMEOUT", value)
    with pytest.raises(ValueError, match="FASTCOMM_TIMEOUT"):
        fault.timeout_seconds()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), timedelta(0)])
def test_a_bad_timeout_argument_is_named(value) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive"):
        fault.timeout_seconds(value)


@pytest.mark.parametrize(
    "message",
    [
        "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4242: Connection reset by peer",
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242",
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation",
        "Got the following error when running the callback: PeerCollectiveError: fastcomm TopKState",
    ],
)
def test_what_gloo_and_fastcomm_say_of_a_lost_peer_is_recognised(message: str) -> None:
    assert fault.is_peer_failure(RuntimeError(message))


def test_a_cause_chain_is_followed_and_ordinary_errors_are_not_peer_failures() -> None:
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as inner:
            raise ValueError("while reducing bucket 3") from inner
    except ValueError as outer:
        assert fault.is_peer_failure(outer)
    assert not fault.is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not fault.is_peer_failure(KeyError("weight"))


def test_peer_guard_converts_peer_failures_and_passes_everything_else() -> None:
    with pytest.raises(fault.PeerLostError, match="rank 0: a peer rank is gone") as caught:
        with fault.peer_guard():
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "torchrun --max-restarts" in str(caught.value)
    with pytest.raises(ZeroDivisionError):
        with fault.peer_guard():
            1 / 0  # noqa: B018


def test_peer_lost_error_pickles_with_its_fields() -> None:
    error = fault.PeerLostError(3, 12.0, RuntimeError("Timed out waiting 12000ms"))
    back = pickle.loads(pickle.dumps(error))
    assert (back.rank, back.timeout, str(back)) == (3, 12.0, str(error))
    assert "12 s collective timeout" in str(back)
    assert isinstance(back, RuntimeError)


def test_exit_on_peer_loss_prints_and_exits_with_its_status() -> None:
    script = textwrap.dedent("""
        import fastcomm.fault as fault

        @fault.exit_on_peer_loss
        def main():
            with fault.peer_guard():
                raise RuntimeError("Connection reset by peer")

        main()
        print("not reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == fault.PEER_LOST_EXIT_CODE == 75
    assert "fastcomm.fault: rank 0: a peer rank is gone" in result.stderr
    assert "not reached" not in result.stdout


def test_exit_on_peer_loss_lets_other_errors_and_return_values_through() -> None:
    @fault.exit_on_peer_loss
    def fine() -> int:
        return 7

    @fault.exit_on_peer_loss
    def broken() -> None:
        raise KeyError("x")

    assert fine() == 7
    with pytest.raises(KeyError):
        broken()


def test_init_process_group_under_torchrun_uses_a_store_prefix_per_restart_attempt(monkeypatch) -> None:
    # As torchrun's rank 0 of restart attempt 2 would call it (here hosting the store itself, as without
    # TORCHELASTIC_USE_AGENT_STORE): the group is made on a store whose keys carry the attempt's prefix, so
    # addresses written by attempt 1's dead workers under the same names are never read.
    port = free_port()
    for key, value in dict(
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="2",
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    seen = {}
    monkeypatch.setattr(
        fault.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend)
    )
    assert fault.init_process_group("gloo", timeout=30) == 30.0
    assert seen["backend"] == "gloo" and seen["rank"] == 0 and seen["world_size"] == 1
    assert seen["timeout"] == timedelta(seconds=30)
    seen["store"].set("rank_0", b"address of attempt 2")
    raw = fault.dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert raw.get("fastcomm/attempt_2/rank_0") == b"address of attempt 2"
    assert not raw.check(["rank_0"])


def test_an_explicit_store_or_init_method_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    seen = {}
    monkeypatch.setattr(fault.dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    fault.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert seen["init_method"] == "tcp://127.0.0.1:1" and "store" not in seen


def test_attempt_store_is_not_used_outside_torchrun(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert fault._attempt_store(10.0) is None


def test_the_module_is_exported() -> None:
    assert fastcomm.fault is fault and "fault" in fastcomm.__all__
