"""The one place fastcomm reaches into FSDP2's internals: its 2-D (HSDP) all-reduce handed to a hook, and
the parameter layout of a group's reduce-scatter (:func:`group_layout`, for re-sharding residuals).

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
from fastcomm.fsdp.reshard import GroupLayout

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError:  # another torch's layout: said by name when a 2-D model is compressed
    FSDPMeshInfo = HSDPMeshInfo = None

__all__ = ["group_layout", "hand_all_reduce_to_hook"]

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


def group_layout(module: FSDPModule) -> GroupLayout | None:
    """Where ``module``'s parameters lie in its reduce-scatter's flat gradient, or ``None`` if not known.

    The parameters of its one parameter group in FSDP2's order (``FSDPParamGroup.fsdp_params``), each with
    its full shape, over the group's shard ranks. ``None`` (its residual is then not re-sharded at another
    world size, :class:`~fastcomm.fsdp.reshard.FSDPReshardError`) for several groups, a parameter sharded
    on another dim than 0, or a torch without these internals.

    Example::

        fully_shard(model)
        group_layout(model)  # GroupLayout(shapes=((37, 13), (37,), ...), world_size=2)
    """
    try:
        groups = _param_groups(module)
    except HSDPMeshError:
        return None
    if len(groups) != 1:
        return None
    params = getattr(groups[0], "fsdp_params", None)
    world_size = getattr(getattr(groups[0], "mesh_info", None), "shard_mesh_size", None)
    if not params or not isinstance(world_size, int):
        return None
    shapes = []
    for param in params:
        shape, placement = getattr(param, "_orig_size", None), getattr(param, "fsdp_placement", None)
        if shape is None or getattr(placement, "dim", None) != 0:
            return None
        shapes.append(tuple(int(n) for n in shape))
    return GroupLayout(tuple(shapes), world_size)
