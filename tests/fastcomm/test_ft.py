"""fastcomm.ft: replicas on torchft's engine, killed with SIGKILL and started again, nothing lost.

Every job runs real processes (3 replicas, each with its torchft Manager and gloo groups over 127.0.0.1) and
a real Lighthouse, with short timeouts (1 s heartbeat, 5 s collectives). Few launches, many checks each:

* DiLoCo, 4-bit, H=5, no faults, and the same job where replica 2 is killed mid-interval (step 32), replica
  1 inside the exchange of the sync at step 65, and replica 2 again (its second life) at step 102, each
  started again at once;
* DDP with the 8-bit hook, no faults, and the same job where replica 1 is killed inside the exchange of step
  40 and again of step 90;
* streaming DiLoCo (2 fragments, 3 steps late), no faults, and one kill mid-interval;
* two replicas whose compressors differ (the first quorum names it).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft", reason="fastcomm.ft needs torchft: pip install 'fastcomm[ft]' (make install)")

import fastcomm  # noqa: E402
import fastcomm.ft  # noqa: E402
from fastcomm.advise.kernels import kernel_rates  # noqa: E402
from fastcomm.advise.model import Link  # noqa: E402
from fastcomm.hooks.auto import choose  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _ft_workers as workers  # noqa: E402
from _ft_workers import Job, Kill  # noqa: E402

pytestmark = pytest.mark.distributed

SLOW_LINK = Link(1e-6, 1e6)  # 1 MB/s: compression pays even on a tiny bucket
DILOCO_KILLS = [Kill(2, 0, "interval", 32), Kill(1, 0, "sync", 65), Kill(2, 1, "interval", 102)]
DDP_KILLS = [Kill(1, 0, "exchange", 40), Kill(1, 1, "exchange", 90)]
STREAMING = {"mode": "diloco", "sync_every": 6, "fragments": 2, "delay": 3, "steps": 240}
# replica 1 stays away 1.5 s: the two others step as a quorum of 2 meanwhile
# while a killed replica is away, the others' steps take 0.25 s at least: however slowly a loaded machine
# starts it again, it is back before they finish (the last kill leaves 48 steps, 12 s)
AWAY_STEP_S = 0.25
AUTO = {"mode": "ddp", "method": "auto", "steps": 100, "step_sleep_s": 0.05, "restart_after_s": 1.5,
        "kills": [Kill(1, 0, "exchange", 20)], "away_step_s": AWAY_STEP_S}  # fmt: skip
LAUNCHES = ["diloco", "diloco_faults", "ddp", "ddp_faults", "streaming", "streaming_faults", "ddp_auto"]
RESUME_BOUND_S = 15.0  # heartbeat timeout (1 s) + a failed collective (at most its 5 s timeout) + a quorum


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch of this module, once: name -> what :func:`_ft_workers.run` returned."""
    jobs = {
        "diloco": Job(mode="diloco"),
        "diloco_faults": Job(mode="diloco", kills=DILOCO_KILLS, away_step_s=AWAY_STEP_S),
        "ddp": Job(mode="ddp"),
        "ddp_faults": Job(mode="ddp", kills=DDP_KILLS, away_step_s=AWAY_STEP_S),
        "streaming": Job(**STREAMING),
        "streaming_faults": Job(**STREAMING, kills=[Kill(2, 0, "interval", 40)], away_step_s=AWAY_STEP_S),
        "ddp_auto": Job(**AUTO),
    }
    # three launches at a time: most of a launch's wall time is waiting (quorums, heartbeat timeouts)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: pool.submit(workers.run, job, tmp_path_factory.mktemp(name)) for name, job in jobs.items()
        }
        results = {name: future.result() for name, future in futures.items()}
    cpu = {name: round(result["replica_cpu_s"], 1) for name, result in results.items()}
    print(f"fastcomm.ft launches: replica CPU seconds {cpu}, forkserver {workers.forkserver_cpu_s():.1f}")
    for name, result in results.items():
        survivor = result["finals"].get(0, {"times": [(0, 0.0)] * 2, "loss": float("nan"), "stats": {}})
        times = [t for _, t in survivor["times"]]
        stand = max(b - a for a, b in zip(times, times[1:], strict=False))
        print(
            f"{name}: loss {survivor['loss']:.5f}, survivor stood still {stand:.2f} s at most, wall "
            f"{result['wall_s']:.1f} s, {survivor['stats'].get('discarded_steps', '-')} steps discarded"
        )
    return results


