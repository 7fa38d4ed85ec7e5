"""BucketEntry.may_owe: the cheap check a dense step makes before building what a bucket owes.

It must never say "nothing owed" where :meth:`BucketEntry.owed` holds a non-zero value (that would drop error
feedback silently); it may say "maybe" where the sum is zero (owed() then decides)."""

import pytest
import torch

from fastcomm.hooks.engine.store import SEGMENT_TENSOR, BucketEntry


def _tensor(kind: str, n: int, generator: torch.Generator, pad_from: int | None = None) -> torch.Tensor:
    values = torch.randn(n, generator=generator)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "padding" and pad_from is not None:  # non-zero only past the bucket's end
        values[: min(pad_from, n)] = 0
    if kind == "sparse":
        values[torch.rand(n, generator=generator) < 0.97] = 0
    return values


@pytest.mark.parametrize("seed", range(40))
def test_may_owe_never_hides_what_owed_holds(seed):
    g = torch.Generator().manual_seed(seed)
    numels = tuple(
        int(x) for x in torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
    )
    n, world = sum(numels), int(torch.randint(2, 5, (1,), generator=g))
    segment_len = -(-n // world)
    start = int(torch.randint(0, n, (1,), generator=g))
    entry = BucketEntry(numels=numels, world_size=world, segment_start=start)
    kinds = ("zeros", "random", "padding", "sparse", None)
    residual_kind = kinds[int(torch.randint(0, 5, (1,), generator=g))]
    segment_kind = kinds[int(torch.randint(0, 5, (1,), generator=g))]
    if residual_kind is not None:
        entry.tensors["residual"] = _tensor(residual_kind, n + 3, g, pad_from=n)
    if segment_kind is not None:
        entry.tensors[SEGMENT_TENSOR] = _tensor(segment_kind, segment_len, g, pad_from=max(0, n - start))
    owed = entry.owed()
    if owed is not None and bool(owed.any()):
        assert entry.may_owe(segment=True), (residual_kind, segment_kind)
    residual = entry.tensors.get("residual")
    if residual is not None and bool(residual.any()):
        assert entry.may_owe(segment=False), residual_kind
    if residual_kind in ("zeros", None) and segment_kind in ("zeros", None):
        assert not entry.may_owe(segment=True) and not entry.may_owe(segment=False)


def test_may_owe_reads_the_segment_only_when_asked():
    entry = BucketEntry(numels=(6, 4), world_size=2, segment_start=4)
    entry.tensors = {"residual": torch.zeros(10), SEGMENT_TENSOR: torch.tensor([0.0, 0.0, 2.5, 0.0, 0.0])}
    assert entry.may_owe(segment=True) and not entry.may_owe(segment=False)
    assert entry.owed()[6] == 5.0  # W * segment value at bucket offset 4 + 2


@pytest.mark.parametrize("finite", [True, False])
def test_what_a_dense_step_pays_is_dropped_when_it_commits_and_kept_when_it_is_skipped(finite):
    # BucketStore.take_owed: the owed sum goes out with the dense allreduce; a committed step then holds no
    # residual (nothing owed, no memory, no read on the next dense step); a skipped step (GradScaler) keeps
    # what was owed, to be paid by the next one.
    from fastcomm.hooks.engine.store import BucketStore

    g = torch.Generator().manual_seed(7)
    store, key, numels = BucketStore(), (0, 1), (6, 5)
    entry = store.entry(key, numels, world_size=2)
    store.set_segment(entry, 6, 2)
    residual, segment = torch.randn(11, generator=g), torch.randn(6, generator=g)
    entry.tensors.update({"residual": residual.clone(), SEGMENT_TENSOR: segment.clone()})
    expected = entry.owed()
    owed = store.take_owed(key, numels, 2, segment=True)
    assert torch.equal(owed, expected)
    store.end_iteration(finite)
    if finite:
        assert entry.tensors == {} and not entry.may_owe()
        assert store.take_owed(key, numels, 2, segment=True) is None
        assert torch.equal(store.current(entry, "residual", torch.empty(11)), torch.zeros(11))
    else:
        assert torch.equal(entry.tensors["residual"], residual)
        assert torch.equal(store.take_owed(key, numels, 2, segment=True), expected)
