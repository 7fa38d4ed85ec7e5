"""Hierarchical compression (node_size=2) on 4 gloo ranks as 2 nodes x 2 ranks.

Every hook's averaged gradient equals the test's own two-level simulation (dense mean inside the node,
per-shard compression with error feedback through the reference ops, mean across nodes, gather); DDP with
default, one and many buckets neither hangs nor diverges between ranks; a resume is bit-identical; bytes
crossing nodes are about 1/L of flat; bad options raise ValueError.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _hierarchical_workers as workers  # noqa: E402
import _hooks_workers as harness  # noqa: E402


def test_two_level_mean_equals_the_simulation_and_cross_node_bytes_are_one_over_node_size(tmp_path):
    harness.spawn(tmp_path, 4, workers.simulation_worker, timeout_s=120)


def test_ddp_buckets_resume_and_bad_options(tmp_path):
    harness.spawn(tmp_path, 4, workers.ddp_worker, timeout_s=180)
