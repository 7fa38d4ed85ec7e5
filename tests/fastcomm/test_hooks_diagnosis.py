"""Where a step's time goes, from the hooks themselves: stats(), the one-line summary, profiler ranges.

The 2- and 4-rank check (bytes on the wire, a link rate, the communication shown) runs with the
collectives' cases (``_collectives_workers.py``, case ``hook-diagnosis``).
"""

import logging

import pytest
import torch

import fastcomm
from fastcomm.compress import QuantCompressor

TIME_KEYS = (
    "step_seconds", "exposed_comm_seconds", "comm_share", "comm_window_seconds", "link_bytes_per_second",
)  # fmt: skip


def _train(ddp, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        ddp(x).square().mean().backward()


def test_stats_say_where_the_step_time_goes(small_ddp):
    ddp = small_ddp()
    state = fastcomm.register(ddp, "sign")
    _train(ddp, 4)
    stats = state.stats()
    assert all(key in stats for key in TIME_KEYS)
    assert stats["step_seconds"] > 0.0
    assert 0.0 <= stats["comm_share"] <= 1.0
    assert stats["exposed_comm_seconds"] <= stats["comm_window_seconds"] + 1e-9


def test_summary_is_logged_every_n_iterations(small_ddp, caplog):
    ddp = small_ddp()
    state = fastcomm.register(ddp, "quantize", bits=8)
    state.log_every(2)
    with caplog.at_level(logging.INFO, logger="fastcomm.hooks"):
        _train(ddp, 7)  # iterations 1..6 close inside the loop (each at the next one's bucket 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastcomm.hooks"]
    assert len(lines) == 3
    assert lines[0].startswith("QuantState step") and "ms/step" in lines[0]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_log_every_refuses_what_is_not_a_count(small_ddp, bad):
    state = fastcomm.register(small_ddp(), "sign")
    with pytest.raises(ValueError, match="non-negative int"):
        state.log_every(bad)


def test_profiler_shows_each_phase_of_an_exchange(one_rank):
    tensor = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fastcomm.collectives.all_reduce(tensor, QuantCompressor(bits=8), chunk_bytes=1024)
    names = {event.name for event in profile.events()}
    prefix = "fastcomm fastcomm.collectives.all_reduce"
    # the caller's thread issues both phases here (async_op=False); each piece's decode runs on the thread
    # that completes its all-gather, which a CPU profile does not always capture
    assert f"{prefix} phase-1 compress and send" in names
    assert f"{prefix} phase-2 reduce and compress piece 0" in names
    assert f"{prefix} phase-2 reduce and compress piece 1" in names
