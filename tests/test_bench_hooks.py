"""bench_hooks' verdicts on the nodes network, on made-up rows (no ranks are started), and its stats delta."""

from __future__ import annotations

import math

from benchmarks import hooks_jobs, hooks_nodes, hooks_runs
from benchmarks.harness import Row


def _row(name: str, seconds: float, **extra: object) -> Row:
    return Row(case="nodes", backend=name, metric="step_time", value=seconds, unit="s",
               extra={"status": "ok", **extra})


def _notes(**seconds: float) -> list[str]:
    rows = [_row("allreduce", 2.0), _row("sign", seconds["sign"]), _row("quant8", 0.9),
            _row("sign_hier", seconds["sign_hier"], **{"compress_s/step": 0.15}),
            _row("quant8_hier", 0.45), _row("node_reduce", seconds["node_reduce"])]
    return hooks_nodes.check_node_targets(rows)


def test_bound_says_out_of_reach_when_the_node_reduction_alone_exceeds_the_budget():
    notes = _notes(sign=0.9, sign_hier=0.85, node_reduce=0.66)
    bound = next(n for n in notes if "bound: a sign_hier" in n)
    # 0.66 s against 0.9 / 1.5 = 0.60 s
    assert "node_reduce's 0.660 s" in bound and "<= 0.600 s" in bound
    assert "out of reach here (1.10x it)" in bound
    assert any("sign_hier >= 1.5x faster than flat sign: MISSED" in n for n in notes)


def test_bound_says_reachable_when_the_budget_allows_it():
    notes = _notes(sign=1.5, sign_hier=0.9, node_reduce=0.5)
    bound = next(n for n in notes if "bound: a sign_hier" in n)
    assert bound.endswith("reachable") and "<= 1.000 s" in bound
    assert any("quant8_hier >= 2x faster than allreduce: MET" in n for n in notes)


def test_no_bound_without_the_node_reduce_row():
    rows = [_row("sign", 0.9), _row("sign_hier", 0.5)]
    assert not [n for n in hooks_nodes.check_node_targets(rows) if "bound" in n]


def test_bound_names_the_cpu_floor_when_the_row_has_one():
    rows = [_row("sign", 0.9), _row("sign_hier", 0.8), _row("node_reduce", 0.7, cpu_floor_s=0.65)]
    bound = next(n for n in hooks_nodes.check_node_targets(rows) if "bound: a sign_hier" in n)
    assert "the ranks' CPU time over the cores alone is 0.650 s" in bound
    assert "out of reach here (1.17x it)" in bound


def test_stats_delta_counts_the_timed_steps_and_keeps_autos_state():
    before = {"steps": 4.0, "sent_bytes": 100.0, "dense_bytes": 400.0, "compression_ratio": 4.0,
              "auto_quantize4_buckets": 3.0, "auto_trial_chosen_step_s": 0.3}
    after = {"steps": 9.0, "sent_bytes": 150.0, "dense_bytes": 800.0, "compression_ratio": 5.33,
             "auto_quantize4_buckets": 3.0, "auto_trial_chosen_step_s": 0.3}
    delta = hooks_jobs.stats_delta(before, after)
    assert delta["steps"] == 5.0 and delta["sent_bytes"] == 50.0 and delta["compression_ratio"] == 8.0
    assert delta["auto_quantize4_buckets"] == 3.0 and delta["auto_trial_chosen_step_s"] == 0.3


def test_step_time_rows_carry_dense_allreduce_over_each_time_on_both_networks():
    outcomes = {
        "allreduce": hooks_runs.Outcome("ok", 1.0),
        "sign": hooks_runs.Outcome("ok", 0.5),
        "sign_hier": hooks_runs.Outcome("crashed (rank 1 exit 1): boom"),
    }
    two = {r.backend: r for r in hooks_runs._rows_for("loopback", outcomes, 5, None)}
    nodes = {r.backend: r for r in hooks_nodes.node_rows(outcomes, {}, 5, 4, None)}
    for rows in (two, nodes):
        assert rows["sign"].ratio == 2.0 and rows["sign"].ratio_to == "allreduce speedup"
        assert rows["allreduce"].ratio == 1.0
    assert math.isnan(nodes["sign_hier"].value) and nodes["sign_hier"].ratio is None
