"""DiLoCo and streaming DiLoCo: sync every ``H`` steps with compressed pseudo-gradients (docs/diloco.md).

:mod:`.outer` holds :class:`DiLoCo`, the outer loop around any inner optimizer; :mod:`.fragments` how the
parameters are cut into fragments and how one fragment's pseudo-gradient is averaged.

Example::

    outer = fastcomm.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=50,
                            compressor="quantize", bits=4)
"""

from fastcomm.diloco.outer import DiLoCo, outer_lr_ramp

__all__ = ["DiLoCo", "outer_lr_ramp"]
