"""`free_port(outside_ephemeral=True)`: a port a server binds only after Ray has started processes (which take
ephemeral ports of their own) comes from below the kernel's ephemeral range and above Ray's worker ports; a
bench_tiers peer run failed when the HTTP port handed out before Ray started was taken by a Ray process."""

import socket

from loadtest.serve_harness import free_port


def test_a_port_for_after_ray_starts_lies_outside_the_ephemeral_range_and_is_free():
    for _ in range(20):
        port = free_port(outside_ephemeral=True)
        assert 20000 <= port <= 32767
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now
    assert free_port() > 0
