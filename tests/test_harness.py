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
