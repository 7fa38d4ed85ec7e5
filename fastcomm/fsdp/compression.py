""":func:`compress`: one call that compresses an FSDP2 model's gradient reduction; the state it returns.

What is compressed follows the model's mesh: on a 1-D mesh, the reduce-scatter; on a 2-D
``("replicate", "shard")`` mesh (HSDP as PyTorch users write it) or a 1-D ``mesh["shard"]`` with
``replicate_group=``, only the cross-replica all-reduce of the shard (see :mod:`fastcomm.fsdp.mesh`).

Example::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    compression = fastcomm.fsdp.compress(model, "quantize", bits=8, stochastic=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fastcomm.collectives import DEFAULT_CHUNK_BYTES
from fastcomm.compress.protocol import Compressor
from fastcomm.compress.registry import compressor_of
from fastcomm.fsdp._native_hsdp import group_layout, hand_all_reduce_to_hook
from fastcomm.fsdp.all_gather import QuantizedAllGather
from fastcomm.fsdp.mesh import replica_plan
from fastcomm.fsdp.reduce_scatter import CompressedReduceScatter
from fastcomm.fsdp.replicate import CompressedReplicaAllReduce
from fastcomm.fsdp.reshard import merge_reduction_states

__all__ = ["FSDPCompression", "compress"]


@dataclass
class FSDPCompression:
    """What :func:`compress` installed, by FSDP module name (``""``: the root): stats and checkpoints.

    Attributes:
        reductions: one compressed reduction per FSDP module (its parameter group's reduce-scatter, or
            under HSDP its cross-replica all-reduce).
        gathers: the quantized weight all-gathers (empty unless ``quantized_all_gather=True``).

    Example::

        compression = fastcomm.fsdp.compress(model, "quantize", bits=8)
        ...
        print(compression.stats()["compression_ratio"])
    """

    reductions: dict[str, CompressedReduceScatter | CompressedReplicaAllReduce]
    gathers: dict[str, QuantizedAllGather]

    def stats(self) -> dict[str, Any]:
        """Steps (gradient syncs), bytes sent vs dense, the ratio, the residual's bytes on this rank.

        ``sent_bytes`` / ``dense_bytes`` count the compressed collective only (under HSDP:
        the cross-replica all-reduce; the in-node reduce-scatter stays dense). ``gather_*``: the weight
        all-gathers.
        """
        reductions = list(self.reductions.values())
        sent = sum(r.traffic.sent_bytes for r in reductions)
        dense = sum(r.traffic.dense_bytes for r in reductions)
        gather_sent = sum(g.traffic.sent_bytes for g in self.gathers.values())
        gather_dense = sum(g.traffic.dense_bytes for g in self.gathers.values())
        return {
            "steps": max((r.traffic.calls for r in reductions), default=0),
            "sent_bytes": sent,
            "dense_bytes": dense,
            "compression_ratio": dense / sent if sent else 1.0,
            "residual_bytes": sum(r.residual_bytes() for r in reductions),
            "gather_sent_bytes": gather_sent,
            "gather_dense_bytes": gather_dense,
        }

    def state_dict(self) -> dict[str, Any]:
        """Each reduction's step counter, traffic and residual (this rank's: save one per rank)."""
        return {
            "reductions": {name: r.state_dict() for name, r in self.reductions.items()},
            "gathers": {name: g.traffic.state_dict() for name, g in self.gathers.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ``ValueError`` if the FSDP modules differ."""
        saved = state_dict["reductions"]
        if sorted(saved) != sorted(self.reductions) or sorted(state_dict["gathers"]) != sorted(self.gathers):
            raise ValueError(
                f"the saved compression state is of FSDP modules {sorted(saved)} (gathers "
                f"{sorted(state_dict['gathers'])}), this model has {sorted(self.reductions)} (gathers "
                f"{sorted(self.gathers)})"
            )
        for name, reduction in self.reductions.items():
            reduction.load_state_dict(saved[name])
        for name, gather in self.gathers.items():
            gather.traffic.load_state_dict(state_dict["gathers"][name])

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """The state new rank ``rank`` of ``world_size`` loads, from every old rank's: an elastic restart.

        1. Same world size: old rank ``rank``'s own, unchanged (the resume is bit for bit).
        2. Otherwise, per FSDP module: every new rank owes the mean over the old ranks of what each owed,
           laid out for the new world size (:mod:`fastcomm.fsdp.reshard`): the mean still owed is
           unchanged. Step counters and traffic: old rank 0's (the step is the same on every rank).
        3. HSDP's residuals are not re-sharded: :class:`~fastcomm.fsdp.reshard.FSDPReshardError`.

        Also what :class:`fastcomm.Checkpointer` calls for an ``FSDPCompression`` it holds.

        Returns:
            ``(state_dict, why)``: the dict to :meth:`load_state_dict` and one log line.

        Raises:
            ValueError: no states, or a rank outside ``world_size``.
            FSDPReshardError: an HSDP residual, or a state saved without its layout, at another world size.

        Example::

            states = [torch.load(f"{path}/fastcomm_fsdp_rank{r}.pt") for r in range(2)]  # now 3 ranks
            merged, why = FSDPCompression.merge_state_dicts(states, 3, dist.get_rank())
            compression.load_state_dict(merged)
        """
        if not states:
            raise ValueError("FSDPCompression.merge_state_dicts needs the old ranks' state_dicts; got none")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if len(states) == world_size:
            return states[rank], f"FSDPCompression: same world size ({world_size}): old rank {rank}'s own"
        reductions = {
            name: merge_reduction_states(name, [s["reductions"][name] for s in states], world_size, rank)
            for name in states[0]["reductions"]
        }
        why = (
            f"FSDPCompression: {len(states)} -> {world_size} ranks: every rank owes the mean over the old "
            f"ranks of what each owed, laid out for {world_size} ranks; step counters: old rank 0's"
        )
        return {"reductions": reductions, "gathers": states[0]["gathers"]}, why


