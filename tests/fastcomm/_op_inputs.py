"""Inputs the op tests share: the devices and dtypes here, and gradient-like random tensors."""

from __future__ import annotations

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(n: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """``n`` values with heavy tails and a spread of magnitudes, as gradients have, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) * scale
    return x.to(dtype).to(device)
