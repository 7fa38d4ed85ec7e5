"""Hierarchical compression (node_size=2) on 4 gloo ranks as 2 nodes x 2 ranks.

Every hook's averaged gradient equals the test's own two-level simulation (dense mean inside the node,
per-shard compression with error feedback through the reference ops, mean across nodes, gather); DDP with
default, one and many buckets neither hangs nor diverges between ranks; a resume is bit-identical; bytes
crossing nodes are about 1/L of flat; bad options raise ValueError.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hierarchical_workers as workers  # noqa: E402
import _hooks_workers as harness  # noqa: E402


@pytest.mark.distributed
def test_two_level_mean_equals_the_simulation_and_cross_node_bytes_are_one_over_node_size(tmp_path):
    harness.spawn(tmp_path, 4, workers.simulation_worker, timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_buckets_resume_and_bad_options(tmp_path):
    harness.spawn(tmp_path, 4, workers.ddp_worker, timeout_s=180)


def test_node_sum_is_in_local_rank_order_whoever_owns_the_shard():
    """Over gloo each owner sums the node's copies itself: every owner must add them in rank order."""
    import torch

    from fastcomm.hooks.hierarchical.reduction import sum_in_rank_order as _sum_in_rank_order

    generator = torch.Generator().manual_seed(7)
    for node_size in (2, 3, 4):
        # magnitudes far apart, so a different order of additions rounds differently
        copies = [torch.randn(1001, generator=generator) * 10.0 ** (3 * r) for r in range(node_size)]
        expected = copies[0].clone()
        for copy in copies[1:]:
            expected += copy
        reordered = copies[-1].clone()
        for copy in reversed(copies[:-1]):
            reordered += copy
        if node_size > 2:
            assert not torch.equal(expected, reordered), "the test's inputs do not tell the orders apart"
        for local in range(node_size):
            shard = copies[local].clone()
            received = torch.stack([c for r, c in enumerate(copies) if r != local])
            _sum_in_rank_order(shard, received, local)
            assert torch.equal(shard, expected), f"node_size {node_size}, local rank {local}"
