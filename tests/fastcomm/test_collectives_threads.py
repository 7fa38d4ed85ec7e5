"""collectives._threads: callbacks are counted until their future drops them, and exit waits for that."""

from __future__ import annotations

import threading

import pytest
import torch

from fastcomm.collectives import _threads


def _complete_on_a_thread(future: torch.futures.Future, value: torch.Tensor) -> threading.Thread:
    thread = threading.Thread(target=future.set_result, args=(value,))
    thread.start()
    return thread


def test_a_callback_is_in_flight_until_its_future_drops_it():
    before = _threads.callbacks_in_flight()
    entered, release = threading.Event(), threading.Event()

    def slow(future: torch.futures.Future) -> torch.Tensor:
        entered.set()
        release.wait(10)
        return future.value() * 2

    parent: torch.futures.Future = torch.futures.Future()
    child = _threads.then(parent, slow)
    assert _threads.callbacks_in_flight() == before + 1
    thread = _complete_on_a_thread(parent, torch.arange(5.0) + 1)
    assert entered.wait(10)
    assert _threads.callbacks_in_flight() == before + 1
    assert not _threads.wait_for_callbacks(timeout=0.2)  # exit waits for it, not finalize under it
    release.set()
    thread.join(10)
    torch.testing.assert_close(child.wait(), (torch.arange(5.0) + 1) * 2)
    assert _threads.wait_for_callbacks(timeout=10)
    assert _threads.callbacks_in_flight() == before


def test_a_callback_that_read_an_error_is_dropped_with_its_future():
    # the error's traceback keeps the callback's frames alive; it must not keep the count up (exit would wait)
    before = _threads.callbacks_in_flight()
    seen: list[str] = []
    done: torch.futures.Future = torch.futures.Future()

    def record(future: torch.futures.Future) -> None:
        try:
            future.value()
        except RuntimeError as error:
            seen.append(str(error))

    _threads.when_done(done, record)
    failed = _threads.then(done, lambda future: future.value())
    done.set_exception(RuntimeError("peer lost"))
    assert seen == ["peer lost"]
    with pytest.raises(RuntimeError, match="peer lost"):  # then() passes the error on
        failed.wait()
    assert _threads.callbacks_in_flight() == before


def test_quiesce_stops_an_ordered_worker_after_its_jobs():
    ran: list[int] = []
    worker = _threads.OrderedWorker("test-worker")
    for job in range(5):
        worker.submit(lambda job=job: ran.append(job))
    assert worker.stop(timeout=10)
    assert ran == [0, 1, 2, 3, 4]
