"""What travels when a replica heals from a peer: everything that decides its next step (:func:`heal_state`).

torchft's Manager sends a healthy replica's registered state to one that joins (over HTTP, at the quorum)
and loads it there before the step. :func:`heal_state` registers the objects of a fastcomm job under one
key. What each object sends:

==============================================  ===========================================================
object                                          travels
==============================================  ===========================================================
the model, the (inner) optimizer, a scheduler   their ``state_dict()``: weights, optimizer moments, LR step
:class:`~fastcomm.ft.FaultTolerantDiLoCo`       DiLoCo's step, global weights, outer momentum, the
                                                exchanges in flight (settled); loaded as the global weights
:class:`~fastcomm.ft.ManagedHookState`          the method and options (checked); residuals start empty
:class:`~fastcomm.ft.ReplicaData`               the committed position in the sample order
the Manager's own                               its step and committed batches (torchft adds them)
==============================================  ===========================================================

Error-feedback residuals never travel: each replica's residual is what *it* still owes the others; a copy
of a peer's would be sent twice. A healed replica starts owing nothing.

The state is copied when the quorum asks for it (the sender goes on training while the joiner downloads).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["HEAL_KEY", "heal_state"]

HEAL_KEY = "fastcomm"


def heal_state(manager: Any, **objects: Any) -> None:
    """Register ``objects`` (anything with ``state_dict``/``load_state_dict``) with ``manager`` for healing.

    Call it once per replica, with the same names on every replica, before the first quorum.

    Example::

        fastcomm.ft.heal_state(manager, model=model, inner=inner, outer=ft_diloco, data=data)
    """
    for name, obj in objects.items():
        if not all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict")):
            raise TypeError(f"{name} has no state_dict()/load_state_dict(): {type(obj).__name__}")
    names = sorted(objects)

    def save() -> dict[str, Any]:
        return {name: copy.deepcopy(objects[name].state_dict()) for name in names}

    def load(state: dict[str, Any]) -> None:
        if sorted(state) != names:
            raise ValueError(f"a peer sent the state of {sorted(state)}, this replica registered {names}: "
                             f"register the same objects on every replica")  # fmt: skip
        for name in names:
            objects[name].load_state_dict(state[name])

    manager.register_state_dict_fn(HEAL_KEY, load, save)
