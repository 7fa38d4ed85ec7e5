"""The one place fastcomm reaches into FSDP2's internals: its 2-D (HSDP) all-reduce handed to a hook.

FSDP2 (torch 2.13) has public seams for the reduce-scatter (``set_custom_reduce_scatter``) and the
all-gather (``set_custom_all_gather``), but not for HSDP's cross-replica all-reduce: on a 2-D mesh,
``foreach_reduce`` calls ``dist.all_reduce`` over ``FSDPParamGroup.mesh_info.replicate_process_group``
and then the ``set_all_reduce_hook`` hook on its output. Each parameter group picks that path by whether
its ``mesh_info`` is a ``DDPMeshInfo`` (``HSDPMeshInfo`` is one). :func:`hand_all_reduce_to_hook` gives
the group an ``FSDPMeshInfo`` of the same mesh and shard dim instead, so the group reduce-scatters over
the shard ranks as before (AVG), skips the dense all-reduce, and calls the hook with the shard: the
reduction of ``fully_shard(model, mesh=mesh["shard"])`` with the same hook. The parameters keep their own
2-D mesh info, so they stay ``(Replicate(), Shard(0))`` DTensors for the optimizer and checkpoints.

If a later torch has a public all-reduce seam, it replaces this module; if its internals moved, the
check below says so with the torch version instead of training with a dense hop left in.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import FSDPModule

from fastcomm.fsdp.mesh import HSDPMeshError

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError:  # another torch's layout: said by name when a 2-D model is compressed
    FSDPMeshInfo = HSDPMeshInfo = None

__all__ = ["hand_all_reduce_to_hook"]

_BUILT_FOR = "2.13"


def _missing(what: str) -> HSDPMeshError:
    return HSDPMeshError(
        f"fastcomm.fsdp hands FSDP2's 2-D all-reduce to its hook through FSDP2 internals of torch "
        f"{_BUILT_FOR} ({what}), which torch {torch.__version__} does not have: shard the model on "
        f'mesh["shard"] and pass replicate_group=mesh.get_group("replicate") to fastcomm.fsdp.compress'
    )


def _param_groups(module: FSDPModule) -> list:
    state = getattr(module, "_get_fsdp_state", None)
    groups = getattr(state(), "_fsdp_param_groups", None) if callable(state) else None
    if not isinstance(groups, list):
        raise _missing("FSDPState._fsdp_param_groups")
    return groups


def hand_all_reduce_to_hook(module: FSDPModule) -> None:
    """Make ``module``'s HSDP parameter groups skip FSDP2's dense all-reduce and call their hook instead.

    1. For each of the module's parameter groups on an ``HSDPMeshInfo``: build the ``FSDPMeshInfo`` of the
       same mesh and shard dim (keeping a separate reduce-scatter group if one was set).
    2. Put it in the group's ``mesh_info`` (and ``post_forward_mesh_info`` where that was the same object,
       so resharding after forward stays on the shard ranks).

    Groups already handed over are left as they are. The caller installs the hook
    (``set_all_reduce_hook``): without one the gradient would stay averaged over the shard ranks only.

    Args:
        module: an FSDP module sharded on a 2-D ``("replicate", "shard")`` mesh.

    Raises:
        HSDPMeshError: this torch lacks the internals named above (the message names its version).

    Example::

        fully_shard(model, mesh=mesh_2d)
        hand_all_reduce_to_hook(model)
        model.set_all_reduce_hook(CompressedReplicaAllReduce(compressor, mesh_2d.get_group("replicate")))
    """
    if FSDPMeshInfo is None or HSDPMeshInfo is None:
        raise _missing("torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo")
    for group in _param_groups(module):
        hsdp = getattr(group, "mesh_info", None)
        if not hasattr(group, "post_forward_mesh_info") or hsdp is None:
            raise _missing("FSDPParamGroup.mesh_info")
        if not isinstance(hsdp, HSDPMeshInfo):
            continue
        kept = {f.name: getattr(hsdp, f.name) for f in dataclasses.fields(FSDPMeshInfo) if f.init}
        kept["replicate_mesh_dim"] = None
        shard_only = FSDPMeshInfo(**kept)
        shard_only.reduce_scatter_process_group = hsdp.reduce_scatter_process_group
        if group.post_forward_mesh_info is hsdp:
            group.post_forward_mesh_info = shard_only
        group.mesh_info = shard_only
