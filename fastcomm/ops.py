"""Every fastcomm op in one place: its schema, its fake (meta) kernel, its backends, and its public wrapper.

One table, :data:`OP_SPECS`, drives every registration: each row names an op, its schema, its reference
twin, its fake kernel and the Triton module that holds its CUDA kernel, if any. A new op is one row (plus
its reference twin, its argument check in :mod:`fastcomm._op_checks`, one ``_public_op`` line below, and its
kernels). Backends are picked once, at import:

* The plain-PyTorch twin from :mod:`fastcomm.reference` is the ``CompositeExplicitAutograd`` kernel: the
  default on any device without a native kernel.
* ``fastcomm._C`` (C++/OpenMP, built by ``setup.py``) registers ``CPU`` kernels for every op and, when built
  against a CUDA torch, a ``CUDA`` top-k selection kernel. ``FASTCOMM_NO_NATIVE=1`` skips loading it.
* Triton kernels (:mod:`fastcomm.triton`) are registered for ``CUDA`` when triton imports and CUDA is there,
  for the ops that have no C++ CUDA kernel.

:func:`backend` reports what each op runs on and why, as data (:class:`Backend`). The public ops below
(``fastcomm.ops.<name>``) take their signature, defaults and docstring from their reference twin, check
their arguments (raising ``TypeError``/``ValueError`` that name the argument) and then dispatch through
``torch.ops.fastcomm``.

Example::

    import torch, fastcomm
    grad = torch.randn(1_000_003)
    residual = torch.zeros_like(grad)
    values, indices = fastcomm.ops.topk_select(grad, k=10_000, residual=residual)
    codes, scales = fastcomm.ops.quantize_blockwise(grad, bits=4, stochastic=True, seed=7)
    approx = fastcomm.ops.dequantize_blockwise(codes, scales, grad.numel(), bits=4)
    fastcomm.ops.dequantize_blockwise_into(grad, codes, scales, bits=4, accumulate=True)  # grad += approx
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor

from fastcomm import reference
from fastcomm._backend import Backend, DeviceBackend, OpBackend
from fastcomm._op_checks import (
    check_dequantize_blockwise,
    check_dequantize_blockwise_into,
    check_powersgd_back_project,
    check_powersgd_expand,
    check_powersgd_project,
    check_quantize_blockwise,
    check_sign_compress,
    check_sign_decompress,
    check_sign_decompress_into,
    check_sparse_accumulate,
    check_sparse_mean,
    check_topk_select,
    num_blocks,
)


# ---------------------------------------------------------------------------------------------- fake kernels
def _topk_select_fake(x, k, residual=None, exact=True, residual_source=None):
    if exact or reference.approx_sample_size(x.numel(), k) * 2 > x.numel():
        count = k
    else:
        count = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(count), x.new_empty(count, dtype=torch.int32)


def _quantize_fake(x, bits=8, block=256, stochastic=False, seed=0, residual=None, residual_source=None):
    n = x.numel()
    return x.new_empty(num_blocks(n * bits, 8), dtype=torch.uint8), x.new_empty(
        num_blocks(n, block), dtype=torch.float32
    )


def _dequantize_fake(codes, scales, numel, bits=8, block=256, dtype=torch.float32):
    return codes.new_empty(numel, dtype=dtype)


def _sign_compress_fake(x, residual=None, chunk=2048, residual_source=None):
    n = x.numel()
    return x.new_empty(num_blocks(n, 8), dtype=torch.uint8), x.new_empty(
        num_blocks(n, chunk), dtype=torch.float32
    )


def _sign_decompress_fake(packed, scales, numel, chunk=2048, dtype=torch.float32):
    return packed.new_empty(numel, dtype=dtype)


def _in_place_fake(*args, **kwargs) -> None:
    """The fake kernel of an op that only writes its ``Tensor(a!)`` argument: it returns nothing."""
    return None


def _in_place_kernel(twin: Callable[..., Tensor]) -> Callable[..., None]:
    """``twin`` as the kernel of a ``-> ()`` schema: the twin returns ``out``, the op returns nothing."""

    def kernel(*args: Any) -> None:
        twin(*args)

    return kernel


# -------------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class OpSpec:
    """One fastcomm op: everything :mod:`fastcomm.ops` registers for it, in one row of :data:`OP_SPECS`.

    Args:
        name: the op's name, ``torch.ops.fastcomm.<name>`` and the public wrapper ``fastcomm.ops.<name>``.
        schema: the argument list and return of its ``torch.library`` schema (the name is prepended).
        reference: the plain-PyTorch twin, registered as the ``CompositeExplicitAutograd`` kernel.
        fake: the fake (meta) kernel: output shapes and dtypes for ``torch.compile`` and ``FakeTensor``.
        triton: the module of :mod:`fastcomm.triton` whose function ``name`` is the op's ``CUDA`` kernel,
            or ``None`` when no Triton kernel exists. A CUDA C++ kernel from ``fastcomm._C`` (top-k) is
            registered first and stays the op's ``CUDA`` kernel.

    Example::

        >>> spec = next(s for s in OP_SPECS if s.name == "sign_compress")
        >>> spec.triton, spec.qualname
        ('sign', 'fastcomm::sign_compress')
    """

    name: str
    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    triton: str | None = None

    @property
    def qualname(self) -> str:
        return f"fastcomm::{self.name}"


OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec(
        "topk_select",
        "(Tensor x, int k, Tensor(a!)? residual=None, bool exact=True, Tensor? residual_source=None)"
        " -> (Tensor, Tensor)",
        reference.topk_select,
        _topk_select_fake,
        triton="topk",
    ),
    OpSpec(
        "quantize_blockwise",
        "(Tensor x, int bits=8, int block=256, bool stochastic=False, int seed=0,"
        " Tensor(a!)? residual=None, Tensor? residual_source=None) -> (Tensor, Tensor)",
        reference.quantize_blockwise,
        _quantize_fake,
        triton="quantize",
    ),
    OpSpec(
        "dequantize_blockwise",
        "(Tensor codes, Tensor scales, int numel, int bits=8, int block=256, ScalarType dtype=float)"
        " -> Tensor",
        reference.dequantize_blockwise,
        _dequantize_fake,
        triton="quantize",
    ),
    OpSpec(
        "dequantize_blockwise_into",
        "(Tensor(a!) out, Tensor codes, Tensor scales, int bits=8, int block=256, bool accumulate=False)"
        " -> ()",
        _in_place_kernel(reference.dequantize_blockwise_into),
        _in_place_fake,
        triton="quantize",
    ),
    OpSpec(
        "sign_compress",
        "(Tensor x, Tensor(a!)? residual=None, int chunk=2048, Tensor? residual_source=None)"
        " -> (Tensor, Tensor)",
        reference.sign_compress,
        _sign_compress_fake,
        triton="sign",
    ),
    OpSpec(
        "sign_decompress",
        "(Tensor packed, Tensor scales, int numel, int chunk=2048, ScalarType dtype=float) -> Tensor",
        reference.sign_decompress,
        _sign_decompress_fake,
        triton="sign",
    ),
    OpSpec(
        "sign_decompress_into",
        "(Tensor(a!) out, Tensor packed, Tensor scales, int chunk=2048, bool accumulate=False) -> ()",
        _in_place_kernel(reference.sign_decompress_into),
        _in_place_fake,
        triton="sign",
    ),
    OpSpec(
        "sparse_accumulate",
        "(Tensor(a!) out, Tensor indices, Tensor values) -> ()",
        _in_place_kernel(reference.sparse_accumulate),
        _in_place_fake,
    ),
    OpSpec(
        "sparse_mean",
        "(Tensor(a!) out, Tensor indices, Tensor values, int world_size, Tensor? clear=None) -> ()",
        _in_place_kernel(reference.sparse_mean),
        _in_place_fake,
    ),
    OpSpec(
        "powersgd_project",
        "(Tensor(a!) p, Tensor(b!) x, Tensor q_t, Tensor? gradient=None, Tensor? residual=None) -> ()",
        _in_place_kernel(reference.powersgd_project),
        _in_place_fake,
    ),
    OpSpec(
        "powersgd_back_project",
        "(Tensor(a!) q_t, Tensor p, Tensor x) -> ()",
        _in_place_kernel(reference.powersgd_back_project),
        _in_place_fake,
    ),
    OpSpec(
        "powersgd_expand",
        "(Tensor(a!) mean, Tensor p, Tensor q_t, Tensor(b!)? residual=None) -> ()",
        _in_place_kernel(reference.powersgd_expand),
        _in_place_fake,
    ),
)
OP_NAMES: tuple[str, ...] = tuple(spec.name for spec in OP_SPECS)

# Every op is a public function of this module (defined at the end, from the table's names).
__all__ = [
    "OP_NAMES",
    "OP_SPECS",
    "Backend",
    "DeviceBackend",
    "OpBackend",
    "OpSpec",
    "backend",
    "native_error",
    *OP_NAMES,
]

_LIB = torch.library.Library("fastcomm", "DEF")
for _spec in OP_SPECS:
    _LIB.define(_spec.name + _spec.schema)
    _LIB.impl(_spec.name, _spec.reference, "CompositeExplicitAutograd")
    torch.library.register_fake(_spec.qualname, _spec.fake, lib=_LIB)


# ------------------------------------------------------------------------------------------ backend choice
_native_error: str | None = None
_native_module = None
if os.environ.get("FASTCOMM_NO_NATIVE", "0") == "1":
    _native_error = "disabled by FASTCOMM_NO_NATIVE=1"
else:
    try:
        from fastcomm import _C as _native_module  # registers the C++ kernels with the dispatcher
    except (ImportError, OSError) as exc:
        _native_error = f"native build missing: {exc}"

_triton_error: str | None = None
_triton_ops: tuple[str, ...] = ()  # the ops whose CUDA kernel is Triton's (C++ ones registered first stay)
if not torch.cuda.is_available():
    _triton_error = "no CUDA device"
else:
    try:
        from fastcomm.triton import register_cuda_kernels

        _triton_ops = register_cuda_kernels(
            _LIB, {spec.name: spec.triton for spec in OP_SPECS if spec.triton is not None}
        )
    except ImportError as exc:
        _triton_error = f"triton unavailable: {exc}"


def native_error() -> str | None:
    """Why the C++ kernels are not loaded, or ``None`` when they are."""
    return _native_error


def _has_kernel(spec: OpSpec, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, key)


def _cpu_backend(spec: OpSpec) -> DeviceBackend:
    if not _has_kernel(spec, "CPU"):
        return DeviceBackend("cpu", "reference", reason=_native_error or "no native CPU kernel for this op")
    if _native_module is None:
        return DeviceBackend("cpu", "native-cpp")
    return DeviceBackend(
        "cpu", "native-cpp", threads=_native_module.openmp_threads(), isa=_native_module.cpu_isa()
    )


def _cuda_backend(spec: OpSpec) -> DeviceBackend:
    if not _has_kernel(spec, "CUDA"):
        return DeviceBackend("cuda", "reference", reason=_triton_error or "no CUDA kernel for this op")
    return DeviceBackend("cuda", "triton" if spec.name in _triton_ops else "cuda-cpp")


def backend() -> Backend:
    """Which implementation each op runs on CPU and on CUDA tensors, and why, as a :class:`Backend`.

    The report is data: whether ``fastcomm._C`` is loaded (and why not), and per op an :class:`OpBackend`
    (per device, the implementation, the reason when it is the reference, the CPU kernels' threads and loop
    build). It is a mapping by op name; print it for sentences, ``to_dict()`` it for JSON.

    Example::

        >>> report = fastcomm.backend()
        >>> report["topk_select"].cpu.implementation
        'native-cpp'
        >>> print(report["quantize_blockwise"])
        cpu: native C++ (OpenMP, 2 threads, avx2 loops); cuda: reference (no CUDA device)
        >>> json.dumps(report.to_dict())[:40]
        '{"package": "fastcomm", "native": true, '
    """
    ops = {spec.name: OpBackend(_cpu_backend(spec), _cuda_backend(spec)) for spec in OP_SPECS}
    return Backend("fastcomm", _native_module is not None, _native_error, ops)


_warned_slow = False


def _warn_if_unexpectedly_slow(x: Tensor) -> None:
    """One warning when the native build is missing by accident: the reference works but is slower."""
    global _warned_slow
    if (
        _warned_slow
        or x.device.type != "cpu"
        or _native_error is None
        or _native_error.startswith("disabled")
    ):
        return
    _warned_slow = True
    warnings.warn(
        f"fastcomm is running its pure-PyTorch reference ops on CPU because the C++ extension did not load "
        f"({_native_error}). Rebuild with `pip install --no-build-isolation -e .` (needs a C++ compiler), or "
        f"set FASTCOMM_NO_NATIVE=1 to use the reference on purpose and silence this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


# -------------------------------------------------------------------------------------------- public ops
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _public_op(
    twin: Callable[_P, _R], check: Callable[[dict[str, Any]], None], slow_on: str | None = None
) -> Callable[_P, _R]:
    """The public op of ``twin``'s name: bind the arguments to ``twin``'s signature, ``check`` them, dispatch.

    The twin is the one home of the op's signature, defaults and docstring (the schema in :data:`OP_SPECS`
    states the same parameters for the dispatcher; ``test_ops.py`` holds the two to each other). An op whose
    schema returns nothing writes its first argument in place and returns it, as the twin does. ``slow_on``
    names the argument whose device decides whether a missing native build makes the call slow (warned once);
    ``None`` for an op that has no native CPU kernel to miss.
    """
    signature = inspect.signature(twin)
    defaults = tuple((name, parameter.default) for name, parameter in signature.parameters.items())
    op = getattr(torch.ops.fastcomm, twin.__name__)
    returns_first = not op.default._schema.returns

    @functools.wraps(twin)
    def public(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        given = signature.bind(*args, **kwargs).arguments  # raises TypeError as a call of the twin would
        # In signature order, defaults filled in (BoundArguments.apply_defaults costs more than the op).
        arguments = {name: given[name] if name in given else default for name, default in defaults}
        first = next(iter(arguments.values()))
        check(arguments)
        if slow_on is not None:
            _warn_if_unexpectedly_slow(arguments[slow_on])
        result = op(*arguments.values())
        return first if returns_first else result

    public.__module__ = __name__
    return public


topk_select = _public_op(reference.topk_select, check_topk_select, slow_on="x")
quantize_blockwise = _public_op(reference.quantize_blockwise, check_quantize_blockwise, slow_on="x")
dequantize_blockwise = _public_op(reference.dequantize_blockwise, check_dequantize_blockwise)
dequantize_blockwise_into = _public_op(
    reference.dequantize_blockwise_into, check_dequantize_blockwise_into, slow_on="out"
)
sign_compress = _public_op(reference.sign_compress, check_sign_compress, slow_on="x")
sign_decompress = _public_op(reference.sign_decompress, check_sign_decompress)
sign_decompress_into = _public_op(reference.sign_decompress_into, check_sign_decompress_into, slow_on="out")
sparse_accumulate = _public_op(reference.sparse_accumulate, check_sparse_accumulate)
sparse_mean = _public_op(reference.sparse_mean, check_sparse_mean)
powersgd_project = _public_op(reference.powersgd_project, check_powersgd_project)
powersgd_back_project = _public_op(reference.powersgd_back_project, check_powersgd_back_project)
powersgd_expand = _public_op(reference.powersgd_expand, check_powersgd_expand)
