"""Which cross-replica group an FSDP2 model asks for: its 2-D mesh's, or the ``replicate_group=`` given.

HSDP comes in two spellings that mean one reduction (a dense reduce-scatter over the shard ranks, then the
shard averaged over the replicas through a compressor):

* the model on the 2-D mesh, as PyTorch users write it: ``fully_shard(model, mesh=mesh)``;
* the model on ``mesh["shard"]`` and the replicate group given: ``compress(..., replicate_group=...)``.

:func:`replica_plan` reads the parameters' meshes and says which group (if any) the cross-replica
all-reduce runs over; a mesh it cannot read unambiguously raises :class:`HSDPMeshError` saying what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MESH_DIM_NAMES", "HSDPMeshError", "ReplicaPlan", "replica_plan"]

MESH_DIM_NAMES = ("replicate", "shard")
_MAKE_MESH = (
    'init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate", "shard")), '
    "then fully_shard(model, mesh=mesh)"
)


class HSDPMeshError(ValueError):
    """A model's device mesh that :func:`fastcomm.fsdp.compress` cannot read as HSDP; the message says how.

    Example::

        try:
            fastcomm.fsdp.compress(model, "quantize", bits=8)
        except HSDPMeshError as error:
            print(error)  # e.g. name the 2-D mesh's dims ("replicate", "shard")
    """


@dataclass(frozen=True)
class ReplicaPlan:
    """Where the cross-replica all-reduce runs and who asked for it.

    Attributes:
        group: the replicate process group (one rank per replica, same shard), or ``None``: plain FSDP.
        native_2d: the model sits on a 2-D mesh, so FSDP2's own dense all-reduce must give way to the hook.
    """

    group: dist.ProcessGroup | None
    native_2d: bool


def _meshes(model: nn.Module) -> list[DeviceMesh]:
    """The distinct meshes (by value: ``fully_shard`` without a mesh makes an equal one per call)."""
    found: list[DeviceMesh] = []
    for parameter in model.parameters():
        if isinstance(parameter, DTensor) and all(parameter.device_mesh != m for m in found):
            found.append(parameter.device_mesh)
    return found


def _check_2d(mesh: DeviceMesh, model: nn.Module) -> None:
    if mesh.ndim != 2:
        raise HSDPMeshError(
            f"fastcomm.fsdp compresses FSDP on a 1-D mesh or HSDP on a 2-D one, this model sits on a "
            f"{mesh.ndim}-D mesh {mesh.mesh_dim_names}: shard on the data-parallel dims only, {_MAKE_MESH}"
        )
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise HSDPMeshError(
            f"the model's 2-D mesh has dims {mesh.mesh_dim_names}; FSDP2 all-reduces over dim 0 and shards "
            f"over dim 1 whatever their names, so fastcomm.fsdp asks for them by name, in that order: "
            f"{_MAKE_MESH}"
        )
    for name, parameter in model.named_parameters():
        placements = parameter.placements if isinstance(parameter, DTensor) else ()
        if (
            len(placements) != 2
            or not isinstance(placements[0], Replicate)
            or not isinstance(placements[1], Shard)
        ):
            raise HSDPMeshError(
                f"parameter {name!r} is placed {placements} on the 2-D mesh, HSDP needs (Replicate(), "
                f"Shard(d)) on every parameter: {_MAKE_MESH}"
            )


def replica_plan(model: nn.Module, replicate_group: dist.ProcessGroup | None) -> ReplicaPlan:
    """The cross-replica all-reduce ``model`` asks for: from its 2-D mesh, from ``replicate_group``, or none.

    1. Collect the device meshes of the model's (sharded) parameters; all 1-D: ``replicate_group`` as
       given (``None``: plain FSDP, no cross-replica hop). Otherwise more than one mesh is refused.
    2. A 2-D mesh must be named ``("replicate", "shard")`` with every parameter ``(Replicate(), Shard)``;
       its ``"replicate"`` group is the answer, and ``replicate_group`` must then be left out.

    Args:
        model: a module after ``fully_shard``.
        replicate_group: what the caller passed to :func:`fastcomm.fsdp.compress` (``None``: not given).

    Returns:
        The :class:`ReplicaPlan`.

    Raises:
        HSDPMeshError: the mesh is not one of the two spellings, or both spellings were used at once.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        assert replica_plan(model, None).group is mesh.get_group("replicate")
    """
    meshes = _meshes(model)
    if all(m.ndim == 1 for m in meshes):
        return ReplicaPlan(replicate_group, native_2d=False)
    if len(meshes) > 1:
        raise HSDPMeshError(
            f"the model's parameters sit on {len(meshes)} device meshes "
            f"{[m.mesh_dim_names for m in meshes]}, one of them 2-D; fastcomm.fsdp compresses HSDP on one "
            f"mesh per model: shard every module on the same 2-D mesh"
        )
    mesh = meshes[0]
    _check_2d(mesh, model)
    if replicate_group is not None:
        raise HSDPMeshError(
            'the model sits on the 2-D ("replicate", "shard") mesh, which names its replicate group '
            'already: leave replicate_group= out (or shard on mesh["shard"] and keep replicate_group=)'
        )
    return ReplicaPlan(mesh.get_group("replicate"), native_2d=True)