def _committed(result: dict) -> list[int]:
    records = [record for log in result["logs"].values() for record in log if record["kind"] == "commit"]
    return [i for record in records for i in record["ids"]]


@pytest.mark.parametrize("name", LAUNCHES)
def test_every_live_replica_ends_with_the_same_weights(runs, name):
    result = runs[name]
    assert not result["errors"], result["errors"]
    finals = result["finals"]
    assert sorted(finals) == [0, 1, 2], f"replicas that finished: {sorted(finals)}, exits {result['exits']}"
    key = "global" if result["job"]["fragments"] > 1 else "weights"
    first = finals[0]["stats"]["global"] if key == "global" else finals[0]["weights"]
    for replica, final in finals.items():
        mine = final["stats"]["global"] if key == "global" else final["weights"]
        assert torch.equal(mine, first), f"replica {replica}'s {key} weights differ from replica 0's"
        assert final["stats"]["step"] == result["job"]["steps"]


def test_auto_decides_at_each_quorum_alike_on_its_replicas(runs):
    """3 replicas, then 2 while replica 1 is away, then 3: each quorum's choice is made again for its
    size, and the replicas that end together hold the same last decision (and the same weights, above)."""
    finals = runs["ddp_auto"]["finals"]
    decisions = {replica: final["stats"]["auto_decisions"] for replica, final in finals.items()}
    sizes = [n for n, _ in decisions[0]]
    assert 2 in sizes and sizes[-1] == 3, f"replica 0's quorum sizes: {sizes}"
    assert all(choices for _, choices in decisions[0]), "a quorum exchanged without a choice"
    assert all("dense" not in choices.values() for _, choices in decisions[0]), decisions[0]
    assert all(decisions[r][-1] == decisions[0][-1] for r in finals), decisions


@pytest.mark.parametrize(("name", "reference"), [("diloco_faults", "diloco"), ("ddp_faults", "ddp"),
                                                 ("streaming_faults", "streaming")])  # fmt: skip
def test_loss_within_2_percent_of_the_run_without_faults(runs, name, reference):
    loss, clean = runs[name]["finals"][0]["loss"], runs[reference]["finals"][0]["loss"]
    assert abs(loss - clean) <= 0.02 * clean, f"{name}: loss {loss:.5f}, without faults {clean:.5f}"


@pytest.mark.parametrize("name", ["diloco", "diloco_faults", "ddp", "ddp_faults"])
def test_no_sample_lost_or_read_twice(runs, name):
    """The committed samples of all replicas, every life of each, are the order's first K, once each."""
    result = runs[name]
    ids = _committed(result)
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} samples committed twice"
    assert set(ids) == set(result["order"][: len(ids)]), "the committed samples are not a prefix of the order"
    steps, replicas, batch = result["job"]["steps"], result["job"]["replicas"], result["job"]["batch_size"]
    assert len(ids) >= steps * batch * (replicas - 1), f"only {len(ids)} samples committed in {steps} steps"


@pytest.mark.parametrize("name", ["diloco_faults", "ddp_faults", "streaming_faults"])
def test_survivors_keep_stepping_through_each_kill(runs, name):
    """Replica 0 is never killed: it never stands still for long, and loses at most an interval a kill."""
    result = runs[name]
    survivor = result["finals"][0]
    gaps = [b - a for (_, a), (_, b) in zip(survivor["times"], survivor["times"][1:], strict=False)]
    assert max(gaps) < RESUME_BOUND_S, f"the survivor stood still for {max(gaps):.1f} s"
    kills = len(result["job"]["kills"])
    stats = survivor["stats"]
    if result["job"]["mode"] == "ddp":
        assert 1 <= stats["failed_exchanges"] <= kills
    else:
        assert 1 <= stats["failed_syncs"] <= kills
        assert stats["discarded_steps"] <= stats["failed_syncs"] * result["job"]["sync_every"]


@pytest.mark.parametrize(("name", "replica", "lives"), [("diloco_faults", 2, 3), ("diloco_faults", 1, 2),
                                                        ("ddp_faults", 1, 3)])  # fmt: skip
