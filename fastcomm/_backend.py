"""The data of ``fastcomm.backend()``'s report: what each op runs on, per device, and why.

:mod:`fastcomm.ops` makes the choice at import and fills these in; they only hold and print it. ``fastio``
has a :class:`Backend` of the same fields (its own definition: neither package imports the other).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Backend", "DeviceBackend", "Implementation", "OpBackend"]

Implementation = Literal["native-cpp", "cuda-cpp", "triton", "reference"]
# How each implementation reads in a sentence.
_IMPLEMENTATION_PROSE = {
    "native-cpp": "native C++",
    "cuda-cpp": "native CUDA C++",
    "triton": "triton",
    "reference": "reference",
}


@dataclass(frozen=True)
class DeviceBackend:
    """What one op runs on for tensors of one device type.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        implementation: ``"native-cpp"`` (``fastcomm._C`` on CPU), ``"cuda-cpp"`` (``fastcomm._C`` on CUDA),
            ``"triton"`` or ``"reference"`` (the plain-PyTorch twin).
        reason: why the reference runs; ``None`` for any other implementation.
        threads: OpenMP threads of the native CPU kernels, else ``None``.
        isa: which build of the native CPU loops runs (``"avx2"`` or ``"baseline"``), else ``None``.

    Example::

        >>> print(DeviceBackend("cuda", "reference", reason="no CUDA device"))
        cuda: reference (no CUDA device)
    """

    device: str
    implementation: Implementation
    reason: str | None = None
    threads: int | None = None
    isa: str | None = None

    def __post_init__(self) -> None:
        if self.implementation not in _IMPLEMENTATION_PROSE:
            raise ValueError(
                f"implementation must be one of {tuple(_IMPLEMENTATION_PROSE)}, got {self.implementation!r}"
            )
        if (self.implementation == "reference") != (self.reason is not None):
            raise ValueError(
                f"reason must be given exactly when implementation is 'reference': got implementation "
                f"{self.implementation!r} with reason {self.reason!r}"
            )

    def __str__(self) -> str:
        if self.reason is not None:
            detail = f" ({self.reason})"
        elif self.threads is not None:
            detail = f" (OpenMP, {self.threads} threads, {self.isa} loops)"
        else:
            detail = ""
        return f"{self.device}: {_IMPLEMENTATION_PROSE[self.implementation]}{detail}"


@dataclass(frozen=True)
class OpBackend:
    """What one op runs on, per device type; ``str()`` gives the prose, :meth:`to_dict` the JSON form.

    Example::

        >>> entry = fastcomm.backend()["quantize_blockwise"]
        >>> entry.cpu.implementation, entry.cuda.reason
        ('native-cpp', 'no CUDA device')
        >>> print(entry)
        cpu: native C++ (OpenMP, 2 threads, avx2 loops); cuda: reference (no CUDA device)
    """

    cpu: DeviceBackend
    cuda: DeviceBackend

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain dicts and strings, for ``json.dumps``: ``{"cpu": {"device": "cpu", ...}, "cuda": {...}}``."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.cpu}; {self.cuda}"


@dataclass(frozen=True, eq=False)
class Backend(Mapping[str, OpBackend]):
    """What fastcomm's ops run on; a mapping of op name to its :class:`OpBackend`.

    ``fastio.backend()`` returns a ``Backend`` of the same fields (each package defines its own: neither
    imports the other).

    Attributes:
        package: ``"fastcomm"``.
        native: whether ``fastcomm._C`` (the C++ kernels) is loaded.
        reason: why it is not (``None`` when it is).
        ops: op name -> :class:`OpBackend` (per device: the implementation, and why when it is the
            reference).

    Example::

        >>> report = fastcomm.backend()
        >>> report.native, report["topk_select"].cpu.implementation
        (True, 'native-cpp')
        >>> print(report)   # a head line, then one line per op
        fastcomm: native C++ (fastcomm._C)
          topk_select: cpu: native C++ (OpenMP, 2 threads, avx2 loops); cuda: reference (no CUDA device)
          ...
    """

    package: str
    native: bool
    reason: str | None
    ops: Mapping[str, OpBackend]

    def __getitem__(self, op: str) -> OpBackend:
        return self.ops[op]

    def __iter__(self) -> Iterator[str]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backend):
            return self.to_dict() == other.to_dict()
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  (a mapping of ops, compared by value)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and strings, for ``json.dumps``: the fields, each op as its ``OpBackend.to_dict()``."""
        ops = {op: entry.to_dict() for op, entry in self.ops.items()}
        return {"package": self.package, "native": self.native, "reason": self.reason, "ops": ops}

    def __str__(self) -> str:
        head = "native C++ (fastcomm._C)" if self.native else f"reference kernels on CPU ({self.reason})"
        return "\n".join([f"{self.package}: {head}", *(f"  {op}: {entry}" for op, entry in self.ops.items())])
