"""Issue 27, `log.wandb: auto`: online only with credentials and a service that answers; a service that never
answers (a local socket that accepts and stays silent) costs the run a few seconds, then it logs offline and
prints the upload command; `log.wandb` may change when a run resumes (a running paper run can be switched)."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from nagmoe.config import dump_yaml
from nagmoe.train.wandb_mode import resolve_wandb_mode, service_answers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def silent_service():
    """http://127.0.0.1:PORT that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.fixture
def answering_service():
    """http://127.0.0.1:PORT answering every request with 404."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_the_mode_follows_credentials_and_the_service(silent_service, answering_service, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", answering_service)
    assert resolve_wandb_mode("auto")[0] == "offline" and "credentials" in resolve_wandb_mode("auto")[1]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == ("online", None)  # an error status is an answer
    monkeypatch.setenv("WANDB_BASE_URL", silent_service)
    t0 = time.monotonic()
    mode, why = resolve_wandb_mode("auto", timeout_s=1.0)
    assert mode == "offline" and "did not answer" in why and time.monotonic() - t0 < 5
    assert not service_answers("http://127.0.0.1:1", 1.0)  # refused
    assert resolve_wandb_mode("online") == ("online", None) and resolve_wandb_mode("off") == ("off", None)


@pytest.mark.slow
def test_a_run_without_network_starts_offline_within_seconds_and_may_switch_on_resume(micro_config, silent_service,
                                                                                    tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_yaml(micro_config("train.checkpoint_every=2")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path), "WANDB_API_KEY": "x" * 40,
           "WANDB_BASE_URL": silent_service, "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)

    def train(*overrides):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", str(cfg_path), "--run-dir",
                            str(tmp_path / "run"), *overrides], cwd=REPO, capture_output=True, text=True,
                           env=env, timeout=300)
        return r, time.monotonic() - t0

    first, plain = train("train.max_steps=2", "log.wandb=off")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed, with_auto = train("train.max_steps=4", "log.wandb=auto")  # a changed log.wandb is no drift
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "log.wandb=auto: offline" in resumed.stderr and "did not answer within 3 s" in resumed.stderr
    assert "wandb sync " in resumed.stderr
    assert os.path.isdir(tmp_path / "run" / "wandb")
    assert with_auto - plain < 45, (plain, with_auto)  # the probe's 3 s and wandb's offline start, no hang
