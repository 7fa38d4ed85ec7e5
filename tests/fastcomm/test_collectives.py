"""fastcomm.collectives on 2 and 4 gloo ranks, each case against a plain simulation, bit for bit.

The ranks run every case of ``_collectives_workers.cases`` in one process group per world size (a module
fixture); each case is its own test here. The arguments' checks run on a 1-rank group in this process.
"""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastcomm
from fastcomm.compress import PowerSGDCompressor, QuantCompressor, TopKCompressor

sys.path.insert(0, str(Path(__file__).parent))
import _collectives_workers as workers  # noqa: E402
import _hooks_workers  # noqa: E402

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """World size -> case -> per-rank outcome ("ok" or the traceback)."""
    found = {}
    for world in WORLDS:
        workdir = tmp_path_factory.mktemp(f"collectives{world}")
        _hooks_workers.spawn(workdir, world, workers.run_all, str(workdir), timeout_s=240)
        per_rank = [json.loads((workdir / f"results_{r}.json").read_text()) for r in range(world)]
        found[world] = {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}
    return found


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(workers.cases(2)))
def test_collective_matches_the_simulation(outcomes, world, case):
    failures = [text for text in outcomes[world][case] if text != "ok"]
    assert not failures, failures[0]


def test_every_case_ran(outcomes):
    for world in WORLDS:
        assert sorted(outcomes[world]) == sorted(workers.cases(world))


# ---------------------------------------------------------------------------- argument checks (1 rank)
def test_reduce_scatter_refuses_a_non_blockwise_compressor(one_rank):
    with pytest.raises(TypeError, match="blockwise"):
        fastcomm.collectives.reduce_scatter(torch.empty(8), torch.randn(8), TopKCompressor(k=2))


def test_reduce_scatter_checks_the_sizes(one_rank):
    with pytest.raises(ValueError, match="shards"):
        fastcomm.collectives.reduce_scatter(torch.empty(7), torch.randn(8), QuantCompressor(bits=8))


def test_all_gather_checks_the_sizes(one_rank):
    with pytest.raises(ValueError, match="inputs"):
        fastcomm.collectives.all_gather(torch.empty(9), torch.randn(8), QuantCompressor(bits=8))


def test_all_reduce_refuses_a_non_contiguous_tensor(one_rank):
    with pytest.raises(ValueError, match="contiguous"):
        fastcomm.collectives.all_reduce(torch.randn(8, 8).t(), QuantCompressor(bits=8))


def test_all_reduce_refuses_an_integer_tensor(one_rank):
    with pytest.raises(TypeError, match="floating-point"):
        fastcomm.collectives.all_reduce(torch.arange(8), QuantCompressor(bits=8))


def test_all_reduce_refuses_another_reduce_op(one_rank):
    with pytest.raises(ValueError, match="ReduceOp"):
        fastcomm.collectives.all_reduce(torch.randn(8), QuantCompressor(bits=8), op=dist.ReduceOp.MAX)


def test_all_reduce_refuses_what_is_not_a_compressor(one_rank):
    with pytest.raises(TypeError, match="Compressor"):
        fastcomm.collectives.all_reduce(torch.randn(8), object())


def test_a_residual_serves_one_size(one_rank):
    residual = fastcomm.collectives.Residual()
    fastcomm.collectives.all_reduce(torch.randn(64), QuantCompressor(bits=8), residual=residual)
    with pytest.raises(ValueError, match="one Residual per tensor"):
        fastcomm.collectives.all_reduce(torch.randn(65), QuantCompressor(bits=8), residual=residual)


def test_one_rank_all_reduce_keeps_what_compression_dropped(one_rank):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    residual = fastcomm.collectives.Residual()
    tensor = x.clone()
    fastcomm.collectives.all_reduce(
        tensor, QuantCompressor(bits=4, block=32, stochastic=False), residual=residual
    )
    assert not torch.equal(tensor, x)  # 4-bit codes are lossy
    owed = residual.worker + residual.server[:1000]  # one rank: its segment is the whole tensor
    torch.testing.assert_close(tensor + owed, x, rtol=0, atol=1e-5)


def test_residual_state_dict_round_trips(one_rank):
    residual = fastcomm.collectives.Residual()
    fastcomm.collectives.all_reduce(torch.randn(100), PowerSGDCompressor(rank=1), residual=residual,
                                    shapes=[torch.Size([10, 10])])  # fmt: skip
    again = fastcomm.collectives.Residual()
    again.load_state_dict(residual.state_dict())
    assert torch.equal(again.worker, residual.worker)


def test_a_failed_exchange_raises_peer_collective_error_with_its_type(one_rank, monkeypatch):
    from fastcomm.collectives import gather

    real, pending = gather.gather_row, []

    def failing(row, **kwargs):
        gathered = real(row, **kwargs)
        gathered.future.wait()
        pending.append(torch.futures.Future())
        return gather.Gathered(gathered.rows, pending[-1], gathered.sent_bytes)

    monkeypatch.setattr(gather, "gather_row", failing)
    work = fastcomm.collectives.all_reduce(torch.randn(64), TopKCompressor(k=4), async_op=True)
    pending[0].set_exception(RuntimeError("Connection closed by peer"))  # the all-gather fails
    with pytest.raises(fastcomm.PeerCollectiveError, match="Connection closed by peer"):
        work.wait()


def test_wait_for_peers_leaves_a_group_without_a_cpu_backend_alone():
    # NCCL only: no CPU all-reduce to run (there a dead peer is only ever seen by the timeout)
    class NcclOnly:
        def _get_backend(self, device: torch.device) -> None:
            raise RuntimeError(f"No backend type associated with device type {device.type}")

    assert fastcomm.collectives.wait_for_peers(NcclOnly()) is None


def test_lane_for_raises_a_dead_peer_and_remembers_nothing(monkeypatch):
    # a peer that fails the lane's barrier is not "no second process group": no warning, nothing cached (a
    # later call asks again), the error raised as is
    from fastcomm.collectives import _lane

    class Group:  # a stand-in for a process group: lane_for only keys its cache by it
        pass

    group, calls = Group(), []

    def dead(parent: object) -> None:
        calls.append(parent)
        closed = RuntimeError("Connection closed by peer")
        raise fastcomm.PeerCollectiveError("phase-2 lane barrier", None, closed)

    monkeypatch.setattr(_lane, "Lane", dead)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail here
        for _ in range(2):
            with pytest.raises(fastcomm.PeerCollectiveError, match="phase-2 lane barrier.*Connection closed"):
                _lane.lane_for(group)
    assert calls == [group, group] and group not in _lane._LANES

    def unsupported(parent: object) -> None:  # a group no second one can be made over: warned once, kept
        raise ValueError("no new_group here")

    monkeypatch.setattr(_lane, "Lane", unsupported)
    with pytest.warns(RuntimeWarning, match="no second process group"):
        assert _lane.lane_for(group) is None
    assert _lane._LANES.pop(group) is None
