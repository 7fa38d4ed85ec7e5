"""fastcomm.DiLoCo: the outer loop against a plain simulation (2 and 4 gloo ranks, fp32 and 4-bit with error
feedback, one fragment and streaming, delayed and eager), bit-identical resume through fastcomm.Checkpointer
in fresh processes (an exchange in flight, eager too), a dead peer at a sync, and the arguments' checks.

The simulation cases run in one process group per world size (a module fixture); each is its own test here.
"""

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import fastcomm
from fastcomm.diloco.fragments import split_parameters

sys.path.insert(0, str(Path(__file__).parent))
import _diloco_workers as workers  # noqa: E402
import _hooks_workers  # noqa: E402

WORLDS = (2, 4)
FAULT_TIMEOUT_S = 5.0  # the replicas' group timeout
FAULT_LIMIT_S = 60.0  # process start-up, the fault, the report, on a loaded 2-core machine


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """World size -> case -> per-rank outcome ("ok" or the traceback)."""
    found = {}
    for world in WORLDS:
        workdir = tmp_path_factory.mktemp(f"diloco{world}")
        _hooks_workers.spawn(workdir, world, workers.run_all, str(workdir), timeout_s=240)
        per_rank = [json.loads((workdir / f"results_{r}.json").read_text()) for r in range(world)]
        found[world] = {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}
    return found


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(workers.cases(2)))
def test_diloco_matches_the_simulation(outcomes, world, case):
    failures = [text for text in outcomes[world][case] if text != "ok"]
    assert not failures, failures[0]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The final weights of an uninterrupted run and of one restored mid-interval in fresh processes."""
    workdir = tmp_path_factory.mktemp("diloco_resume")
    for phase in ("whole", "resumed"):  # each process group its own store
        _hooks_workers.spawn(workdir / phase, 2, workers.resume_worker, str(workdir), phase, timeout_s=180)
    return workdir


@pytest.mark.parametrize("rank", (0, 1))
@pytest.mark.parametrize("config", sorted(workers.RESUME_CONFIGS))
def test_resume_mid_interval_is_bit_identical(resumed, config, rank):
    whole = torch.load(resumed / f"{config}-whole-{rank}.pt", weights_only=False)
    again = torch.load(resumed / f"{config}-resumed-{rank}.pt", weights_only=False)
    for key, value in whole["model"].items():
        assert torch.equal(value, again["model"][key]), key
    for saved, restored in zip(whole["outer"]["fragments"], again["outer"]["fragments"], strict=True):
        assert torch.equal(saved["global_weights"], restored["global_weights"])
        assert torch.equal(saved["momentum"], restored["momentum"])
    start = workers._mlp().state_dict()
    assert any(not torch.equal(start[k], v) for k, v in whole["model"].items()), "nothing trained"


def _run_fault(workdir: Path, compressor: str) -> dict:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hooks_workers._entry, daemon=True,
                         args=(rank, 2, str(workdir), workers.fault_worker,
                               (str(workdir), compressor, FAULT_TIMEOUT_S)))
             for rank in range(2)]  # fmt: skip
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + FAULT_LIMIT_S
    try:
        while procs[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    errors = [path.read_text() for path in sorted(workdir.glob("error_*.txt"))]
    assert not errors, "a rank failed before the fault:\n" + "\n".join(errors)
    report = workdir / "survivor.json"
    assert report.exists(), f"the survivor neither raised nor finished within {FAULT_LIMIT_S} s (hang)"
    return json.loads(report.read_text())


@pytest.mark.parametrize("compressor", sorted(workers.FAULT_OPTIONS))
def test_a_dead_peer_at_a_sync_raises_peer_collective_error(tmp_path, compressor):
    report = _run_fault(tmp_path, compressor)
    if workers.fault_step(compressor) == workers.FAULT_SYNC_STEP:
        assert report["step"] == workers.FAULT_SYNC_STEP, report
    else:  # died with the exchange in flight: it fails where it lands, or (if the peer had sent all of it
        # before dying) the next sync fails, at its issue or, where gloo saw the closed connection only once
        # the sync was under way, where that sync lands; never later, never a hang
        first, second = workers.FAULT_SYNC_STEP, 2 * workers.FAULT_SYNC_STEP
        delay = workers.FAULT_OPTIONS[compressor]["delay"]
        assert report["step"] in (first + delay, second, second + delay), report
    assert report["type"] == "PeerCollectiveError", report
    assert "a collective with the other ranks failed" in report["message"], report
    assert "DiLoCo fragment 0 all-reduce" in report["message"], report
    # On the closed connection, not after the group's timeout: the first compressed sync makes the phase-2
    # lane's group, whose barrier on the store waited out the whole timeout for the dead peer (gloo's
    # default: 30 minutes) before the barrier on the parent group came first.
    assert report["seconds"] < FAULT_TIMEOUT_S, report


# ---------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("fragments", (1, 2, 3, 5))
def test_fragments_cover_the_parameters_in_order_and_balance(fragments):
    params = [nn.Parameter(torch.empty(n)) for n in (301, 7, 55, 1000, 3, 3, 640, 17)]
    groups = split_parameters(params, fragments)
    assert [p for g in groups for p in g] == params
    assert all(groups)
    sizes = [sum(p.numel() for p in g) for g in groups]
    largest = max(p.numel() for p in params)
    assert max(sizes) - min(sizes) <= largest + sum(sizes) // fragments, sizes


def _outer(**options):
    model = nn.Linear(5, 3)
    return fastcomm.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": 10, "fragments": 3}, "divide"),
        ({"sync_every": 10, "fragments": 2, "delay": 11}, "delay"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"mixing": 1.0}, "mixing"),
        ({"fragments": 3, "sync_every": 6}, "at most the number of parameters"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        _outer(**options)


def test_a_numpy_or_tensor_outer_lr_is_taken_as_a_float_and_a_string_is_refused():
    import numpy as np

    for value in (np.float32(0.5), torch.tensor(0.5)):
        outer = _outer(outer_lr=value)
        assert type(outer.outer_lr) is float and outer.outer_lr == 0.5
    with pytest.raises(ValueError, match="outer_lr"):
        _outer(outer_lr="0.5")
    assert fastcomm.outer_lr_ramp(np.float64(0.5), np.float32(1.0), hold=1, until=3)(2) == pytest.approx(0.75)


def test_an_optimizer_of_other_parameters_is_refused():
    model = nn.Linear(5, 3)
    with pytest.raises(ValueError, match="not in inner_optimizer"):
        fastcomm.DiLoCo(model, torch.optim.SGD(nn.Linear(5, 3).parameters(), lr=0.1))


def test_a_named_compressor_takes_its_options():
    outer = _outer(compressor="quantize", bits=4, block=64)
    assert (outer.compressor.bits, outer.compressor.block) == (4, 64)
    with pytest.raises(TypeError, match="quantize"):
        _outer(compressor="quantize", nonsense=1)


def test_a_state_of_another_configuration_is_refused():
    state = _outer(sync_every=10).state_dict()
    with pytest.raises(ValueError, match="another configuration"):
        _outer(sync_every=20).load_state_dict(state)


def test_a_restart_at_another_world_size_keeps_the_global_state_and_the_mean_owed_residual():
    states = []
    for rank in range(3):
        torch.manual_seed(0)  # replicas start equal
        state = _outer(sync_every=10, compressor="quantize", bits=4).state_dict()
        state["fragments"][0]["global_weights"] += 1.5  # the same on every old rank
        state["fragments"][0]["residual"]["worker"] = torch.full((18,), 0.25 * (rank + 1))
        states.append(state)
    # old rank 2 also holds a two-phase segment residual: elements 9-17 of a 3-rank exchange
    states[2]["fragments"][0]["residual"].update(server=torch.ones(9), segment_start=9, world_size=3)
    # what the 3 old ranks owed, on average: 0.5 of the workers, plus 3 * 1 / 3 on the segment
    owed = torch.cat([torch.full((9,), 0.5), torch.full((9,), 1.5)])
    for rank in range(2):
        merged, why = fastcomm.DiLoCo.merge_state_dicts(states, world_size=2, rank=rank)
        residual = merged["fragments"][0]["residual"]
        assert torch.allclose(residual["worker"], owed) and residual["server"] is None, residual
        global_weights = states[0]["fragments"][0]["global_weights"]
        assert torch.equal(merged["fragments"][0]["global_weights"], global_weights)
        assert "mean still owed is unchanged" in why, why
        outer = _outer(sync_every=10, compressor="quantize", bits=4, residual_dtype=torch.bfloat16)
        outer.load_state_dict(merged)
        assert torch.equal(outer.fragments[0].global_weights, global_weights)
        assert torch.allclose(outer.fragments[0].residual.owed(), owed)  # 0.5 and 1.5: exact in bf16
        assert outer.fragments[0].residual.nbytes() == 18 * 2


def test_residual_dtype_is_checked_and_needs_a_compressor():
    with pytest.raises(ValueError, match="residual_dtype must be a floating-point dtype or None, got"):
        _outer(compressor="quantize", residual_dtype="bf16")
    with pytest.raises(ValueError, match="residual_dtype needs a compressor"):
        _outer(residual_dtype=torch.bfloat16)


def test_a_grad_scaler_loop_counts_every_iteration_and_syncs_on_weights(one_rank):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 9), nn.Tanh(), nn.Linear(9, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = fastcomm.DiLoCo(model, inner, sync_every=3, compressor="quantize", bits=4, block=32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)  # the first steps overflow and are skipped
    x = torch.randn(8, 16) + 0.5
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(9):
        inner.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean() * 64  # about 2**4: scaled by 2**126, inf
        scaler.scale(loss).backward()
        scaler.step(inner)
        scaler.update()
        outer.after_inner_step()
    assert outer.inner_steps == 9 and outer.syncs == 3
    assert scaler.get_scale() < 2.0**126  # some inner steps were skipped, the syncs were not
    assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(local, outer.fragments[0].global_weights)  # 1 rank, right after a sync


def test_low_precision_weights_keep_fp32_global_weights(one_rank):
    torch.manual_seed(4)
    model = nn.Linear(33, 7).to(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = fastcomm.DiLoCo(model, inner, sync_every=2, outer_lr=0.7, outer_momentum=0.5)
    for _ in range(4):
        inner.zero_grad()
        model(torch.randn(5, 33, dtype=torch.bfloat16)).float().square().mean().backward()
        outer.step()
    global_weights = outer.fragments[0].global_weights
    assert global_weights.dtype == torch.float32
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(local, global_weights.to(torch.bfloat16))
    assert not torch.equal(global_weights.to(torch.bfloat16).float(), global_weights)  # kept finer than bf16


def test_outer_lr_ramp_holds_rises_linearly_and_stays():
    ramp = fastcomm.outer_lr_ramp(0.5, 1.1, hold=100, until=400)
    assert [ramp(s) for s in (1, 100)] == [0.5, 0.5]
    assert ramp(250) == pytest.approx(0.8) and ramp(101) == pytest.approx(0.5 + 0.6 / 300)
    assert [ramp(s) for s in (400, 10_000)] == [1.1, 1.1]
    assert fastcomm.outer_lr_ramp(0.9, 0.3, hold=0, until=3)(2) == pytest.approx(0.5)  # falling too


@pytest.mark.parametrize(
    ("args", "match"),
    [((0.0, 1.0, 10, 20), "for start"), ((0.5, -1.0, 10, 20), "for end"),
     ((0.5, 1.0, 20, 20), "hold < until"), ((0.5, 1.0, -1, 20), "hold < until"),
     ((0.5, 1.0, 2.5, 20), "hold < until")],
)
def test_outer_lr_ramp_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        fastcomm.outer_lr_ramp(*args)


def test_an_outer_lr_function_is_called_at_each_sync_and_checked(one_rank):
    torch.manual_seed(5)
    model = nn.Linear(6, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    asked = []

    def lr(step):
        asked.append(step)
        return 0.5 if step < 6 else 0.0  # 0 is refused, at the sync that asks for it

    outer = fastcomm.DiLoCo(model, inner, sync_every=3, outer_lr=lr, outer_momentum=0.0)
    for step in range(1, 7):
        inner.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        if step < 6:
            outer.step()
            continue
        with pytest.raises(ValueError, match=r"outer_lr\(6\)"):
            outer.step()
    assert asked == [3, 6]
