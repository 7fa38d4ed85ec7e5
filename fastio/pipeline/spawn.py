"""What a worker process started by ``"spawn"`` or ``"forkserver"`` (DataLoader's ``multiprocessing_context``)
makes batches with. A forked worker inherits the pass's :class:`fastio.assembly.producer.BatchProducer`; a
spawned one starts from nothing, so it gets :class:`SpawnedProducer`, pickled: the loader's way to open its
source (``opener``, the loader's own ``source`` argument through :func:`fastio.registry.open_source`: a shard
directory or tar pattern is opened anew, a ``Dataset`` is pickled, as DataLoader pickles it) and the pass's
settings. The worker opens the source, checks it is the one the loader read (sample and shard counts), and
builds the same producer, so its batches are the forked worker's, byte for byte.

Example::

    factory = SpawnedProducer(opener, source, assembly, producer_args)
    produce, times, worker_init = factory()   # in the spawned process
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastio.assembly.producer import BatchProducer
from fastio.pipeline.settings import AssemblySettings
from fastio.sources import Source

__all__ = ["SpawnedProducer", "check_worker_processes"]


def check_worker_processes(source: Source, start_method: str, persistent: bool) -> None:
    """Refuse (``ValueError``) worker processes a source cannot serve: a source read shard by shard (remote
    stores) plans each pass in the loader's process (``prepare``: what to download, for which samples), which
    only workers forked for that pass inherit; so neither spawned workers nor kept ones (persistent, forked
    for an earlier pass) can read it.

    Example::

        check_worker_processes(source, "spawn", persistent=False)
    """
    if not source.requires_shard_order:
        return
    if start_method != "fork":
        raise ValueError(
            f"multiprocessing_context={start_method!r} on {source.name}, a source read shard by shard: its "
            "downloads are planned in the loader's process each epoch, which only workers forked for it "
            "share; use multiprocessing_context='fork' (the default) or workers=fastio.WorkerOptions("
            "mode='thread')"
        )
    if persistent:
        raise ValueError(
            f"persistent_workers=True with worker processes on {source.name}, a source read shard by shard: "
            "its downloads are planned in the loader's process each epoch, which processes kept from an "
            "earlier epoch do not see; use workers=fastio.WorkerOptions(mode='thread') (worker threads are "
            "kept and share it) or persistent_workers=False"
        )


class SpawnedProducer:
    """Builds, in a spawned worker process, the producer a forked one would inherit (see the module
    docstring): ``opener()`` gives the source, ``producer_args`` are :class:`BatchProducer`'s keywords.

    Example::

        produce, times, worker_init = SpawnedProducer(opener, source, assembly, args)()
    """

    def __init__(
        self,
        opener: Callable[[], Source],
        source: Source,
        assembly: AssemblySettings,
        producer_args: dict[str, Any],
    ) -> None:
        self.opener, self.assembly, self.producer_args = opener, assembly, producer_args
        self.expected = (source.name, source.num_samples, list(source.shard_sizes))

    def __call__(self) -> tuple[BatchProducer, Any, Callable[[int], None]]:
        source = self.opener()
        name, num_samples, shard_sizes = self.expected
        if (source.num_samples, list(source.shard_sizes)) != (num_samples, shard_sizes):
            raise RuntimeError(
                f"a spawned worker process opened {source.name} with {source.num_samples} samples in shards "
                f"{list(source.shard_sizes)[:8]}, but the loader read {name} with {num_samples} in "
                f"{shard_sizes[:8]}: the source changed under the loader"
            )
        producer = BatchProducer(source, self.assembly, **self.producer_args)
        return producer, producer.times, producer.start_worker
