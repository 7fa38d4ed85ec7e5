"""benchmarks.netlab.Nodes: rank placement, and (as root with ip/tc) where its traffic goes."""

import subprocess

import pytest

from benchmarks import netlab

needs_netlab = pytest.mark.skipif(netlab.unavailable_reason() is not None,
                                  reason=netlab.unavailable_reason() or "")


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_ranks_are_placed_node_by_node_as_torchrun_numbers_them(ranks_per_node: int) -> None:
    nodes = netlab.Nodes(ranks_per_node=ranks_per_node)
    assert nodes.world_size == 2 * ranks_per_node
    for rank in range(nodes.world_size):
        node, local = divmod(rank, ranks_per_node)
        env = nodes.rank_env(rank)
        assert nodes.node_of(rank) == node
        assert nodes.rank_prefix(rank) == ["ip", "netns", "exec", nodes.namespaces[node]]
        assert env == {"GLOO_SOCKET_IFNAME": nodes.interfaces[node], "MASTER_ADDR": nodes.addresses[0],
                       "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(ranks_per_node),
                       "GROUP_RANK": str(node)}


def test_addresses_stay_in_the_netlab_subnet() -> None:
    nodes = netlab.Nodes()
    assert all(address.startswith(netlab.SUBNET_PREFIX) for address in nodes.addresses)
    assert nodes.master_addr == nodes.addresses[0]


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_world_is_named(rank: int) -> None:
    with pytest.raises(ValueError, match=f"rank {rank} is outside 0..3"):
        netlab.Nodes(ranks_per_node=2).node_of(rank)


def test_ranks_per_node_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="ranks_per_node must be at least 1, got 0"):
        netlab.Nodes(ranks_per_node=0)


def test_a_counter_direction_other_than_tx_or_rx_is_named() -> None:
    with pytest.raises(ValueError, match="direction must be 'tx' or 'rx', got 'up'"):
        netlab.Nodes().counter_path(0, "up")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@needs_netlab
def test_intra_node_traffic_stays_off_the_veth_and_cross_node_traffic_crosses_it() -> None:
    nbytes = 8 << 20
    with netlab.Nodes(rate="1gbit") as nodes:
        traffic = netlab.measure_node_traffic(nodes, nbytes=nbytes)
        names = nodes.namespaces
        assert all(name in _namespaces() for name in names)
    # a few stray packets (IPv6 neighbour discovery) at most inside the node; all of it, and headers, across
    assert traffic.intra_link_bytes < nbytes // 100
    assert nbytes <= traffic.cross_link_bytes < nbytes * 1.1
    assert not any(name in _namespaces() for name in names)


@needs_netlab
def test_namespaces_are_removed_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with netlab.Nodes() as nodes:
            names = nodes.namespaces
            raise RuntimeError("inside")
    assert not any(name in _namespaces() for name in names)
