"""Restarting at another world size: every hook state merged per new rank keeps what error feedback owes.

The spawned part trains every hook on 2 gloo ranks, restarts on 3 with ``merge_state_dicts`` of the 2 saved
states, trains on, and restarts on 2 again (elastic 2 -> 3 -> 2; see ``_reshard_workers``). The rest
checks the merge itself on random state_dicts, against the store's own ``residual_of`` of each old rank.
"""

import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_workers as workers  # noqa: E402
import _reshard_workers  # noqa: E402
from _reshard_workers import CASES  # noqa: E402

import fastcomm  # noqa: E402
from fastcomm.hooks.momentum import CompressedAdamState  # noqa: E402

STATE_CLASSES = {
    cls.__name__: cls
    for cls in (
        fastcomm.TopKState,
        fastcomm.QuantState,
        fastcomm.SignState,
        fastcomm.CastState,
        fastcomm.hooks.CompressorState,
        fastcomm.PowerSGDState,
        CompressedAdamState,
    )
}
# (tag of the run that saved, its world size, tag of the run that resumed from it)
TRANSITIONS = {"2->3": ("w2", 2, "w3", 3), "3->2": ("w3", 3, "w2b", 2)}


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case trained on 2 ranks (4 steps), resumed on 3 (2 steps), resumed on 2 others (2 steps)."""
    root = tmp_path_factory.mktemp("elastic")
    workers.spawn(root / "ranks", 3, _reshard_workers.elastic_worker, str(root), timeout_s=240)
    return root


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.float() for t in tensors]).mean(0)


@pytest.mark.distributed
@pytest.mark.parametrize("transition", TRANSITIONS)
@pytest.mark.parametrize("case", CASES)
def test_restart_at_another_world_size_keeps_the_mean_owed(elastic_run: Path, case: str, transition: str):
    saved_tag, old_world, resumed_tag, new_world = TRANSITIONS[transition]
    old = [_load(elastic_run / f"checkpoint_{saved_tag}_{case}_{r}.pt") for r in range(old_world)]
    new = [_load(elastic_run / f"loaded_{resumed_tag}_{case}_{r}.pt") for r in range(new_world)]
    assert set(new[0]["owed"]) == set(old[0]["owed"])
    assert f"{old_world} -> {new_world} ranks" in new[0]["why"], new[0]["why"]
    if not old[0]["owed"]:  # cast: nothing per rank
        assert new[0]["merged"] == old[0]["comm"], new[0]["why"]
    owes_something = False
    for part, old_owed in old[0]["owed"].items():
        for index, before in enumerate(old_owed):
            assert before is not None, f"{case}/{part}: parameter {index} has no residual"
            old_mean = _mean([o["owed"][part][index] for o in old])
            new_owed = [n["owed"][part][index] for n in new]
            new_mean = _mean(new_owed)
            # R fp32 values summed and divided: a few ulps of the largest of them
            atol = 4 * old_world * torch.finfo(torch.float32).eps * float(old_mean.abs().max() + 1e-30)
            torch.testing.assert_close(new_mean, old_mean, rtol=0, atol=atol, msg=f"{case}/{part}/{index}")
            for rank, owed in enumerate(new_owed[1:], start=1):
                assert torch.equal(owed, new_owed[0]), f"{case}/{part}/{index}: new rank {rank} owes other"
            owes_something |= bool(old_mean.abs().max() > 0)
    assert owes_something or not old[0]["owed"], f"{case}: no old rank owed anything (the test tests nothing)"


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_merged_state_keeps_nothing_of_the_old_group(elastic_run: Path, case: str):
    merged = _load(elastic_run / f"loaded_w3_{case}_1.pt")["merged"]
    parts = [merged["inner"], merged["warmup"]] if merged["type"] == "CompressedAdamState" else [merged]
    for part in parts:
        if part is None or "buckets" not in part:
            continue
        assert part["layout"] == [], "a merged state must not restore the old bucket layout"
        assert part["buckets"], f"{case}: the merged state has no bucket entries"
        for entry in part["buckets"]:
            assert entry["world_size"] == 3 and entry["segment_start"] == 0
            assert "server_residual" not in entry["tensors"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_same_world_size_gives_each_rank_its_own_state(elastic_run: Path, case: str):
    states = [_load(elastic_run / f"checkpoint_w2_{case}_{r}.pt")["comm"] for r in range(2)]
    cls = STATE_CLASSES[states[0]["type"]]
    for rank in range(2):
        merged, why = cls.merge_state_dicts(states, 2, rank)
        assert merged is states[rank] and "same world size" in why


# ------------------------------------------------------------------------------ the merge, in process
def _generator(case: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # 35, 7, 21, 3 elements


# bucket entries of _model's parameter keys (module order): (keys, numels), two buckets as DDP's rebuild
ENTRIES = [((3, 2), (3, 21)), ((1, 0), (7, 35))]


def _random_state(cls: type, rank: int, world: int, case: str, *, velocity: bool = False, **options) -> dict:
    """A state_dict of old rank ``rank`` of ``world`` with random residuals and two-phase segments.

    Segments are ``ceil(numel / world)`` rounded up to 8, so the last rank's runs past the bucket.
    """
    gen = _generator((case, rank, world))
    state = cls(**options).state_dict()
    state["steps"] = 7
    buckets, layout = [], []
    for keys, numels in ENTRIES:
        numel = sum(numels)
        segment = (-(-numel // world) + 7) // 8 * 8
        tensors = {"residual": torch.randn(numel, generator=gen)}
        if cls is not fastcomm.TopKState:
            tensors["server_residual"] = torch.randn(segment, generator=gen)
        if velocity:
            tensors["velocity"] = torch.randn(numel, generator=gen)
        buckets.append(
            {
                "params": list(keys),
                "numels": list(numels),
                "world_size": world,
                "segment_start": rank * segment,
                "tensors": tensors,
            }
        )
        layout.append({"params": list(keys), "numels": list(numels)})
    state.update(buckets=buckets, layout=layout)
    return state


def _owed(cls: type, state_dict: dict, **options) -> list[torch.Tensor]:
    """What a state restored from ``state_dict`` owes per parameter of :func:`_model` (the reference)."""
    model = _model()
    state = cls(**options)
    state.bind(model)
    state.load_state_dict(state_dict)
    return [state.residual_of(p) for p in model.parameters()]


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (2, 3), (2, 5), (3, 1), (3, 2), (3, 5)])
@pytest.mark.parametrize("cls", [fastcomm.QuantState, fastcomm.SignState, fastcomm.TopKState])
def test_merge_keeps_the_mean_of_what_old_ranks_owe(cls: type, old_world: int, new_world: int):
    case = (cls.__name__, old_world, new_world)
    states = [_random_state(cls, r, old_world, repr(case)) for r in range(old_world)]
    old_owed = [_owed(cls, s) for s in states]
    for rank in range(new_world):
        merged, why = cls.merge_state_dicts(states, new_world, rank)
        assert f"{old_world} -> {new_world} ranks" in why and "re-partitioned" in why, why
        assert ("folded in" in why) == (cls is not fastcomm.TopKState), why
        for index, owed in enumerate(_owed(cls, merged)):
            expected = _mean([o[index] for o in old_owed])
            atol = 4 * old_world * torch.finfo(torch.float32).eps * float(expected.abs().max())
            torch.testing.assert_close(owed, expected, rtol=0, atol=atol, msg=f"parameter {index}")


def test_merge_takes_the_mean_velocity():
    states = [_random_state(fastcomm.TopKState, r, 2, "velocity", velocity=True) for r in range(2)]
    merged, why = fastcomm.TopKState.merge_state_dicts(states, 3, 0)
    assert "velocity" in why
    for position, entry in enumerate(merged["buckets"]):
        expected = _mean([s["buckets"][position]["tensors"]["velocity"] for s in states])
        torch.testing.assert_close(entry["tensors"]["velocity"], expected, rtol=0, atol=1e-6)


def test_merged_state_restores_no_bucket_layout():
    states = [_random_state(fastcomm.SignState, r, 2, "layout") for r in range(2)]
    merged, _ = fastcomm.SignState.merge_state_dicts(states, 3, 2)
    state = fastcomm.SignState()
    state.load_state_dict(merged)
    # a fresh DDP's first bucket holds every parameter; under a restored layout it would be reduced in parts
    assert state.store.resume_parts((0, 1, 2, 3)) is None
    assert state.state_dict()["layout"] == []
    restored = fastcomm.SignState()
    restored.load_state_dict(states[0])
    assert [part.key for part in restored.store.resume_parts((0, 1, 2, 3))] == [(3, 2), (1, 0)]


def test_state_dict_without_layout_restores_its_entries_layout():
    state_dict = _random_state(fastcomm.SignState, 0, 2, "old format")
    del state_dict["layout"]
    state = fastcomm.SignState()
    state.load_state_dict(state_dict)
    assert [part.key for part in state.store.resume_parts((0, 1, 2, 3))] == [(3, 2), (1, 0)]


def test_merge_of_stateless_hook_takes_rank_zero_counters():
    states = [fastcomm.CastState(torch.float16).state_dict() for _ in range(3)]
    states[0]["bytes_sent"], states[1]["bytes_sent"] = 100, 200
    merged, why = fastcomm.CastState.merge_state_dicts(states, 2, 1)
    assert merged["bytes_sent"] == 100 and merged["options"] == {"dtype": torch.float16}
    assert "no per-rank tensors" in why
    state = fastcomm.CastState(torch.float16)
    state.load_state_dict(merged)
    assert state.stats()["bytes_sent"] == 100


def test_merge_of_compressed_adam_merges_both_compressors():
    inner = [_random_state(fastcomm.SignState, r, 2, "cadam inner") for r in range(2)]
    warmup = [_random_state(fastcomm.QuantState, r, 2, "cadam warmup") for r in range(2)]
    counters = {"scale": 1.0, "warmup_bytes": 10, "warmup_buckets": 2}
    states = [
        {"type": "CompressedAdamState", "inner": inner[r], "warmup": warmup[r], "counters": dict(counters)}
        for r in range(2)
    ]
    merged, why = CompressedAdamState.merge_state_dicts(states, 3, 1)
    assert "compressor SignState" in why and "warm-up compressor QuantState" in why, why
    assert merged["counters"] == counters
    for cls, part, old in ((fastcomm.SignState, "inner", inner), (fastcomm.QuantState, "warmup", warmup)):
        old_owed = [_owed(cls, s) for s in old]
        for index, owed in enumerate(_owed(cls, merged[part])):
            torch.testing.assert_close(owed, _mean([o[index] for o in old_owed]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="warm-up compressor"):
        CompressedAdamState.merge_state_dicts([states[0], {**states[1], "warmup": None}], 3, 0)


def test_merge_of_compressor_state_keeps_the_compressor_state():
    compressor = fastcomm.compress.QuantCompressor(bits=8, block=16)
    states = [
        _random_state(fastcomm.hooks.CompressorState, r, 2, "compressor", compressor=compressor)
        for r in range(2)
    ]
    merged, why = fastcomm.hooks.CompressorState.merge_state_dicts(states, 3, 0)
    assert merged["compressor"] == {} and "re-partitioned" in why
    old_owed = [_owed(fastcomm.hooks.CompressorState, s, compressor=compressor) for s in states]
    for index, owed in enumerate(_owed(fastcomm.hooks.CompressorState, merged, compressor=compressor)):
        torch.testing.assert_close(owed, _mean([o[index] for o in old_owed]), rtol=0, atol=1e-6)


def _mismatches() -> dict[str, tuple[list, str]]:
    quant = [_random_state(fastcomm.QuantState, r, 2, "mismatch", bits=8) for r in range(2)]
    other_bits = _random_state(fastcomm.QuantState, 1, 2, "mismatch", bits=4)
    other_step = {**quant[1], "steps": 8}
    other_buckets = {**quant[1], "buckets": quant[1]["buckets"][:1]}
    short = {**quant[1], "buckets": [dict(entry) for entry in quant[1]["buckets"]]}
    short["buckets"][0]["tensors"] = {"residual": torch.ones(5)}
    sign = _random_state(fastcomm.SignState, 1, 2, "mismatch")
    return {
        "empty": ([], "got none"),
        "type": ([quant[0], sign], "'SignState', not QuantState"),
        "options": ([quant[0], other_bits], "bits=4"),
        "steps": ([quant[0], other_step], "steps=8"),
        "buckets": ([quant[0], other_buckets], "bucket entries"),
        "tensor length": ([quant[0], short], "holds 5 elements"),
    }


@pytest.mark.parametrize("mismatch", ["empty", "type", "options", "steps", "buckets", "tensor length"])
def test_merge_rejects_state_dicts_that_do_not_belong_together(mismatch: str):
    states, message = _mismatches()[mismatch]
    with pytest.raises(ValueError, match=message):
        fastcomm.QuantState.merge_state_dicts(states, 3, 0)


@pytest.mark.parametrize(("world_size", "rank"), [(0, 0), (3, 3), (3, -1), (True, 0)])
def test_merge_rejects_a_rank_outside_the_new_group(world_size: int, rank: int):
    states = [_random_state(fastcomm.QuantState, r, 2, "rank") for r in range(2)]
    with pytest.raises(ValueError, match="world_size|rank"):
        fastcomm.QuantState.merge_state_dicts(states, world_size, rank)


class _PlainOptions:
    """An option value without ``__eq__`` (as a user's compressor class may be)."""

    def __init__(self, block: int) -> None:
        self.block = block


def test_options_without_eq_compare_by_attributes():
    same_value = fastcomm.hooks.engine.reshard.same_value
    assert same_value({"compressor": _PlainOptions(4)}, {"compressor": _PlainOptions(4)})
    assert not same_value({"compressor": _PlainOptions(4)}, {"compressor": _PlainOptions(8)})
