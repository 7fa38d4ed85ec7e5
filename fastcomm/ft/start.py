"""How a replica joins a torchft job: one ``torchft.Manager`` per replica group (:func:`connect`).

It checks that the Lighthouse answers before anything else (a named error, not a hang), builds the
process group (``torchft.ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA) and the Manager with a
synchronous quorum, and advertises ``host`` (``127.0.0.1`` on one machine) for the Manager and its
checkpoint server, so that heals and collectives go to that address.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fastcomm.ft.errors import LighthouseUnreachableError, require_torchft

__all__ = ["connect", "lighthouse_address"]


def _advertised_transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server, advertised at ``host`` instead of ``socket.gethostname()``."""
    transport = torchft.checkpointing.HTTPTransport(timeout=timeout, num_chunks=0)
    address = urllib.parse.urlparse(transport.address())
    advertised = address._replace(netloc=f"{host}:{address.port}").geturl()
    transport.address = lambda: advertised  # what metadata() hands the peers that heal from this one
    return transport


def lighthouse_address(lighthouse: str | None = None) -> str:
    """The Lighthouse's address: ``lighthouse``, else ``$TORCHFT_LIGHTHOUSE`` (``http://host:port``)."""
    address = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise LighthouseUnreachableError(
            "no Lighthouse address: pass lighthouse='http://HOST:PORT' or set TORCHFT_LIGHTHOUSE; start one "
            "with `torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 10000`"
        )
    return address if "://" in address else f"http://{address}"


def _check_reachable(address: str, timeout_s: float) -> None:
    parsed = urllib.parse.urlparse(address)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout_s):
            pass
    except OSError as error:
        raise LighthouseUnreachableError(
            f"no torchft Lighthouse answers at {address} ({error}): start one first, e.g. "
            f"`torchft_lighthouse --bind {parsed.hostname}:{parsed.port} --min_replicas 1 "
            f"--join_timeout_ms 10000`, and pass its address (lighthouse= or TORCHFT_LIGHTHOUSE)"
        ) from error


def connect(
    replica_id: str,
    *,
    lighthouse: str | None = None,
    min_replicas: int = 1,
    host: str = "127.0.0.1",
    store: dist.Store | None = None,
    rank: int = 0,
    world_size: int = 1,
    timeout: timedelta = timedelta(seconds=60),
    quorum_timeout: timedelta = timedelta(seconds=120),
    connect_timeout: timedelta = timedelta(seconds=10),
    heartbeat: timedelta = timedelta(milliseconds=100),
    init_sync: bool = True,
) -> Any:
    """A ``torchft.Manager`` for this replica group's rank ``rank``, with a synchronous quorum.

    Args:
        replica_id: this replica group's name (the same on its ranks; unique among replica groups).
        lighthouse: the Lighthouse (``http://HOST:PORT``); default ``$TORCHFT_LIGHTHOUSE``.
        min_replicas: the fewest replicas a step commits with.
        host: the address this replica's Manager and checkpoint server advertise.
        store: this replica group's TCPStore; default: ``MASTER_ADDR``/``MASTER_PORT`` (torchrun's).
        rank, world_size: this rank within its replica group (torchrun: ``RANK``/``WORLD_SIZE``).
        timeout: collectives, commits and heals (``TORCHFT_TIMEOUT_SEC`` overrides it).
        quorum_timeout: the longest wait for a quorum; longer than a DiLoCo interval, since a joining
            replica waits for its peers' next sync (``TORCHFT_QUORUM_TIMEOUT_SEC`` overrides it).
        connect_timeout: to reach the Lighthouse and the peers' Managers.
        heartbeat: how often the Manager tells the Lighthouse it lives; the Lighthouse's
            ``--heartbeat_timeout_ms`` (5 s by default) must be many of these, and is how long a dead
            replica holds up its peers' next quorum.
        init_sync: heal every replica from one at the first quorum (leave ``True`` unless every replica
            seeds its model alike).

    Raises:
        LighthouseUnreachableError: nothing answers at the Lighthouse's address (within ``connect_timeout``).

    Example::

        manager = fastcomm.ft.connect(f"replica{replica}", lighthouse="http://127.0.0.1:29510")
    """
    address = lighthouse_address(lighthouse)
    if rank == 0:
        _check_reachable(address, connect_timeout.total_seconds())
    if store is None:
        store_host, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store_host, store_port = getattr(store, "host", host), store.port  # type: ignore[attr-defined]
    torchft = require_torchft()
    groups = torchft.ProcessGroupNCCL if torch.cuda.is_available() else torchft.ProcessGroupGloo
    return torchft.Manager(
        pg=groups(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout, rank=rank,
        world_size=world_size, store_addr=store_host, store_port=store_port, lighthouse_addr=address,
        replica_id=replica_id, hostname=host, heartbeat_interval=heartbeat,
        checkpoint_transport=_advertised_transport(torchft, host, timeout), init_sync=init_sync,
    )  # fmt: skip
