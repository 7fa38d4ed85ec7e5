"""Train a small byte-level GPT on the Python standard library's own source, with a fastcomm hook.

A user's script and the one source of the model, data and training loop that
``benchmarks/bench_convergence.py`` runs (it imports this file). What it does:

1. Data: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the running Python (sorted by
   path, ``site-packages`` excluded); every 20th file (by position in that order) is held out as
   validation (5%, by file). Each split's files, each followed by a NUL byte, are one byte stream (tokens
   of a vocabulary of 256) cut into windows of 129 bytes that overlap by one (window ``i`` is bytes
   ``128 i .. 128 i + 128``, so every byte is a target once), written once to fastio shards
   (``fastio.ShardWriter``, a fixed ``uint8 (129,)`` field) in a cache directory named by a fingerprint
   of the file list: a rerun reuses them and a changed stdlib gets new ones.
2. Loading: ``fastio.StreamLoader(..., shuffle=True, seed=seed, drop_last=True)``: a batch is 16 windows
   drawn from the whole corpus (inputs ``row[:-1]``, targets ``row[1:]``), each rank a disjoint share of
   one global permutation, the order fixed by the seed.
3. Model: a GPT (pre-norm blocks, causal self-attention, GELU MLP, learned positions, untied head);
   the default (d_model 192, 3 layers, 4 heads, context 128) has 1,457,856 parameters.
4. Training: DDP over gloo (or, with ``--fsdp``, FSDP2: ``fully_shard`` on every block and the root, the
   method's compressor through ``fastcomm.fsdp.compress``), the method's optimizer (AdamW lr 2e-3, betas
   (0.9, 0.95), weight decay 0.1; or SGD lr 0.1), a linear warm-up of 30 steps then cosine decay to 0 at
   ``--steps``, batch 16 x 128 tokens per rank, and the method's communication hook (``--hook``, see
   :data:`METHODS`).
5. Every ``--eval-every`` steps and at the end: validation loss on ``--val-rows`` rows per rank of the
   held-out files (their bytes cut into 129-byte windows, read in one fixed shuffled order, so every
   run sees the same rows, drawn from all the files), averaged over ranks.
6. Every ``--checkpoint-every`` steps: one file per rank (model, optimizer, LR schedule, hook state,
   loader state, RNG, step) written atomically (temporary name, fsync, rename), then a ``latest``
   pointer; ``--resume`` continues from it.

Run::

    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --hook sign --steps 500
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --hook q8 --checkpoint-every 100 --resume
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --hook dgc --opt warmup_steps=50
    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --fsdp --hook q8 --steps 500

Example::

    import importlib.util
    spec = importlib.util.spec_from_file_location("train_lm", "examples/train_lm.py")
    train_lm = importlib.util.module_from_spec(spec); spec.loader.exec_module(train_lm)
    paths = train_lm.prepare_data(train_lm.default_data_dir())
    # in each of 2 ranks, after dist.init_process_group("gloo"):
    result = train_lm.train(train_lm.TrainConfig(method="q8", steps=500), paths)
    print(result.val_losses[-1])
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastcomm
import fastcomm.fault
import fastio

__all__ = [
    "METHODS",
    "GPT",
    "DataPaths",
    "Method",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "default_data_dir",
    "main",
    "prepare_data",
    "stdlib_sources",
    "train",
]

VOCAB = 256
EOS = 0  # the NUL byte: never in a Python source file, so it marks document ends unambiguously
VAL_EVERY_NTH_FILE = 20  # 5% of the files, by file
WINDOW = 129  # a row: inputs and targets of a context of up to 128
VAL_SEED = 1234  # which validation rows are read: the same for every run and method
_DATA_FORMAT = 4  # bump when the shard contents for the same file list change


# ---------------------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class DataPaths:
    """The shard directories of one prepared data set, and what is in them."""

    train: Path
    val: Path
    train_files: int
    val_files: int
    train_bytes: int
    val_bytes: int


def stdlib_sources(max_files: int | None = None) -> list[tuple[str, Path]]:
    """The running interpreter's stdlib ``.py`` files as ``(relative posix path, path)``, sorted by path.

    ``max_files`` keeps an evenly spaced subset of that many (at least 20, so 5% is at least one file).

    Example::

        files = stdlib_sources(max_files=40)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = sorted(
        (path.relative_to(root).as_posix(), path)
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts and "__pycache__" not in path.parts and path.is_file()
    )
    if not found:
        raise FileNotFoundError(f"no .py files under the stdlib directory {root}")
    if max_files is not None:
        if max_files < VAL_EVERY_NTH_FILE:
            raise ValueError(f"max_files must be >= {VAL_EVERY_NTH_FILE} (5% is a file), got {max_files}")
        stride = max(1, len(found) // max_files)
        found = found[::stride][:max_files]
    return found


def default_data_dir() -> Path:
    """Where prepared shards are cached: ``$FASTCOMM_DATA_DIR``, else ``~/.cache/fastcomm/train_lm``."""
    if os.environ.get("FASTCOMM_DATA_DIR"):
        return Path(os.environ["FASTCOMM_DATA_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastcomm" / "train_lm"


def _fingerprint(files: Sequence[tuple[str, Path]]) -> str:
    digest = hashlib.sha256(f"format {_DATA_FORMAT} python {sys.version_info[:3]}".encode())
    for rel, path in files:
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def _write_windows(directory: Path, files: Sequence[tuple[str, Path]]) -> int:
    """The files (each followed by ``EOS``) as one byte stream cut into ``WINDOW``-byte rows overlapping by
    one byte; returns the files' bytes."""
    eos = np.array([EOS], dtype=np.uint8)
    stream = np.concatenate([x for _, p in files for x in (np.frombuffer(p.read_bytes(), np.uint8), eos)])
    rows = np.lib.stride_tricks.sliding_window_view(stream, WINDOW)[:: WINDOW - 1]
    schema = {"tokens": ("uint8", (WINDOW,)), "index": ("int64", ())}
    with fastio.ShardWriter(directory, schema=schema, max_samples=1 << 16) as w:
        w.write_many({"tokens": np.ascontiguousarray(rows), "index": np.arange(len(rows), dtype=np.int64)})
    return int(stream.size - len(files))


def prepare_data(cache_dir: str | os.PathLike[str], max_files: int | None = None) -> DataPaths:
    """Write the stdlib's source as train/val fastio shards under ``cache_dir`` (once) and return them.

    1. List the files (:func:`stdlib_sources`); the set's directory is named by a fingerprint of their
       relative paths and sizes, the Python version and this format's version.
    2. If that directory exists, return it. Otherwise write both splits into a temporary sibling, then
       rename it into place, so a crash never leaves a half-written set and concurrent preparers agree.

    Args:
        cache_dir: the cache directory (created if missing).
        max_files: an evenly spaced subset of this many files (for quick runs), or None for all.

    Returns:
        The :class:`DataPaths` of the set.

    Example::

        paths = prepare_data(default_data_dir())
        loader = fastio.StreamLoader(paths.train, batch_size=16, shuffle=True)
    """
    files = stdlib_sources(max_files)
    val = [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE // 2]
    train = [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE != VAL_EVERY_NTH_FILE // 2]
    root = Path(cache_dir)
    final = root / f"stdlib-{_fingerprint(files)}"
    meta_path = final / "meta.json"
    if not meta_path.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        meta = {
            "train_files": len(train), "val_files": len(val),
            "train_bytes": _write_windows(tmp / "train", train),
            "val_bytes": _write_windows(tmp / "val", val),
            "stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not meta_path.exists():  # not another preparer that finished first: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads(meta_path.read_text())
    return DataPaths(final / "train", final / "val", meta["train_files"], meta["val_files"],
                     meta["train_bytes"], meta["val_bytes"])


def _loader(directory: Path, batch_size: int, seed: int, rank: int, world: int) -> fastio.StreamLoader:
    return fastio.StreamLoader(directory, batch_size=batch_size, shuffle=True, seed=seed, drop_last=True,
                               rank=rank, world_size=world, pin_memory=False)


class _EpochStream:
    """Batches of a loader without end: the next epoch (its own order) starts when one runs out."""

    def __init__(self, loader: fastio.StreamLoader) -> None:
        self.loader = loader
        self._iterator: Iterator[Any] | None = None

    def next(self) -> dict[str, torch.Tensor]:
        for _ in range(2):
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.loader.set_epoch(self.loader.epoch + 1)
        raise RuntimeError(f"the training stream of rank {self.loader.rank} has no full batch in an epoch")


# ---------------------------------------------------------------------------------------------------------
# Model


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


# ---------------------------------------------------------------------------------------------------------
# Methods: optimizer + communication hook


@dataclasses.dataclass(frozen=True)
class Method:
    """One training method: the optimizer, the communication hook and their default options.

    ``optimizer`` is ``"adamw"``, ``"sgd"`` (momentum 0.9), ``"sgd_nomomentum"`` (for a hook that applies
    the momentum itself), ``"compressed_adam"`` (``fastcomm.CompressedAdam``, which registers its own
    hook) or ``"diloco"`` (AdamW inner steps in ``fastcomm.DiLoCo``, no DDP: ``options`` are DiLoCo's).
    ``hook`` is a :func:`fastcomm.register` name, ``"torch_fp16"``, ``"noop"`` or None (dense allreduce).
    ``options`` go to ``fastcomm.register`` (or ``CompressedAdam``); ``--opt k=v`` overrides.
    """

    description: str
    optimizer: str = "adamw"
    hook: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


_Q4 = {"compressor": "quantize", "bits": 4}


def _diloco(**options: Any) -> dict[str, Any]:
    """DiLoCo's options: sync every 10 steps, outer Nesterov lr 0.7 and momentum 0.5 (short runs from
    scratch; the paper's 0.9 overshoots here, see docs/diloco.md), fp32, unless ``options`` say otherwise."""
    return {"sync_every": 10, "outer_lr": 0.7, "outer_momentum": 0.5, "compressor": "none", **options}


RAMP = [0.5, 1.0, 100, 500]  # outer lr 0.5 to step 100, then linear to 1.0 at step 500 (docs/diloco.md)


def _ramped(**options: Any) -> dict[str, Any]:
    """:func:`_diloco`'s options with the outer lr of :data:`RAMP` instead of a constant 0.7."""
    found = _diloco(outer_lr_ramp=RAMP, **options)
    del found["outer_lr"]
    return found


def _diloco_arguments(options: dict[str, Any]) -> dict[str, Any]:
    """DiLoCo's keyword arguments from a method's options: ``outer_lr_ramp=[start, end, hold, until]``
    (a list, so that the options stay JSON) becomes ``outer_lr=fastcomm.outer_lr_ramp(...)``."""
    arguments = dict(options)
    ramp = arguments.pop("outer_lr_ramp", None)
    if ramp is not None:
        start, end, hold, until = ramp
        arguments["outer_lr"] = fastcomm.outer_lr_ramp(start, end, hold=hold, until=until)
    return arguments


METHODS: dict[str, Method] = {
    "none": Method("dense allreduce, AdamW"),
    "cast": Method("fastcomm cast_hook (bf16), AdamW", hook="cast"),
    "q8": Method("fastcomm quantize_hook 8-bit, AdamW", hook="quantize", options={"bits": 8}),
    "q4": Method("fastcomm quantize_hook 4-bit, AdamW", hook="quantize", options={"bits": 4}),
    "topk": Method("fastcomm topk_hook ratio 0.01, AdamW", hook="topk", options={"ratio": 0.01}),
    "sign": Method("fastcomm sign_hook (1-bit, error feedback), AdamW", hook="sign"),
    "sign_c64": Method("fastcomm sign_hook (1-bit, a scale per 64 values, error feedback), AdamW",
                       hook="sign", options={"chunk": 64}),
    "sign_sgd": Method("fastcomm sign_hook (1-bit, error feedback), SGD momentum 0.9", optimizer="sgd",
                       hook="sign"),
    "powersgd": Method("fastcomm PowerSGD rank 4 (error feedback, warm start; the hook's start_iter 0 and "
                       "min_compress_numel 1024), AdamW", hook="powersgd", options={"rank": 4}),
    "cadam": Method("fastcomm.CompressedAdam (sign compressor) after an AdamW warm-up on 8-bit quantized "
                    "gradients", optimizer="compressed_adam",
                    options={"compressor": "sign", "warmup_steps": 200, "warmup_compressor": "quantize"}),
    "cadam_w100": Method("fastcomm.CompressedAdam (sign compressor) after a dense AdamW warm-up",
                         optimizer="compressed_adam", options={"compressor": "sign", "warmup_steps": 100}),
    "cadam_q8w": Method("fastcomm.CompressedAdam (sign compressor) after an AdamW warm-up on 8-bit quantized "
                        "gradients", optimizer="compressed_adam",
                        options={"compressor": "sign", "warmup_steps": 100, "warmup_compressor": "quantize"}),
    "cadam_q8": Method("fastcomm.CompressedAdam (quantize compressor) after a dense AdamW warm-up",
                       optimizer="compressed_adam", options={"compressor": "quantize", "warmup_steps": 100}),
    "cadam_topk": Method("fastcomm.CompressedAdam (topk compressor) after a dense AdamW warm-up",
                         optimizer="compressed_adam", options={"compressor": "topk", "warmup_steps": 100}),
    "sgd": Method("dense allreduce, SGD momentum 0.9", optimizer="sgd"),
    "dgc": Method("fastcomm topk_hook 1% with DGC momentum correction (0.9), local clipping and sparsity "
                  "warm-up, SGD",
                  optimizer="sgd_nomomentum", hook="topk",
                  options={"ratio": 0.01, "momentum": 0.9, "warmup_steps": 100, "clip_norm": 1.0}),
    "sgd_clip": Method("dense SGD momentum 0.9 on DGC's locally clipped gradients (topk_hook at ratio 1.0, "
                       "every entry sent; clip_norm 1.0, momentum correction 0.9): dgc's clipped reference",
                       optimizer="sgd_nomomentum", hook="topk",
                       options={"ratio": 1.0, "momentum": 0.9, "momentum_masking": False, "warmup_steps": 0,
                                "clip_norm": 1.0}),
    "fp16": Method("torch fp16_compress_hook, AdamW", hook="torch_fp16"),
    "diloco": Method("fastcomm.DiLoCo H=10, fp32 pseudo-gradients, outer Nesterov lr 0.7 momentum 0.5, "
                     "AdamW inner", optimizer="diloco", options=_diloco()),
    "diloco_q4": Method("fastcomm.DiLoCo H=10, 4-bit pseudo-gradients with error feedback, outer Nesterov "
                        "lr 0.7 momentum 0.5, AdamW inner", optimizer="diloco", options=_diloco(**_Q4)),
    "diloco_h25": Method("fastcomm.DiLoCo H=25, fp32, outer Nesterov lr 0.7 momentum 0.5, AdamW inner",
                         optimizer="diloco", options=_diloco(sync_every=25)),
    "diloco_q4_h25": Method("fastcomm.DiLoCo H=25, 4-bit pseudo-gradients with error feedback, outer "
                            "Nesterov lr 0.7 momentum 0.5, AdamW inner", optimizer="diloco",
                            options=_diloco(sync_every=25, **_Q4)),
    "diloco_q4_h15": Method("fastcomm.DiLoCo H=15, 4-bit pseudo-gradients with error feedback, outer "
                            "Nesterov lr 0.7 momentum 0.5, AdamW inner", optimizer="diloco",
                            options=_diloco(sync_every=15, **_Q4)),
    "diloco_q4_h15_d3": Method("diloco_q4_h15 with each sync overlapped with the next 3 inner steps "
                               "(applied 3 steps late, keeping them)", optimizer="diloco",
                               options=_diloco(sync_every=15, delay=3, **_Q4)),
    "diloco_q4_d2": Method("diloco_q4 with each sync overlapped with the next 2 inner steps (applied 2 "
                           "steps late, keeping them)", optimizer="diloco", options=_diloco(delay=2, **_Q4)),
    "diloco_q4_d1": Method("diloco_q4 with each sync overlapped with the next inner step (applied 1 step "
                           "late, keeping it)", optimizer="diloco", options=_diloco(delay=1, **_Q4)),
    "diloco_q4_h15_d1": Method("diloco_q4_h15 with each sync overlapped with the next inner step (applied "
                               "1 step late, keeping it)", optimizer="diloco",
                               options=_diloco(sync_every=15, delay=1, **_Q4)),
    "diloco_m09": Method("fastcomm.DiLoCo H=10, fp32, outer Nesterov lr 0.7 momentum 0.9 (the paper's), "
                         "AdamW inner", optimizer="diloco", options=_diloco(outer_momentum=0.9)),
    "diloco_avg": Method("fastcomm.DiLoCo H=10, fp32, plain averaging (outer lr 1, no momentum), AdamW inner",
                         optimizer="diloco", options=_diloco(outer_lr=1.0, outer_momentum=0.0)),
    "diloco_lr1": Method("fastcomm.DiLoCo H=10, fp32, outer Nesterov lr 1.0 momentum 0.5, AdamW inner",
                         optimizer="diloco", options=_diloco(outer_lr=1.0)),
    "diloco_q4_lr05": Method("diloco_q4 with outer Nesterov lr 0.5 (momentum 0.5)", optimizer="diloco",
                             options=_diloco(outer_lr=0.5, **_Q4)),
    "diloco_q4_lr1": Method("diloco_q4 with outer Nesterov lr 1.0 (momentum 0.5)", optimizer="diloco",
                            options=_diloco(outer_lr=1.0, **_Q4)),
    "diloco_q4_avg": Method("diloco_q4 with plain averaging (outer lr 1, no momentum)", optimizer="diloco",
                            options=_diloco(outer_lr=1.0, outer_momentum=0.0, **_Q4)),
    "diloco_q4_h5": Method("diloco_q4 with H=5", optimizer="diloco", options=_diloco(sync_every=5, **_Q4)),
    "diloco_q4_h2": Method("diloco_q4 with H=2", optimizer="diloco", options=_diloco(sync_every=2, **_Q4)),
    "diloco_ramp": Method("fastcomm.DiLoCo H=10, fp32, outer Nesterov momentum 0.5, outer lr 0.5 to step 100 "
                          "then rising to 1.0 at step 500 (fastcomm.outer_lr_ramp), AdamW inner",
                          optimizer="diloco", options=_ramped()),
    "diloco_q4_ramp": Method("diloco_ramp with 4-bit pseudo-gradients and error feedback", optimizer="diloco",
                             options=_ramped(**_Q4)),
    "diloco_q4_d2_ramp": Method("diloco_q4_ramp with each sync overlapped with the next 2 inner steps "
                                "(applied 2 steps late, keeping them)", optimizer="diloco",
                                options=_ramped(delay=2, **_Q4)),
    "diloco_q4_h13_d2_ramp": Method("diloco_q4_d2_ramp at H=13 (about 100x fewer bytes than dense)",
                                    optimizer="diloco", options=_ramped(sync_every=13, delay=2, **_Q4)),
    "diloco_sign_ramp": Method("diloco_ramp with 1-bit (sign, scaled) pseudo-gradients and error feedback",
                               optimizer="diloco", options=_ramped(compressor="sign")),
    "diloco_q4_h15_ramp": Method("diloco_q4_ramp at H=15", optimizer="diloco",
                                 options=_ramped(sync_every=15, **_Q4)),
    "diloco_q4_h15_d3_ramp": Method("diloco_q4_h15_ramp with each sync overlapped with the next 3 inner "
                                    "steps (applied 3 steps late, keeping them)", optimizer="diloco",
                                    options=_ramped(sync_every=15, delay=3, **_Q4)),
    "diloco_h1_avg": Method("fastcomm.DiLoCo H=1, fp32, plain averaging: the replicas' AdamW steps averaged "
                            "every step (what averaging alone costs)", optimizer="diloco",
                            options=_diloco(sync_every=1, outer_lr=1.0, outer_momentum=0.0)),
    "streaming_q4": Method("fastcomm.DiLoCo streaming: H=10 in 5 fragments (one every 2 steps, applied 2 "
                           "steps late), 4-bit pseudo-gradients with error feedback, outer lr 0.7 "
                           "momentum 0.5",
                           optimizer="diloco", options=_diloco(fragments=5, **_Q4)),
    "streaming_q4_mix": Method("streaming_q4 with the paper's merge of a late exchange: local = 0.5 local + "
                               "0.5 global", optimizer="diloco",
                               options=_diloco(fragments=5, mixing=0.5, **_Q4)),
    "noop": Method("no communication at all (the compute floor; ranks train apart, for timing only)",
                   hook="noop"),
}
BASE_LR = {"adamw": 2e-3, "compressed_adam": 2e-3, "diloco": 2e-3, "sgd": 0.1, "sgd_nomomentum": 0.1}
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def method_unavailable(name: str) -> str | None:
    """Why method ``name`` cannot run with the installed fastcomm (a missing export), or None."""
    method = METHODS[name]
    if method.optimizer == "compressed_adam" and not hasattr(fastcomm, "CompressedAdam"):
        return "fastcomm.CompressedAdam is not available in this fastcomm"
    return None


def _noop_hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated: DDP compares a hook's annotations with the real classes, and this module's annotations
    # are strings (postponed), which it would refuse.
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _build_method(
    name: str, ddp: DistributedDataParallel, lr: float, options: dict[str, Any]
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and the registered hook's state (None when the hook keeps none)."""
    method = METHODS[name]
    params = list(ddp.parameters())
    if method.optimizer == "compressed_adam":
        reason = method_unavailable(name)
        if reason:
            raise RuntimeError(reason)
        kwargs = {"lr": lr, "betas": BETAS, "weight_decay": WEIGHT_DECAY, **options}
        optimizer = fastcomm.CompressedAdam(params, **kwargs)
        return optimizer, fastcomm.register(ddp, optimizer)
    if method.optimizer == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
    elif method.optimizer in ("sgd", "sgd_nomomentum"):
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9 if method.optimizer == "sgd" else 0.0)
    else:
        raise ValueError(f"unknown optimizer {method.optimizer!r}")
    if method.hook is None:
        return optimizer, None
    if method.hook == "noop":
        ddp.register_comm_hook(None, _noop_hook)
        return optimizer, None
    if method.hook == "torch_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return optimizer, None
    return optimizer, fastcomm.register(ddp, method.hook, **options)


# Under FSDP2 a method's hook is a compressor name of fastcomm.fsdp.compress, its options the compressor's
_FSDP_HOOKS = ("quantize", "sign", "cast")


def fsdp_unavailable(name: str) -> str | None:
    """Why method ``name`` cannot run under FSDP2 (``--fsdp``), or None: dense, or an AdamW/SGD method whose
    hook is a compressor of :func:`fastcomm.fsdp.compress`."""
    method = METHODS[name]
    if method.optimizer not in ("adamw", "sgd"):
        return f"{name}: its optimizer {method.optimizer!r} has no FSDP2 form here (AdamW or SGD only)"
    if method.hook is not None and method.hook not in _FSDP_HOOKS:
        names = ", ".join(_FSDP_HOOKS)
        return f"{name}: its hook {method.hook!r} is not a compressor of fastcomm.fsdp ({names})"
    return None


def _build_fsdp_method(
    name: str, model: GPT, lr: float, options: dict[str, Any]
) -> tuple[torch.optim.Optimizer, Any]:
    """Shard ``model`` with FSDP2 (every block, then the root), compress its gradient reduce-scatter with
    the method's compressor (none: dense FSDP2), and build the optimizer over the sharded parameters."""
    from torch.distributed.fsdp import fully_shard

    import fastcomm.fsdp

    reason = fsdp_unavailable(name)
    if reason:
        raise ValueError(reason)
    method = METHODS[name]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    compression = None if method.hook is None else fastcomm.fsdp.compress(model, method.hook, **options)
    params = list(model.parameters())
    if method.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY), compression
    return torch.optim.SGD(params, lr=lr, momentum=0.9), compression


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class _KillingCheckpointer(fastcomm.Checkpointer):
    """Fault injection for the tests (``TRAIN_LM_FAULT=checkpoint-write:STEP:RANK``): on torchrun's first
    attempt, that rank writes half of its file of checkpoint STEP, then SIGKILLs itself, as a preemption in
    the middle of a write would."""

    def __init__(self, *args: Any, fault_step: int, fault_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault_step, self.fault_rank = fault_step, fault_rank
        self._saving = -1

    def save(self, step: int, extra: Any = None) -> Path:
        self._saving = step
        return super().save(step, extra)

    def _write_file(self, path: Path, payload: Any) -> tuple[int, str]:
        if self._saving == self.fault_step and self._world()[1] == self.fault_rank:
            buffer = io.BytesIO()
            torch.save(dict(payload), buffer)
            with open(path, "wb") as handle:
                handle.write(buffer.getvalue()[: buffer.tell() // 2])
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._write_file(path, payload)


def _checkpointer(config: TrainConfig, options: dict[str, Any], say: Callable[[str], None],
                  **objects: Any) -> fastcomm.Checkpointer:
    directory = config.checkpoint_dir or config.resume
    assert directory is not None
    run = {"method": config.method, "options": options}
    fault = os.environ.get("TRAIN_LM_FAULT", "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a restart must not fail again
    if fault.startswith("checkpoint-write:") and first_attempt:
        _, step, rank = fault.split(":")
        return _KillingCheckpointer(directory, every=config.checkpoint_every, keep=config.checkpoint_keep,
                                    run=run, log=say, fault_step=int(step), fault_rank=int(rank), **objects)
    return fastcomm.Checkpointer(directory, every=config.checkpoint_every, keep=config.checkpoint_keep,
                                 run=run, log=say, **objects)


class _SampleLog:
    """``--sample-log DIR``: each rank appends ``step epoch id id ...`` (the batch's sample ids) to
    ``DIR/rank{r}.log`` and writes its pid to ``DIR/rank{r}.pid``; a restart appends replayed steps again."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.handle = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
            self.handle = open(directory / f"rank{rank}.log", "a", buffering=1)

    def write(self, step: int, epoch: int, ids: torch.Tensor) -> None:
        if self.handle is not None:
            self.handle.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")


# ---------------------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class TrainConfig:
    """One run: the method, its length and schedule, the data and model shape, checkpoints."""

    method: str = "none"
    steps: int = 500
    seed: int = 0
    batch_size: int = 16
    warmup_steps: int = 30
    lr: float | None = None  # None: the optimizer's BASE_LR
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # override the method's options
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    eval_every: int = 50  # 0: only at the end
    val_rows: int = 128  # validation rows per rank
    log_every: int = 10  # 0: no progress lines
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2  # complete checkpoints kept (the newest, and one to fall back on)
    resume: Path | None = None  # a checkpoint_dir (its newest valid checkpoint, if any) or a step directory
    sample_log: Path | None = None  # where each rank logs its batches' sample ids (see _SampleLog)
    final_state: Path | None = None  # rank 0 saves the final model and optimizer state here
    stop_after: int | None = None  # end the run after this step (as if killed), for resume tests
    schedule_steps: int | None = None  # the cosine's length (default: steps)
    fsdp: bool = False  # FSDP2 (fully_shard on every block and the root) instead of DDP

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {sorted(METHODS)}")
        for name in ("steps", "batch_size", "val_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        if self.checkpoint_keep < 1:
            raise ValueError(f"TrainConfig.checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if self.fsdp:
            reason = fsdp_unavailable(self.method)
            if reason:
                raise ValueError(f"TrainConfig.fsdp: {reason}")
            if self.checkpoint_every or self.resume is not None or self.final_state is not None:
                raise ValueError("TrainConfig.fsdp: checkpoints and final_state are DDP-only here (FSDP2 "
                                 "saves through DCP, see docs/fsdp.md)")


@dataclasses.dataclass
class TrainResult:
    """What a run measured: validation loss by step; training loss, step time (slowest rank) and rank 0's
    backward and optimizer-step times by step."""

    method: str
    description: str
    options: dict[str, Any]
    parameters: int
    start_step: int
    val_steps: list[int]
    val_losses: list[float]
    train_losses: list[float]  # the mean over ranks, steps start_step + 1 ... steps
    step_seconds: list[float]  # the slowest rank's time of each of those steps
    backward_seconds: list[float]  # rank 0's backward (with the hook's communication) of each step
    optimizer_seconds: list[float]  # rank 0's optimizer.step() of each step
    hook_stats: dict[str, float | str] | None
    lrs: list[float] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)


@torch.no_grad()
def _val_loss(model: GPT, loader: fastio.StreamLoader, rows: int) -> float:
    """Mean loss over the first ``rows`` validation windows of this rank (a fixed shuffled order), averaged
    over ranks."""
    total = torch.zeros(2, dtype=torch.float64)
    width = model.config.context + 1
    for batch in loader:
        tokens = batch["tokens"][: rows - int(total[1].item()), :width].long()
        total[0] += model(tokens[:, :-1], tokens[:, 1:]).item() * tokens.shape[0]
        total[1] += tokens.shape[0]
        if total[1] >= rows:
            break
    dist.all_reduce(total)
    if total[1] == 0:
        raise RuntimeError("the validation set has no rows: prepare more files (max_files)")
    return float(total[0] / total[1])


def train(config: TrainConfig, paths: DataPaths, log: Callable[[str], None] | None = None) -> TrainResult:
    """Train ``config.method`` on this rank of the initialised process group and return what it measured.

    Every rank must call it with the same ``config``. Steps are numbered from 1; step ``s`` is done once
    ``s`` optimizer steps are. Validation runs after every ``eval_every``-th step and after the last.

    Args:
        config: the run.
        paths: the prepared data (:func:`prepare_data`).
        log: where rank 0 writes progress lines (default: print to stderr); ranks > 0 never log.

    Returns:
        A :class:`TrainResult` (the same on every rank; hook stats are this rank's).

    Example::

        dist.init_process_group("gloo")
        result = train(TrainConfig(method="sign", steps=100), prepare_data(default_data_dir()))
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    method = METHODS[config.method]
    options = {**method.options, **config.options}
    lr = config.lr if config.lr is not None else BASE_LR[method.optimizer]
    schedule_steps = config.schedule_steps or config.steps

    def say(line: str) -> None:
        if rank == 0 and log is not None:
            log(line)

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model = GPT(config.model)
    parameters = sum(p.numel() for p in model.parameters())
    outer: fastcomm.DiLoCo | None = None
    if method.optimizer == "diloco":  # no DDP: each rank trains on its own batches between syncs
        net: nn.Module = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        outer = fastcomm.DiLoCo(model, optimizer, **_diloco_arguments(options))
        hook_state: Any = outer
    elif config.fsdp:
        net = model
        optimizer, hook_state = _build_fsdp_method(config.method, model, lr, options)
    else:
        net = DistributedDataParallel(model)
        optimizer, hook_state = _build_method(config.method, net, lr, options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, config.warmup_steps, schedule_steps)
    )
    context = config.model.context
    train_loader = _loader(paths.train, config.batch_size, config.seed, rank, world)
    val_loader = _loader(paths.val, config.batch_size, VAL_SEED, rank, world)
    stream = _EpochStream(train_loader)

    start_step = 0
    val_steps: list[int] = []
    val_losses: list[float] = []
    ckpt = None
    if config.checkpoint_every or config.resume is not None:
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                   "loader": train_loader}
        if hook_state is not None:
            objects["hook"] = hook_state
        ckpt = _checkpointer(config, options, say, **objects)
    if config.resume is not None:
        assert ckpt is not None
        directory = Path(config.resume)
        start_step = ckpt.restore(directory if (directory / "manifest.json").exists() else None)
        if start_step:
            val_steps, val_losses = ckpt.extra["val_steps"], ckpt.extra["val_losses"]
            say(f"[train_lm] resumed {config.method} at step {start_step} from {ckpt.restored_from}")
        else:
            say(f"[train_lm] no checkpoint in {directory}: starting at step 0")
    samples = _SampleLog(config.sample_log, rank)

    say(f"[train_lm] {config.method}{' under FSDP2' if config.fsdp else ''}: {method.description}; "
        f"options {options}; {parameters:,} parameters; "
        f"{world} ranks x {config.batch_size} x {context} tokens; lr {lr} (warm-up {config.warmup_steps}, "
        f"cosine to step {schedule_steps}); data {paths.train_files} train / {paths.val_files} val files")

    train_losses: list[float] = []
    step_seconds: list[float] = []
    backward_seconds: list[float] = []
    optimizer_seconds: list[float] = []
    lrs: list[float] = []
    last = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    window_start = time.perf_counter()
    for step in range(start_step + 1, last + 1):
        begin = time.perf_counter()
        batch = stream.next()
        samples.write(step, train_loader.epoch, batch["index"])
        tokens = batch["tokens"][:, : context + 1].long()
        optimizer.zero_grad(set_to_none=True)
        loss = net(tokens[:, :-1], tokens[:, 1:])
        backward_begin = time.perf_counter()
        loss.backward()
        optimizer_begin = time.perf_counter()
        (optimizer if outer is None else outer).step()
        if outer is not None and step == config.steps:
            outer.finish()  # the exchanges still in flight, before the last evaluation
        optimizer_end = time.perf_counter()
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
        step_seconds.append(time.perf_counter() - begin)
        backward_seconds.append(optimizer_begin - backward_begin)
        optimizer_seconds.append(optimizer_end - optimizer_begin)
        train_losses.append(loss.item())
        if not math.isfinite(train_losses[-1]):
            raise FloatingPointError(f"{config.method}: training loss {train_losses[-1]} at step {step}")
        if config.log_every and step % config.log_every == 0:
            seconds = time.perf_counter() - window_start
            tokens_per_s = config.log_every * world * tokens.numel() / seconds
            say(f"[train_lm] step {step}/{config.steps} loss {train_losses[-1]:.4f} lr {lrs[-1]:.2e} "
                f"{seconds / config.log_every:.3f} s/step {tokens_per_s:,.0f} tokens/s")
            window_start = time.perf_counter()
        if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
            val_steps.append(step)
            val_losses.append(_val_loss(model, val_loader, config.val_rows))
            say(f"[train_lm] step {step} val loss {val_losses[-1]:.4f}")
            window_start = time.perf_counter()
        if ckpt is not None and ckpt.maybe_save(step, {"val_steps": val_steps, "val_losses": val_losses}):
            say(f"[train_lm] checkpoint step {step} -> {ckpt.path_of(step)}")
            window_start = time.perf_counter()

    if config.final_state is not None and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": last},
                   config.final_state)
    # One collective for the per-step numbers: the mean training loss and the slowest rank's time.
    losses = torch.tensor(train_losses, dtype=torch.float64)
    seconds = torch.tensor(step_seconds, dtype=torch.float64)
    dist.all_reduce(losses)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    stats = hook_state.stats() if hook_state is not None and hasattr(hook_state, "stats") else None
    return TrainResult(
        method=config.method, description=method.description, options=options, parameters=parameters,
        start_step=start_step, val_steps=val_steps, val_losses=val_losses,
        train_losses=(losses / world).tolist(), step_seconds=seconds.tolist(),
        backward_seconds=backward_seconds, optimizer_seconds=optimizer_seconds,
        hook_stats={k: float(v) if isinstance(v, (int, float)) else str(v) for k, v in stats.items()}
        if stats else None, lrs=lrs,
    )


# ---------------------------------------------------------------------------------------------------------
# Command line


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--opt wants key=value, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare word: a string option (compressor=sign)


@fastcomm.fault.exit_on_peer_loss
def main(argv: Sequence[str] | None = None) -> int:
    """The torchrun entry point: parse arguments, join the gloo group, prepare data, train, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    methods_help = "; ".join(f"{k}: {m.description}" for k, m in METHODS.items()).replace("%", "%%")
    parser.add_argument("--hook", default="none", choices=sorted(METHODS), help=methods_help)
    parser.add_argument("--opt", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                        help="override one of the method's hook/optimizer options (repeatable)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=None, help="base learning rate (default by optimizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="rows of 128 tokens per rank")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--val-rows", type=int, default=128, help="validation rows per rank")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=None, help="shard cache (default: ~/.cache/...)")
    parser.add_argument("--max-files", type=int, default=None, help="use an evenly spaced subset of files")
    parser.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    parser.add_argument("--n-layer", type=int, default=ModelConfig.n_layer)
    parser.add_argument("--n-head", type=int, default=ModelConfig.n_head)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/train_lm"))
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="resume from the checkpoint dir's latest, or from the given step directory")
    parser.add_argument("--stop-after", type=int, default=None, help="end after this step (as if killed)")
    parser.add_argument("--schedule-steps", type=int, default=None, help="cosine length (default --steps)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the TrainResult here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds: how long a rank waits for a silent peer "
                             "before it fails (default: FASTCOMM_TIMEOUT, else 300)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept")
    parser.add_argument("--sample-log", type=Path, default=None, help="log each batch's sample ids here")
    parser.add_argument("--final-state", type=Path, default=None,
                        help="rank 0 saves the final model and optimizer state_dicts here")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 (fully_shard every block and the root; the hook's compressor through "
                             "fastcomm.fsdp.compress) instead of DDP")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    fastcomm.fault.init_process_group("gloo", timeout=args.timeout)
    try:
        data_dir = args.data_dir or default_data_dir()
        if dist.get_rank() == 0:
            paths = prepare_data(data_dir, args.max_files)
        dist.barrier()
        if dist.get_rank() != 0:
            paths = prepare_data(data_dir, args.max_files)
        resume = None
        if args.resume is not None:
            resume = args.checkpoint_dir if args.resume == "latest" else Path(args.resume)
        config = TrainConfig(
            method=args.hook, steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
            options=dict(args.opt), eval_every=args.eval_every, val_rows=args.val_rows,
            log_every=args.log_every,
            model=ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head),
            checkpoint_dir=args.checkpoint_dir if args.checkpoint_every else None,
            checkpoint_every=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep, resume=resume,
            stop_after=args.stop_after, sample_log=args.sample_log, final_state=args.final_state,
            schedule_steps=args.schedule_steps, fsdp=args.fsdp,
        )
        with fastcomm.fault.peer_guard():
            result = train(config, paths, log=lambda line: print(line, file=sys.stderr, flush=True))
        if dist.get_rank() == 0:
            if result.val_losses:
                print(f"[train_lm] {args.hook}: val loss {result.val_losses[-1]:.4f} at step "
                      f"{result.val_steps[-1]}; median {np.median(result.step_seconds):.3f} s/step",
                      file=sys.stderr, flush=True)
            if args.json is not None:
                _atomic_write_text(result.to_json(), args.json)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
