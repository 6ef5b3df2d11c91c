"""The multi-rank harness survives a rendezvous port taken between free_port() and the bind."""
import socket

from tests import harness


def _rank_id(rank):
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=1, num_attention_heads=4, hidden_size=64)
    return rank


def test_a_taken_rendezvous_port_is_retried_on_a_fresh_one(monkeypatch):
    """CI once lost a module's fixture (9 tests) to EADDRINUSE: another process bound the port the
    harness had just found free. The first port handed out here is held open, as that process did."""
    orig, held = harness.free_port, []

    def first_port_taken():
        port = orig()
        if not held:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen(1)
            held.append(s)
        return port

    monkeypatch.setattr(harness, "free_port", first_port_taken)
    try:
        assert harness.run_world(_rank_id, 2, timeout=120) == [0, 1]
    finally:
        for s in held:
            s.close()
    assert len(held) == 1


def _ports(rank, calls):
    import os
    import time

    got = []
    for i in range(calls):
        if rank == 0:
            time.sleep(0.2 * i)                 # the others must wait for rank 0's choice, not read a stale one
        got.append((harness.next_port(), int(os.environ["MASTER_PORT"])))
    return got


def test_next_port_is_rank_0_s_choice_at_the_time_of_use_on_every_rank():
    """The ports of a world's successive jobs: one per call, the same on every rank, chosen by rank 0
    when the call is made, and set as MASTER_PORT."""
    world = harness.run_world(_ports, 3, 4, timeout=60)
    assert world[1] == world[0] and world[2] == world[0]
    assert all(port == env for port, env in world[0])
    assert len({port for port, _ in world[0]}) >= 2       # fresh choices, not one port reused


def test_a_launcher_whose_port_was_taken_is_started_again_on_another():
    """on_a_fresh_port (the torchrun / fake-SLURM launches of test_faults and test_pretrain_launchers):
    PortTaken starts the launch again on a newly picked port, up to three launches in all; what
    the launch returns or raises otherwise passes through."""
    import pytest

    ports = []

    def launch(port, taken):
        ports.append(port)
        if len(ports) <= taken:
            raise harness.PortTaken("EADDRINUSE")
        return port

    assert harness.on_a_fresh_port(lambda p: launch(p, 2)) == ports[-1] and len(ports) == 3
    assert all(0 < p < 65536 for p in ports)
    ports.clear()
    with pytest.raises(harness.PortTaken):
        harness.on_a_fresh_port(lambda p: launch(p, 3))
    assert len(ports) == 3
    ports.clear()
    with pytest.raises(ValueError):
        harness.on_a_fresh_port(lambda p: (ports.append(p), int("x")))
    assert len(ports) == 1