def test_a_killed_replica_heals_from_a_peer_each_time(runs, name, replica, lives):
    result = runs[name]
    killed = [exit_ for exit_ in result["exits"] if exit_[0] == replica and exit_[2] == -9]
    assert len(killed) == lives - 1
    for life in range(1, lives):
        kinds = [record["kind"] for record in result["logs"][(replica, life)]]
        assert "healed" in kinds, f"replica {replica}'s life {life} did not heal: {kinds[:6]}"


def test_compressors_that_differ_are_named_at_the_first_quorum(tmp_path):
    result = workers.run(Job(mode="diloco", replicas=2, steps=10, odd_bits=8), tmp_path, deadline_s=60)
    assert len(result["errors"]) == 2, result["errors"]
    assert all(error.startswith("CompressorMismatchError") for error in result["errors"].values())


def test_an_unreachable_lighthouse_is_a_named_error_not_a_hang():
    with pytest.raises(fastcomm.ft.LighthouseUnreachableError, match="torchft_lighthouse --bind"):
        fastcomm.ft.connect("r0", lighthouse="http://127.0.0.1:9", connect_timeout=timedelta(seconds=2))


def test_a_manager_without_a_process_group_is_named():
    with pytest.raises(fastcomm.ft.NoProcessGroupError, match="ProcessGroupGloo"):
        fastcomm.ft.ManagedExchange(SimpleNamespace(_pg=None))


def test_diloco_on_an_asynchronous_quorum_is_named():
    model = torch.nn.Linear(4, 2)
    outer = fastcomm.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5)
    with pytest.raises(fastcomm.ft.AsyncQuorumError, match="use_async_quorum=False"):
        fastcomm.ft.FaultTolerantDiLoCo(SimpleNamespace(_use_async_quorum=True), outer)


def test_ddp_whose_buckets_are_rebuilt_is_named(small_ddp):
    with pytest.raises(fastcomm.ft.RebuildingBucketsError, match="find_unused_parameters=True"):
        fastcomm.ft.register(small_ddp(), SimpleNamespace(), "quantize", bits=8)


def test_auto_refuses_the_options_of_a_fixed_world_by_name(small_ddp):
    with pytest.raises(ValueError, match="no warm-up, timed trial or recheck"):
        fastcomm.ft.register(small_ddp(), SimpleNamespace(), "auto", recheck_every=100)


def test_auto_decides_again_for_each_quorum_size(monkeypatch):
    """Per quorum: the figures agreed on its group, then each bucket size gets the model's pick for that
    quorum's size; the same quorum asked again decides nothing more."""
    rates = kernel_rates("cpu")
    agreed = []
    monkeypatch.setattr(fastcomm.ft.auto, "measured_figures", lambda link, *args: agreed.append(args[-1])
                        or (link, rates))  # fmt: skip
    auto = fastcomm.ft.auto.QuorumAuto("cpu", 136, link=SLOW_LINK)
    quorums = [SimpleNamespace(size=lambda n=n: n) for n in (2, 3, 2)]
    for group in quorums:
        auto.decide(group)
        auto.decide(group)
        auto.choice(136)
    assert agreed == quorums
    expected = [choose(136, n, SLOW_LINK, rates, auto.candidates, 0.1) for n in (2, 3, 2)]
    assert [(n, choices[136]) for n, choices in auto.decisions] == list(zip((2, 3, 2), expected, strict=True))
    assert "dense" not in expected


def test_a_new_quorum_drops_the_old_groups_entry_of_the_lane_cache():
    """torchft makes a group a quorum; each got a (None) entry in the lane cache, kept for the whole run."""
    import warnings

    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from fastcomm.collectives import _lane

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    exchange = fastcomm.ft.ManagedExchange(SimpleNamespace(_pg=pg, wait_quorum=lambda: None))
    groups = []
    for quorum in range(3):
        pg.configure(f"127.0.0.1:{store.port}/quorum{quorum}", "solo", 0, 1)
        groups.append(exchange.group())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a torchft group has no lane: None is cached
            fastcomm.collectives.lane_for(groups[-1])
    assert [group in _lane._LANES for group in groups] == [False, False, True]


def test_a_new_quorum_folds_the_segment_residual_into_what_the_replica_owes():
    residual = fastcomm.collectives.Residual(worker=torch.ones(10), server=torch.ones(8), segment_start=8,
                                             world_size=2)  # fmt: skip
    owed = residual.owed()
    fastcomm.ft.exchange.refit(residual)
    assert residual.server is None and torch.equal(residual.worker, owed)


