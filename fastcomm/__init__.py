"""fastcomm: gradient compression for DDP as communication hooks.

Example::

    import fastcomm
    state = fastcomm.register(ddp_model, "topk", ratio=0.01)
"""

from fastcomm import ops
from fastcomm.ops import backend

__all__ = ["backend", "ops"]
