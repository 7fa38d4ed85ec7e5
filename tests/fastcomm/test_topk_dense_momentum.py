"""DGC's momentum correction applies on the dense steps of ``topk_hook`` too (before ``start_iter``,
buckets below ``min_compress_numel``): ``u = m * u + mean(g)`` (Nesterov ``u = m * (u + mean(g))``,
returning ``u + mean(g)``), as DGC's own code does, against the test's own arithmetic on 2 gloo ranks.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hooks_correctness_workers as workers  # noqa: E402
import _hooks_workers as harness  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("nesterov", [False, True])
def test_topk_momentum_applies_on_dense_steps(tmp_path, nesterov):
    harness.spawn(tmp_path, 2, workers.dense_momentum_worker, nesterov)
