"""fastcomm.fsdp's HSDP mode on 4 gloo ranks (2 replicas x 2 shards): the in-node reduce-scatter dense, the
cross-replica all-reduce of the shard compressed, within its bound, wired into .grad, the replicas bit-equal;
asked for with a 2-D ("replicate", "shard") mesh or with replicate_group=, bit for bit the same; other meshes
refused by name, as is a torch without the FSDP2 internals the 2-D form uses.

The ranks run every case of ``_fsdp_hsdp_workers.cases`` in one process group; each case is its own test.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fastcomm.fsdp import HSDPMeshError, _native_hsdp

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_hsdp_workers as workers  # noqa: E402
import _fsdp_workers as fsdp_workers  # noqa: E402

WORLD = workers.REPLICAS * workers.SHARDS


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Case -> per-rank outcome ("ok" or the traceback)."""
    workdir = tmp_path_factory.mktemp("hsdp")
    fsdp_workers.spawn_preloaded(workdir, WORLD, workers.run_all, str(workdir))
    per_rank = [json.loads((workdir / f"results_{r}.json").read_text()) for r in range(WORLD)]
    return {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("case", sorted(workers.cases(WORLD)))
def test_hsdp_case(outcomes, case):
    failures = [text for text in outcomes[case] if text != "ok"]
    assert not failures, failures[0]


def test_every_case_ran(outcomes):
    assert sorted(outcomes) == sorted(workers.cases(WORLD))


def test_torch_without_the_hsdp_internals_is_named(monkeypatch):
    """Where FSDP2's internals moved, the 2-D form says which torch and points to replicate_group=."""
    monkeypatch.setattr(_native_hsdp, "HSDPMeshInfo", None)
    with pytest.raises(HSDPMeshError, match=re.escape(f"torch {torch.__version__} does not have")) as caught:
        _native_hsdp.hand_all_reduce_to_hook(nn.Linear(2, 2))
    assert "replicate_group=" in str(caught.value)


def test_module_without_fsdp_param_groups_is_named():
    with pytest.raises(HSDPMeshError, match="_fsdp_param_groups"):
        _native_hsdp.hand_all_reduce_to_hook(nn.Linear(2, 2))