def _fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    modules = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not modules:
        raise TypeError(
            f"fastcomm.fsdp.compress needs a model with torch.distributed.fsdp.fully_shard applied, got "
            f"{type(model).__name__} without it"
        )
    return modules


def compress(
    model: nn.Module,
    compressor: str | Compressor = "quantize",
    *,
    error_feedback: bool = True,
    residual_dtype: torch.dtype | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    quantized_all_gather: bool = False,
    seed: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    **options: Any,
) -> FSDPCompression:
    """Compress the gradient reduction of every FSDP module of ``model`` (after ``fully_shard``).

    1. Resolve ``compressor``: a name (``"quantize"``, ``"sign"``, ``"cast"``, or one added with
       :func:`fastcomm.add_compressor`) built from ``options``, or a compressor instance.
    2. Read the model's mesh (:func:`fastcomm.fsdp.mesh.replica_plan`): a 1-D mesh is FSDP, or HSDP
       when ``replicate_group`` is given; a 2-D ``("replicate", "shard")`` mesh is HSDP over its
       ``"replicate"`` group.
    3. For each FSDP module (blocks and root): under FSDP, its reduce-scatter becomes
       :class:`CompressedReduceScatter` (``set_custom_reduce_scatter``); under HSDP, the reduce-scatter over
       the shard ranks stays dense and :class:`CompressedReplicaAllReduce` averages the shard over the
       replicas (``set_all_reduce_hook``; on the 2-D mesh in place of FSDP2's dense all-reduce).
    4. With ``quantized_all_gather``, its parameter all-gather becomes :class:`QuantizedAllGather`.

    The two HSDP spellings run the same reduction: on the same inputs and seed they train bit for bit alike.

    Memory: error feedback keeps, per rank, a residual of each group's whole flat gradient (4 bytes per
    model parameter in fp32, 2 with ``residual_dtype=torch.bfloat16``); under HSDP one of the shard only
    (``4 / shard ranks`` bytes per parameter, plus the all-reduce's segment).

    Args:
        model: a module with ``fully_shard`` applied (to it, and maybe to its blocks first).
        compressor: the compressor's name or instance (blockwise under FSDP; any under HSDP).
        error_feedback: add what compression left out to the next step's gradient.
        residual_dtype: keep the residual in this dtype between steps (``None``: the reduce dtype's).
        replicate_group: HSDP on a 1-D ``mesh["shard"]``: the replicate process group. Leave it out for
            a model on the 2-D mesh, which names its own.
        quantized_all_gather: send weights for unshard as 8-bit codes (ZeRO++ qwZ; off by default).
        seed: base seed of stochastic rounding.
        chunk_bytes: payload bytes per piece of a collective.
        **options: the named compressor's options (``bits``, ``block``, ``stochastic``; ``chunk``; ...).

    Returns:
        The :class:`FSDPCompression`, for ``stats()`` and ``state_dict()``.

    Raises:
        fastcomm.fsdp.HSDPMeshError: a mesh that is neither spelling (a 2-D mesh not named
            ``("replicate", "shard")``, or beside another mesh), or a 2-D mesh with ``replicate_group``.

    Example::

        mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        compression = fastcomm.fsdp.compress(model, "quantize", bits=8, stochastic=False)
    """
    if isinstance(compressor, str):
        built = compressor_of(compressor, options)
    elif options:
        raise TypeError(f"options {sorted(options)} go with a compressor's name, not with an instance")
    else:
        built = compressor
    if not isinstance(built, Compressor):
        raise TypeError(f"fastcomm.fsdp needs a fastcomm.compress.Compressor, {compressor!r} is not one")
    modules = _fsdp_modules(model)
    plan = replica_plan(model, replicate_group)
    reductions: dict[str, CompressedReduceScatter | CompressedReplicaAllReduce] = {}
    gathers: dict[str, QuantizedAllGather] = {}
    for index, (name, module) in enumerate(modules):
        settings = {"error_feedback": error_feedback, "residual_dtype": residual_dtype, "seed": seed,
                    "index": index, "chunk_bytes": chunk_bytes}  # fmt: skip
        if plan.group is None:
            reduce_scatter = CompressedReduceScatter(built, **settings, layout=group_layout(module))
            module.set_custom_reduce_scatter(reduce_scatter)
            reductions[name] = reduce_scatter
        else:
            if plan.native_2d:
                hand_all_reduce_to_hook(module)
            all_reduce = CompressedReplicaAllReduce(built, plan.group, **settings)
            module.set_all_reduce_hook(all_reduce)
            reductions[name] = all_reduce
        if quantized_all_gather:
            gathers[name] = QuantizedAllGather(chunk_bytes=chunk_bytes)
            module.set_custom_all_gather(gathers[name])
    return FSDPCompression(reductions, gathers)
