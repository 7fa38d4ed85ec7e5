"""A shaped network link between two network namespaces, made and removed for one benchmark run.

:class:`Link` builds, as root with ``ip`` and ``tc``:

1. two namespaces ``fcnl<pid>a`` and ``fcnl<pid>b`` (the pid keeps concurrent runs apart and lets a later
   run recognise and remove what a dead one left behind), each with ``lo`` up;
2. a veth pair ``fcv<pid>a`` / ``fcv<pid>b``, one end in each namespace, addressed 10.231.0.1/24 and
   10.231.0.2/24 and with no other route, so nothing sent inside can reach any other address;
3. a token-bucket filter on each end (``tc qdisc ... tbf rate 1gbit burst 256kb latency 50ms``), which
   shapes both directions, since tbf shapes what an interface sends.

Leaving the ``with`` block, an exception, Ctrl-C, SIGTERM and interpreter exit all delete both namespaces
(which deletes the veth pair with them). Commands for a namespace are prefixed with :meth:`Link.exec_prefix`.

:class:`HostLink` joins one namespace to the root namespace instead; :class:`Nodes` runs several ranks in
each of :class:`Link`'s two namespaces (two "nodes" whose ranks talk over their own loopback and reach the
other node over the shaped veth).

Run ``python -m benchmarks.netlab`` to build a link, measure its throughput and remove it again;
``python -m benchmarks.netlab --nodes`` checks the two-node topology (intra-node traffic off the veth).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType

__all__ = [
    "HostLink",
    "Link",
    "NodeTraffic",
    "Nodes",
    "cleanup_stale",
    "measure_node_traffic",
    "measure_throughput",
    "unavailable_reason",
]

SUBNET_PREFIX = "10.231.0."
_NS_PATTERN = re.compile(r"^fcnl(\d+)([ab])$")
_COMMAND_TIMEOUT_S = 20.0
_CHUNK_BYTES = 1 << 20
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unavailable_reason() -> str | None:
    """Why a :class:`Link` cannot be built here (not root, no ``ip``/``tc``), or ``None`` if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "netlab needs root to create network namespaces (run as root to get the 1 Gbit/s link)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs the `{tool}` command (iproute2), which is not on PATH"
    return None


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces and root-namespace veths left by netlab runs whose process is gone; return them."""
    removed: list[str] = []
    listing = _run(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for match in re.finditer(r"^\d+: (fcv(\d+)[ab])[@:]", links, flags=re.MULTILINE):
        if not _pid_alive(int(match.group(2))):
            _run(["ip", "link", "del", match.group(1)], check=False)
            removed.append(match.group(1))
    return removed


class Link:
    """Two namespaces joined by a veth pair shaped to ``rate`` in both directions.

    Args:
        rate: the tbf rate, in tc's notation (``"1gbit"``); ``None`` leaves the link unshaped.
        burst: the tbf bucket size.
        latency: the tbf queueing limit.

    Example::

        with Link(rate="1gbit") as link:
            subprocess.run([*link.exec_prefix(0), "ping", "-c1", link.addresses[1]])
    """

    def __init__(self, rate: str | None = "1gbit", burst: str = "256kb", latency: str = "50ms") -> None:
        self.rate = rate
        self.burst = burst
        self.latency = latency
        pid = os.getpid()
        self.namespaces = (f"fcnl{pid}a", f"fcnl{pid}b")
        self.interfaces = (f"fcv{pid}a", f"fcv{pid}b")
        self.addresses = (f"{SUBNET_PREFIX}1", f"{SUBNET_PREFIX}2")
        self._up = False
        self._previous_sigterm: signal.Handlers | None = None

    def exec_prefix(self, side: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[side]]

    def up(self) -> Link:
        """Build the namespaces, the veth pair, the addresses and the shaping; undo everything on failure."""
        self._begin_up()
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            a, b = self.interfaces
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _run(["ip", "link", "set", dev, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                if self.rate is not None:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                          "rate", self.rate, "burst", self.burst, "latency", self.latency])
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Delete both namespaces (and with them the veth pair); safe to call more than once."""
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        # If the pair was made but not yet moved into the namespaces, it is still in ours.
        if self.interfaces[0] in _run(["ip", "-o", "link", "show"], check=False).stdout:
            _run(["ip", "link", "del", self.interfaces[0]], check=False)
        atexit.unregister(self.down)
        self._restore_sigterm()

    def _begin_up(self) -> None:
        """What every topology's ``up`` starts with: refuse where netlab cannot run, remove what a killed
        earlier run left, and arrange for ``down`` at exit and on SIGTERM."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        cleanup_stale()
        self._up = True
        atexit.register(self.down)
        self._trap_sigterm()

    def _trap_sigterm(self) -> None:
        # SIGTERM skips atexit and finally blocks unless it becomes an exception.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def _raise(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.SIG_DFL
        signal.signal(signal.SIGTERM, _raise)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def __enter__(self) -> Link:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()


def _sink(port: int) -> None:
    """Accept one connection on ``port`` and read it to the end (run inside the receiving namespace)."""
    with socket.create_server(("", port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            while conn.recv(_CHUNK_BYTES):
                pass


def _source(host: str, port: int, nbytes: int) -> None:
    """Send ``nbytes`` to ``host:port`` and print the achieved MB/s (run inside the sending namespace)."""
    payload = bytes(_CHUNK_BYTES)
    with socket.create_connection((host, port), timeout=_COMMAND_TIMEOUT_S) as conn:
        start = time.perf_counter()
        sent = 0
        while sent < nbytes:
            conn.sendall(payload)
            sent += len(payload)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the sink to close, so the time covers delivery and not just buffering
        seconds = time.perf_counter() - start
    print(f"{sent / seconds / 1e6:.1f}", flush=True)


def measure_throughput(link: Link, nbytes: int = 64 << 20, port: int = 29399) -> float:
    """Send ``nbytes`` over TCP from side 0 to side 1 of ``link`` and return the achieved MB/s."""
    python = [sys.executable, "-m", "benchmarks.netlab"]
    sink = subprocess.Popen([*link.exec_prefix(1), *python, "--sink", str(port)],
                            stdout=subprocess.PIPE, text=True, cwd=_REPO_ROOT)
    try:
        assert sink.stdout is not None
        sink.stdout.readline()
        source = subprocess.run(
            [*link.exec_prefix(0), *python, "--source", link.addresses[1], str(port), str(nbytes)],
            capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S * 3, cwd=_REPO_ROOT, check=True,
        )
        return float(source.stdout.strip().splitlines()[-1])
    finally:
        sink.kill()
        sink.wait()



class HostLink(Link):
    """One namespace joined to the root namespace by a veth pair shaped to ``rate`` in both directions.

    For a server inside the namespace and its clients in the benchmark process itself:

    1. a namespace ``fcnl<pid>b`` with ``lo`` up (named as :class:`Link` names its second side, so
       :func:`cleanup_stale` removes what a dead run left behind);
    2. a veth pair: ``fcv<pid>a`` stays in the root namespace, ``fcv<pid>b`` goes into the namespace;
       they get the two host addresses of a free ``/30`` in ``10.231.0.128/25`` (the root namespace
       may hold several at once; :class:`Link` keeps ``10.231.0.1`` and ``.2`` inside its own
       namespaces), so the only new route is that ``/30`` and nothing else is reachable through it;
    3. the same token-bucket filter as :class:`Link` on each end.

    ``addresses`` is ``(root end, namespace end)`` once up; ``exec_prefix(0)`` runs a program inside the
    namespace. A process holds at most one :class:`HostLink` at a time (the names carry its pid), and not
    beside a :class:`Link`.

    Example::

        with HostLink(rate="1gbit") as link:
            server = subprocess.Popen([*link.exec_prefix(0), "python", "-m", "http.server", "8000"])
            # from here: http://{link.addresses[1]}:8000/
    """

    def __init__(self, rate: str | None = "1gbit", burst: str = "256kb", latency: str = "50ms") -> None:
        super().__init__(rate, burst, latency)
        self.namespaces = (self.namespaces[1],)

    def exec_prefix(self, side: int = 0) -> list[str]:
        """The command prefix that runs a program inside the namespace (``side`` must be 0)."""
        if side != 0:
            raise ValueError(f"a HostLink has one namespace (side 0), got side={side}")
        return ["ip", "netns", "exec", self.namespaces[0]]

    def up(self) -> HostLink:
        """Build the namespace, the veth pair, the addresses and the shaping; undo everything on failure."""
        self._begin_up()
        try:
            ns, (outer, inner) = self.namespaces[0], self.interfaces
            self.addresses = _free_host_pair()
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "addr", "add", f"{self.addresses[0]}/30", "dev", outer])
            _run(["ip", "link", "set", outer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[1]}/30", "dev", inner])
            _run(["ip", "-n", ns, "link", "set", inner, "up"])
            if self.rate is not None:
                shaping = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
                _run(["tc", "qdisc", "add", "dev", outer, *shaping])
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, *shaping])
        except BaseException:
            self.down()
            raise
        return self

    def __enter__(self) -> HostLink:
        return self.up()


def _free_host_pair() -> tuple[str, str]:
    """The two host addresses of the first ``/30`` in ``10.231.0.128/25`` that no root interface uses,
    starting from one picked by pid (concurrent runs rarely collide, and when they do the next is free)."""
    taken = set(re.findall(r"inet (10\.231\.0\.\d+)/", _run(["ip", "-o", "-4", "addr", "show"]).stdout))
    blocks = 32
    first = os.getpid() % blocks
    for step in range(blocks):
        base = 128 + 4 * ((first + step) % blocks)
        pair = (f"{SUBNET_PREFIX}{base + 1}", f"{SUBNET_PREFIX}{base + 2}")
        if not taken & set(pair):
            return pair
    raise RuntimeError("no free /30 left in 10.231.0.128/25 in the root namespace (leftover HostLinks?)")



class Nodes(Link):
    """Two "nodes" of ``ranks_per_node`` ranks each: a namespace per node, joined by one shaped veth pair.

    The topology of a small cluster whose nodes talk over one slow link:

    1. the two namespaces and the veth pair of :class:`Link` (``10.231.0.1`` in node 0, ``10.231.0.2`` in
       node 1, tbf ``rate`` on each end, so both directions are shaped);
    2. ranks are placed as torchrun places them: ``rank // ranks_per_node`` is the node, ``rank %
       ranks_per_node`` the local rank; every rank of a node runs in that node's namespace;
    3. every rank binds gloo to its node's veth address (``GLOO_SOCKET_IFNAME``); a packet between two ranks
       of one node goes from that address to itself, which the kernel delivers over the namespace's
       loopback, so only traffic between the nodes crosses (and is counted on) the shaped veth;
    4. the rendezvous (``MASTER_ADDR``) is node 0's address, reachable from node 0 locally and from node 1
       over the veth.

    :meth:`link_bytes` reads the veth's byte counters (bytes each node sent to the other, link-layer
    headers included); :func:`measure_node_traffic` checks that intra-node traffic stays off the veth. The
    namespaces are named as :class:`Link` names them, so a process holds one of the two at a time.

    Example::

        with Nodes(ranks_per_node=2, rate="1gbit") as nodes:
            for rank in range(nodes.world_size):
                env = dict(os.environ, **nodes.rank_env(rank), RANK=str(rank))
                subprocess.Popen([*nodes.rank_prefix(rank), "python", "train.py"], env=env)
    """

    def __init__(
        self, ranks_per_node: int = 2, rate: str | None = "1gbit", burst: str = "256kb", latency: str = "50ms"
    ) -> None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        super().__init__(rate, burst, latency)
        self.ranks_per_node = ranks_per_node

    @property
    def world_size(self) -> int:
        """The number of ranks: two nodes of :attr:`ranks_per_node`."""
        return 2 * self.ranks_per_node

    @property
    def master_addr(self) -> str:
        """The rendezvous address: node 0's veth address."""
        return self.addresses[0]

    def node_of(self, rank: int) -> int:
        """The node (0 or 1) that ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1} ({self.world_size} ranks)")
        return rank // self.ranks_per_node

    def rank_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs ``rank``'s process inside its node's namespace."""
        return self.exec_prefix(self.node_of(rank))

    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment ``rank`` needs beside ``RANK``/``WORLD_SIZE``: gloo's interface, the
        rendezvous address, and torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``."""
        node = self.node_of(rank)
        return {
            "GLOO_SOCKET_IFNAME": self.interfaces[node],
            "MASTER_ADDR": self.master_addr,
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node),
        }

    def counter_path(self, node: int, direction: str = "tx") -> str:
        """The sysfs file of node ``node``'s veth ``tx``/``rx`` byte counter, valid inside that node's
        namespace (``ip netns exec`` mounts the namespace's own ``/sys``)."""
        if direction not in ("tx", "rx"):
            raise ValueError(f"direction must be 'tx' or 'rx', got {direction!r}")
        return f"/sys/class/net/{self.interfaces[node]}/statistics/{direction}_bytes"

    def link_bytes(self) -> tuple[int, int]:
        """The bytes node 0 and node 1 have sent over the veth since it was made (its tx counters)."""
        sent = [int(_run([*self.exec_prefix(node), "cat", self.counter_path(node)]).stdout.strip())
                for node in (0, 1)]
        return sent[0], sent[1]

    def __enter__(self) -> Nodes:
        self.up()
        return self


@dataclasses.dataclass(frozen=True)
class NodeTraffic:
    """What :func:`measure_node_traffic` measured: TCP throughput and the bytes the veth carried meanwhile."""

    nbytes: int
    intra_mb_per_s: float  # two processes of node 0, to node 0's own address
    intra_link_bytes: int  # bytes on the veth (both directions) during that transfer
    cross_mb_per_s: float  # node 0 to node 1
    cross_link_bytes: int  # bytes on the veth (both directions) during that transfer


def _transfer(nodes: Nodes, sender: int, receiver: int, nbytes: int, port: int) -> tuple[float, int]:
    """Send ``nbytes`` from a process of node ``sender`` to one of node ``receiver`` at the receiver's
    veth address; return the MB/s and the bytes the veth carried in both directions meanwhile."""
    python = [sys.executable, "-m", "benchmarks.netlab"]
    before = sum(nodes.link_bytes())
    sink = subprocess.Popen([*nodes.exec_prefix(receiver), *python, "--sink", str(port)],
                            stdout=subprocess.PIPE, text=True, cwd=_REPO_ROOT)
    try:
        assert sink.stdout is not None
        sink.stdout.readline()
        source = subprocess.run(
            [*nodes.exec_prefix(sender), *python, "--source", nodes.addresses[receiver], str(port),
             str(nbytes)],
            capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S * 3, cwd=_REPO_ROOT, check=True,
        )
    finally:
        sink.kill()
        sink.wait()
    return float(source.stdout.strip().splitlines()[-1]), sum(nodes.link_bytes()) - before


def measure_node_traffic(nodes: Nodes, nbytes: int = 64 << 20, port: int = 29398) -> NodeTraffic:
    """Check where traffic goes: ``nbytes`` between two processes of node 0 (to its own veth address, as
    gloo's intra-node pairs connect), then from node 0 to node 1, counting the veth's bytes for each.

    Intra-node bytes that stayed off the veth show as ``intra_link_bytes`` near zero (a few packets of
    other traffic at most) and ``intra_mb_per_s`` far above the link rate.

    Example::

        with Nodes() as nodes:
            traffic = measure_node_traffic(nodes)
            assert traffic.intra_link_bytes < traffic.nbytes // 100
    """
    intra_rate, intra_bytes = _transfer(nodes, 0, 0, nbytes, port)
    cross_rate, cross_bytes = _transfer(nodes, 0, 1, nbytes, port)
    return NodeTraffic(nbytes, intra_rate, intra_bytes, cross_rate, cross_bytes)



def main(argv: Sequence[str] | None = None) -> int:
    """Build a shaped link, report its throughput, and remove it (the worker modes are internal)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="tbf rate in tc notation, or 'none' for unshaped")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--source", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", action="store_true",
                        help="build the two-node topology (Nodes) and check that intra-node traffic "
                             "stays off the shaped veth")
    args = parser.parse_args(argv)
    if args.sink is not None:
        _sink(args.sink)
        return 0
    if args.source is not None:
        _source(args.source[0], int(args.source[1]), int(args.source[2]))
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    if args.nodes:
        with Nodes(rate=None if args.rate == "none" else args.rate) as nodes:
            traffic = measure_node_traffic(nodes)
        print(f"nodes {nodes.namespaces}, veth {nodes.interfaces}, rate {args.rate}, "
              f"{traffic.nbytes / 1e6:.0f} MB per transfer")
        print(f"intra-node (node 0 -> its own {nodes.addresses[0]}): {traffic.intra_mb_per_s:.1f} MB/s, "
              f"{traffic.intra_link_bytes} bytes on the veth")
        print(f"cross-node ({nodes.addresses[0]} -> {nodes.addresses[1]}): "
              f"{traffic.cross_mb_per_s:.1f} MB/s, {traffic.cross_link_bytes} bytes on the veth")
        return 0
    with Link(rate=None if args.rate == "none" else args.rate) as link:
        print(f"namespaces {link.namespaces}, veth {link.interfaces}, rate {args.rate}")
        print(f"throughput {link.addresses[0]} -> {link.addresses[1]}: {measure_throughput(link):.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
