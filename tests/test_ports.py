"""The test clusters' port helper: the ports of one test never collide."""

from ports import free_port


def test_no_port_is_handed_out_twice_in_one_process() -> None:
    # A cluster takes five or six ports; CI once got grpc_port == metrics_port from two independent draws.
    ports = [free_port() for _ in range(2_000)]
    assert len(set(ports)) == len(ports)
