"""DDP communication hooks, one family per file, each with its State class beside its hook function.

===================  ===================  ===========================================================
hook                 state                on the wire (per bucket, per rank)
===================  ===================  ===========================================================
``topk_hook``        ``TopKState``        one all-gather of k (int32 index, value) pairs
``quantize_hook``    ``QuantState``       all-to-all then all-gather of 8/4/2-bit codes + fp32 scales
``sign_hook``        ``SignState``        all-to-all then all-gather of sign bits + fp32 scales
``cast_hook``        ``CastState``        one allreduce in bf16 (or fp16)
``compressor_hook``  ``CompressorState``  any registered ``fastcomm.compress.Compressor``
``powersgd_hook``    ``PowerSGDState``    two allreduces (sum) of fp32: dense elements + rank-r P's, then Q's
===================  ===================  ===========================================================

:func:`register` takes a hook's name (:data:`HOOKS`), a compressor's name or a compressor object
(``fastcomm.compressor("cast")``, served by ``compressor_hook``); the compressor names and their options are
:mod:`fastcomm.compress`'s, the same for FSDP and DiLoCo.

Every compressing state takes ``node_size=L`` (``fastcomm.hooks.hierarchical``): a dense reduction inside
the node, the hook's own exchange between nodes on this rank's 1/L shard, a gather inside the node.

Collective order: every collective is issued inside a hook call, never from a callback, and DDP calls hooks
in bucket order on every rank, so all ranks issue the same collectives in the same order. The two-phase hooks
pipeline across buckets: the call for bucket ``i`` issues phase 1 of bucket ``i`` and phase 2 of bucket
``i - 1`` (whose phase 1 ran during bucket ``i``'s backward), and the last bucket finishes its own phase 2.
Top-k sends a payload whose size is fixed before any communication.

Example::

    import fastcomm
    state = fastcomm.register(ddp, "sign", start_iter=100)
    ...
    print(state.stats())
"""

from fastcomm.collectives.errors import PeerCollectiveError
from fastcomm.hooks.auto import AutoState, auto_hook
from fastcomm.hooks.cast import CastState, cast_hook
from fastcomm.hooks.compressor import CompressorState, compressor_hook
from fastcomm.hooks.engine.compression import CompressionState
from fastcomm.hooks.engine.defaults import default_state
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.powersgd import PowerSGDState, powersgd_hook
from fastcomm.hooks.quantize import QuantState, quantize_hook
from fastcomm.hooks.registry import HOOKS, HookName, Registered, add_compressor, compressor_of, register
from fastcomm.hooks.sign import SignState, sign_hook
from fastcomm.hooks.topk import TopKState, topk_hook

__all__ = [
    "HOOKS",
    "AutoState",
    "CastState",
    "CompressionState",
    "CompressorState",
    "HookName",
    "HookState",
    "PeerCollectiveError",
    "PowerSGDState",
    "QuantState",
    "Registered",
    "SignState",
    "TopKState",
    "add_compressor",
    "auto_hook",
    "cast_hook",
    "compressor_hook",
    "compressor_of",
    "default_state",
    "powersgd_hook",
    "quantize_hook",
    "register",
    "sign_hook",
    "topk_hook",
]
