"""Two-level compression: dense inside each node, the hook's exchange between nodes, a gather inside.

- ``hierarchy.py``: :class:`Hierarchy`, the hierarchical part of every compressing state.
- ``groups.py``: the node groups (in-node reduce and gather, cross-node) and their worker threads.
- ``shards.py``: shard sizes, option checks, folding shard residuals for a merge across world sizes.
- ``protocols.py``: what the hierarchy uses of the flat state it wraps.

Example::

    state = fastcomm.register(ddp, "sign", node_size=8)  # 8 ranks per node
"""

from fastcomm.hooks.hierarchical.hierarchy import Hierarchy, shard_numel
from fastcomm.hooks.hierarchical.shards import check_hierarchical_options, fold_shards

__all__ = ["Hierarchy", "check_hierarchical_options", "fold_shards", "shard_numel"]
