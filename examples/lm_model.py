"""The model of ``train_lm.py``: a small pre-norm GPT over bytes.

Pre-norm blocks, causal self-attention, GELU MLP, learned positions, an untied head; the default (d_model
192, 3 layers, 4 heads, context 128) has 1,457,856 parameters.

Example::

    from lm_model import GPT, ModelConfig

    model = GPT(ModelConfig(d_model=32, n_layer=1, n_head=2))
    loss = model(torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128)))
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from lm_data import VOCAB, WINDOW
from torch import nn

__all__ = ["GPT", "ModelConfig"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The GPT's shape (the defaults: 1,457,856 parameters)."""

    d_model: int = 192
    n_layer: int = 3
    n_head: int = 4
    context: int = 128
    vocab: int = VOCAB

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layer", "n_head", "context", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.context > WINDOW - 1:
            raise ValueError(f"ModelConfig.context must be <= {WINDOW - 1} (the data's windows), "
                             f"got {self.context}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.ln_attn, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_mlp, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(b, t, 3, self.n_head, c // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_mlp(x))))


class GPT(nn.Module):
    """A small pre-norm causal transformer over bytes; ``forward(inputs, targets)`` returns the mean loss.

    Example::

        model = GPT(ModelConfig())
        loss = model(torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128)))
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.d_model)
        self.positions = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2's init: residual outputs scaled by depth
        for name, param in self.named_parameters():
            if param.dim() == 2:
                residual = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(param, std=residual_std if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        h = self.tokens(inputs) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_final(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