class _Quorum(SimpleNamespace):
    """A Manager as ReplicaData sees it: this replica's rank among ``n`` replicas."""

    def participating_rank(self) -> int:
        return self.rank

    def num_participants(self) -> int:
        return self.n


def test_replica_data_reads_each_committed_sample_once_across_quorums(tmp_path):
    """3 replicas commit 2 steps; a step of 3 fails (one died); 2 replicas read it again and commit 3 more."""
    workers.write_dataset(tmp_path / "data", 200)
    make = workers.make_loader(str(tmp_path / "data"), 4)
    committed: list[int] = []

    def steps(replicas: list, n: int, count: int, commit: bool) -> None:
        for rank, data in enumerate(replicas):
            data.split(_Quorum(rank=rank, n=n))
        for _ in range(count):
            batches = [data.next() for data in replicas]
            for data, batch in zip(replicas, batches, strict=True):
                if commit:
                    data.commit()
                    committed.extend(int(i) for i in batch["idx"])
                else:
                    data.rollback()

    three = [fastcomm.ft.ReplicaData(make) for _ in range(3)]
    steps(three, 3, 2, commit=True)
    steps(three, 3, 1, commit=False)
    two = three[:2]
    steps(two, 2, 3, commit=True)
    joined = fastcomm.ft.ReplicaData(make)
    joined.load_state_dict(two[0].state_dict())  # a restarted replica heals the committed position
    steps([*two, joined], 3, 1, commit=True)
    order = workers.global_order(str(tmp_path / "data"))
    assert len(committed) == len(set(committed)) == 4 * (3 * 2 + 2 * 3 + 3)
    assert set(committed) == set(order[: len(committed)])


def test_heal_state_sends_a_copy_taken_at_the_quorum():
    registered = {}
    manager = SimpleNamespace(
        register_state_dict_fn=lambda key, load, save: registered.update({key: (load, save)})
    )
    model = torch.nn.Linear(2, 2)
    fastcomm.ft.heal_state(manager, model=model)
    load, save = registered[fastcomm.ft.state.HEAL_KEY]
    sent = save()
    with torch.no_grad():
        model.weight.add_(1.0)  # the sender trains on while the joiner downloads
    assert not torch.equal(sent["model"]["weight"], model.weight)
    load(sent)
    assert torch.equal(sent["model"]["weight"], model.weight)


@pytest.fixture(scope="module")
def solo_manager():
    """One replica's Manager in this process, with a Lighthouse of its own, for the module's tests."""
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    manager = fastcomm.ft.connect("solo", lighthouse=lighthouse, store=store)
    yield manager
    manager.shutdown(wait=False)
    server.shutdown()


METHODS = [("quantize", {"bits": 4}), ("sign", {}), ("topk", {"ratio": 0.1}), ("cast", {}),
           ("powersgd", {"rank": 2}), ("auto", {"link": SLOW_LINK}), ("none", {})]  # fmt: skip


@pytest.mark.parametrize(("method", "options"), METHODS)
def test_each_method_steps_through_the_managed_hook(solo_manager, small_ddp, method, options):
    """One replica: every method's exchange runs through the Manager, and "none" leaves the gradient exact."""
    manager = solo_manager
    ddp = small_ddp()
    ddp.find_unused_parameters = True  # the check reads it; this model has no unused parameter either way
    state = fastcomm.ft.register(ddp, manager, method, **options)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    begin = manager.current_step()
    for _ in range(3):
        manager.start_quorum()
        ddp(x).square().mean().backward()
        reduced = [p.grad.clone() for p in ddp.parameters()]
        assert manager.should_commit()
        ddp.zero_grad()
    assert manager.current_step() == begin + 3 and state.stats()["failed_exchanges"] == 0
    if method == "auto":  # a quorum of one replica sends nothing: dense, decided once for the quorum
        assert [n for n, _ in state.auto.decisions] == [1] and state.stats()["auto_dense_buckets"] >= 1
    if method == "none":
        ddp.module(x).square().mean().backward()
        assert all(torch.equal(p.grad, r) for p, r in zip(ddp.module.parameters(), reduced, strict=True))
