"""A dead or stopped peer is never hidden: the survivor's backward raises, naming the peer failure.

2 gloo ranks train a small DDP model; rank 1 kills itself (``SIGKILL``) or stops (``SIGSTOP``, past the
process group's timeout) at the start of a step. The survivor must raise in that same step, within the
group's timeout plus slack, and never train on with stale buffers. DDP without a hook is the reference:
its own allreduce raises gloo's error from backward. The ``-hier`` cases run 4 ranks as 2 nodes x 2
(``node_size=2``); rank 1 dies inside node 0, and rank 0, waiting on its shard, must raise. ``kill-first``:
rank 1 dies before its first step, before the second process groups (the phase-2 lane; the node groups of
a hook registered with DDP's own ``register_comm_hook``) are made at the first bucket: the survivor must
fail on the closed connection, well within the timeout, not wait it out in ``new_group``.

DDP re-raises an error of a hook's future from ``loss.backward()`` as a ``RuntimeError`` carrying the
hook's exception as text (its type does not cross DDP's C++ reducer), so the assertions read the message.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fault_workers as faults  # noqa: E402

TIMEOUT_S = 5.0  # the training group's collective timeout
SLACK_S = 10.0  # detection beyond the timeout: a loaded 2-core machine
LIMIT_S = 45.0  # hard bound per case: process start-up, the fault, the report

CASES = [
    ("dense", "kill"),
    ("topk", "kill"),
    ("topk-warmup", "kill"),
    ("quantize", "kill"),
    ("quantize-inline", "kill"),
    ("sign", "kill"),
    ("cast", "kill"),
    ("adam-warmup", "kill"),
    ("adam", "kill"),
    ("topk", "stop"),
    ("sign", "stop"),
    ("sign", "stop-before-phase2"),
    ("sign-hier", "kill"),
    ("quantize-hier", "kill"),
    ("quantize", "kill-first"),
    ("quantize-hier", "kill-first"),
]


@pytest.mark.parametrize(("hook", "fault"), CASES, ids=[f"{h}-{f}" for h, f in CASES])
def test_survivor_raises_when_peer_fails(tmp_path, hook, fault):
    report = faults.run_with_fault(tmp_path, hook, fault, TIMEOUT_S, LIMIT_S)
    assert report["phase"] != "finished", f"{hook}: the survivor trained on after its peer died: {report}"
    fault_step = 0 if fault == "kill-first" else faults.FAULT_STEP
    assert report["step"] == fault_step, f"{hook}: raised at another step than the fault: {report}"
    if fault == "stop-before-phase2":  # the peer stopped where it was told to
        assert report["peer_stopped_step"] == faults.FAULT_STEP, report
    assert report["phase"] == "backward", report
    assert report["seconds"] < (TIMEOUT_S if fault == "kill-first" else TIMEOUT_S + SLACK_S), report
    if hook == "dense":  # DDP's own allreduce: gloo's error as is
        assert report["type"] == "RuntimeError", report
        return
    # typed where the hook call itself saw the failure (a phase 1 finished by the next hook call), else
    # DDP's RuntimeError around the future's PeerCollectiveError
    message = f"{report['type']}: {report['message']}"
    assert "PeerCollectiveError: fastcomm " in message, report
    assert "a collective with the other ranks failed" in message, report
    assert "on bucket" in message or "node groups" in message, report
    # a dead peer is not "no second process group": no fallback warned of, and the lane's barrier named
    assert not [w for w in report["warnings"] if "no second process group" in w], report
    if (hook, fault) == ("quantize", "kill-first"):
        assert "QuantState phase-2 lane barrier" in message and "on bucket" in message, report
