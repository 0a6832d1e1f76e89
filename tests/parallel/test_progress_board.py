"""Issue 61, build 1: the progress board names who fell silent or behind, from a real TCPStore (a server and one
client connection per rank, as every rank of a job holds), with the heartbeat threads really running."""
import socket
import time

import pytest
import torch.distributed as dist

from nagmoe.parallel.progress_board import ProgressBoard, rank_groups

FAST = dict(interval_s=0.1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del server


def client(port):
    from datetime import timedelta

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def boards(port, hosts, steps):
    out = []
    for rank, (host, step) in enumerate(zip(hosts, steps)):
        board = ProgressBoard(client(port), rank, len(hosts), host, **FAST).start(step)
        out.append(board)
    reader = client(port)
    deadline = time.monotonic() + 30
    while not all(reader.check([b.key(b.rank)]) for b in out):  # every heartbeat thread has written
        assert time.monotonic() < deadline, "a heartbeat thread never wrote"
        time.sleep(0.05)
    return out


def test_rank_groups_and_host_names():
    from nagmoe.parallel.progress_board import host_name

    assert host_name("node-3.cluster") == "node-3.cluster" and host_name("a b\n") == "'a b\\n'"
    assert rank_groups([2, 3]) == "ranks 2-3" and rank_groups([4]) == "rank 4"
    assert rank_groups([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_the_silent_ranks_are_named_with_host_and_step(store_port):
    """Ranks 2-3 (on n2) stop beating at step 24 (a frozen process, a cut link); rank 1 keeps beating, also at
    24 (it waits in the collective with rank 0, which finished 25): only the silent ones are named."""
    bs = boards(store_port, ["n1", "n1", "n2", "n2"], [25, 24, 24, 24])
    for b in bs[2:]:
        b.stop()
    time.sleep(0.2)
    line = bs[0].culprits(25, silence_s=2.0)
    assert line == ("ranks 2-3 on n2 silent since step 24 (no heartbeat for 2 s: stopped, hung or cut off); "
                    "this rank (0 on n1) last finished step 25"), line
    for b in bs[:2]:
        b.stop()


def test_without_silence_the_ranks_behind_are_named(store_port):
    bs = boards(store_port, ["n1", "n2", "n3"], [25, 25, 24])
    line = bs[0].culprits(25, silence_s=2.0)
    assert line.startswith("rank 2 on n3 last finished step 24; this rank (0 on n1)"), line
    bs[2].step_done(25)
    time.sleep(0.3)
    assert bs[0].culprits(25, silence_s=2.0).startswith("every rank answers and none is behind"), line
    for b in bs:
        b.stop()


def test_a_rank_that_never_wrote_is_named(store_port):
    bs = boards(store_port, ["n1", "n2"], [3, 3])
    board = ProgressBoard(client(store_port), 0, 3, "n1", **FAST)  # a world of 3: rank 2 never started
    assert "rank 2 never reported a step" in board.culprits(3, silence_s=1.0)
    for b in bs:
        b.stop()


def test_an_unreachable_store_is_said_within_the_bound(monkeypatch):
    """The store's process is gone (its host lost): the line says so, bounded by READ_TIMEOUT_S, never hangs."""
    import subprocess
    import sys

    import nagmoe.parallel.progress_board as pb

    monkeypatch.setattr(pb, "READ_TIMEOUT_S", 2.0)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore("
                               f"'127.0.0.1', {port}, is_master=True, wait_for_workers=False); print(1, flush=True); "
                               "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "1"
        board = ProgressBoard(client(port), 0, 2, "n1", **FAST)
    finally:
        server.kill()
        server.wait()
    t0 = time.monotonic()
    line = board.culprits(7, silence_s=0.1)
    assert line.startswith("the rendezvous store did not answer ("), line
    assert time.monotonic() - t0 < 5
