"""The training methods the LM benchmarks compare: one table, one row per method.

A method is an optimizer of ``examples/train_lm.py`` (``--optimizer``), a communication hook
(``--hook``: a :func:`fastcomm.register` name, ``torch_fp16``, ``noop`` or ``none``) and their options
(``--opt key=value``). :mod:`benchmarks.bench_convergence` and :mod:`benchmarks.bench_fsdp`'s LM part
name methods by their row here and turn a row into the example's arguments (:func:`arguments`) or its
``TrainConfig`` fields (:func:`config_fields`); the example itself knows no method names.
:mod:`benchmarks.bench_diloco` and :mod:`benchmarks.bench_diloco_seeds` (through
:mod:`benchmarks.diloco_jobs`) use only :func:`load_example`: their rows are DiLoCo's keyword arguments.

Example::

    from benchmarks.lm_methods import arguments, config_fields, load_example

    arguments("q8")  # ["--optimizer", "adamw", "--hook", "quantize", "--opt", "bits=8"]
    train_lm = load_example()
    config = train_lm.TrainConfig(steps=500, **config_fields("q8"))
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Any

from benchmarks.common import REPO_ROOT

__all__ = [
    "EXAMPLE",
    "METHODS",
    "RAMP",
    "Method",
    "arguments",
    "config_fields",
    "load_example",
]

EXAMPLE = REPO_ROOT / "examples" / "train_lm.py"


def load_example() -> Any:
    """``examples/train_lm.py`` as a module (the one source of the model, data and loop), its folder on
    ``sys.path`` for its sibling modules (``lm_data``, ``lm_model``); loaded once per process."""
    if "train_lm" in sys.modules:
        return sys.modules["train_lm"]
    folder = str(EXAMPLE.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


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


def config_fields(name: str) -> dict[str, Any]:
    """Method ``name`` as ``train_lm.TrainConfig`` fields: ``optimizer``, ``hook`` and ``options``.

    Example::

        train_lm.TrainConfig(steps=100, fsdp=True, **config_fields("q8"))
    """
    method = METHODS[name]
    return {"optimizer": method.optimizer, "hook": method.hook or "none", "options": dict(method.options)}


def arguments(name: str) -> list[str]:
    """Method ``name`` as ``examples/train_lm.py`` arguments (options as ``--opt key=repr(value)``, which
    the example reads back with ``ast.literal_eval``); a later ``--opt`` overrides one of them.

    Example::

        arguments("dgc")  # ["--optimizer", "sgd_nomomentum", "--hook", "topk", "--opt", "ratio=0.01", ...]
    """
    fields = config_fields(name)
    found = ["--optimizer", fields["optimizer"], "--hook", fields["hook"]]
    for key, value in fields["options"].items():
        found += ["--opt", f"{key}={value!r}"]
    return found
