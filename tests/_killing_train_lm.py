"""examples/train_lm.py with a rank that dies in the middle of a checkpoint write: run it under torchrun in
place of the example, with ``KILL_AT=STEP:RANK``.

On torchrun's first attempt, rank RANK writes half of its file of checkpoint STEP, fsyncs it, then
SIGKILLs itself, as a preemption in the middle of a write would; a restart (``TORCHELASTIC_RESTART_COUNT``
above 0) writes normally. The fault goes in through ``fastcomm.Checkpointer.write_file``, the checkpointer's
public seam, and the example's ``checkpointer=`` argument. The tests run it through ``_rank_client.py``
(``_fault_runs.command(..., script=...)``), whose server imports it once and calls its :func:`main`.

Example::

    KILL_AT=20:1 torchrun --nproc-per-node 2 --max-restarts 3 tests/_killing_train_lm.py --hook sign ...
"""

from __future__ import annotations

import functools
import io
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, and its fastcomm/ (the tests) would shadow the
# package; the example's folder is where train_lm and its modules are.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent / "examples"), *(p for p in sys.path if Path(p or ".").resolve() != _HERE)]

import torch  # noqa: E402
import train_lm  # noqa: E402

import fastcomm  # noqa: E402

__all__ = ["KillingCheckpointer", "main"]


class KillingCheckpointer(fastcomm.Checkpointer):
    """A checkpointer whose rank ``kill_rank`` writes half of its file of step ``kill_step`` and SIGKILLs
    itself."""

    def __init__(self, *args: Any, kill_step: int, kill_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_step, self.kill_rank = kill_step, kill_rank

    def write_file(self, path: Path, payload: Mapping[str, Any]) -> tuple[int, str]:
        if (payload["step"], payload["rank"]) == (self.kill_step, self.kill_rank):
            buffer = io.BytesIO()
            torch.save(dict(payload), buffer)
            with open(path, "wb") as handle:
                handle.write(buffer.getvalue()[: buffer.tell() // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_file(path, payload)


def main(argv: list[str] | None = None) -> int:
    """The example's ``main``, on torchrun's first attempt with the checkpointer of ``KILL_AT=STEP:RANK``."""
    checkpointer: Any = fastcomm.Checkpointer
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # a restart must not fail again
        step, rank = (int(part) for part in os.environ["KILL_AT"].split(":"))
        checkpointer = functools.partial(KillingCheckpointer, kill_step=step, kill_rank=rank)
    return train_lm.main(argv, checkpointer=checkpointer)


if __name__ == "__main__":
    sys.exit(main())
