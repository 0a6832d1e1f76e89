"""Issue 41, build item 6: every NAGMOE_* number finite, positive, bounded (7 days for timeouts and stale
intervals, 1 day for refreshes) and related (lease refresh <= stale / 3), checked at the start of `nagmoe train`,
`launch` and `experiment`: one line naming the variable, exit 2, nothing written. No new lower bounds: the tests
run with sub-second values. On c9620be a refresh near 9.2e9 s killed the lease thread (OverflowError in
Event.wait), a stale interval of 1 s or a refresh above the stale interval made every lease stale, and
NAGMOE_DIST_TIMEOUT_S=1e300 was a traceback."""
import os
import subprocess
import sys

import pytest

from nagmoe.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
SETTINGS = ("NAGMOE_LEASE_REFRESH_S", "NAGMOE_LEASE_STALE_S", "NAGMOE_DIST_TIMEOUT_S", "NAGMOE_DIST_TRAIN_TIMEOUT_S")

BAD = [  # (environment, the variable the line must name)
    ({"NAGMOE_LEASE_REFRESH_S": "1e10"}, "NAGMOE_LEASE_REFRESH_S"),      # OverflowError in the lease thread
    ({"NAGMOE_LEASE_REFRESH_S": "90000"}, "NAGMOE_LEASE_REFRESH_S"),     # more than a day
    ({"NAGMOE_LEASE_STALE_S": "1"}, "NAGMOE_LEASE_STALE_S"),             # the default refresh (5 s) > 1/3
    ({"NAGMOE_LEASE_REFRESH_S": "4", "NAGMOE_LEASE_STALE_S": "10"}, "NAGMOE_LEASE_REFRESH_S"),
    ({"NAGMOE_LEASE_REFRESH_S": "1e10", "NAGMOE_LEASE_STALE_S": "1"}, "NAGMOE_LEASE_REFRESH_S"),
    ({"NAGMOE_LEASE_STALE_S": "1e9"}, "NAGMOE_LEASE_STALE_S"),           # more than a week
    ({"NAGMOE_DIST_TIMEOUT_S": "1e300"}, "NAGMOE_DIST_TIMEOUT_S"),       # timedelta overflow
    ({"NAGMOE_DIST_TIMEOUT_S": "nan"}, "NAGMOE_DIST_TIMEOUT_S"),
    ({"NAGMOE_DIST_TRAIN_TIMEOUT_S": "1e300"}, "NAGMOE_DIST_TRAIN_TIMEOUT_S"),  # read at the first step: at start
    ({"NAGMOE_LEASE_STALE_S": "inf"}, "NAGMOE_LEASE_STALE_S"),
    ({"NAGMOE_LEASE_REFRESH_S": "9" * 5000}, "NAGMOE_LEASE_REFRESH_S"),  # a 5,000-digit number: bounded message
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,name", BAD, ids=[",".join(f"{k[7:]}={v[:8]}" for k, v in e.items()) for e, _ in BAD])
@pytest.mark.parametrize("command", ["train", "launch", "experiment"])
def test_a_bad_setting_is_one_line_at_start_naming_it(command, env, name, clean_env, tmp_path, capsys):
    for key, value in env.items():
        clean_env.setenv(key, value)
    exp = tmp_path / "exp.yaml"
    exp.write_text(f'{{"name": "x", "flop_budget": 1e12, "seeds": [0], "runs": {{"nag": {{"config": "{TINY}"}}}}}}')
    args = {"train": ["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--quiet"],
            "launch": ["launch", "slurm", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--gpus-per-node", "0"],
            "experiment": ["experiment", str(exp), "--slurm", "--runs-root", str(tmp_path / "runs")]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and len(err[0]) <= 600, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()  # nothing written


def test_the_process_shows_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "NAGMOE_DIST_TIMEOUT_S": "1e300", "NAGMOE_LEASE_REFRESH_S": "1e10"}
    out = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", TINY, "--run-dir",
                          str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_sub_second_and_boundary_values_are_accepted():
    from nagmoe.parallel.env import dist_timeout_s
    from nagmoe.base.environment import lease_intervals

    assert lease_intervals({"NAGMOE_LEASE_REFRESH_S": "0.05", "NAGMOE_LEASE_STALE_S": "0.15"}) == (0.05, 0.15)
    assert lease_intervals({}) == (5.0, 600.0)
    assert lease_intervals({"NAGMOE_LEASE_REFRESH_S": "86400", "NAGMOE_LEASE_STALE_S": "604800"}) == (86400.0, 604800.0)
    assert dist_timeout_s({"NAGMOE_DIST_TIMEOUT_S": "0.5"}) == 0.5
    assert dist_timeout_s({"NAGMOE_DIST_TIMEOUT_S": "604800"}) == 604800.0


def test_the_lease_refuses_the_intervals_before_it_starts_a_thread(clean_env, tmp_path):
    """The lease itself reads the bounded intervals (an API user's Trainer gets the same line)."""
    from nagmoe.rundir.lease import RunDirLease
    from nagmoe.base.errors import UserError

    clean_env.setenv("NAGMOE_LEASE_REFRESH_S", "1e10")
    with pytest.raises(UserError, match="NAGMOE_LEASE_REFRESH_S"):
        RunDirLease(str(tmp_path / "run")).acquire()
    assert not (tmp_path / "run").exists()


def test_a_capped_cpu_capability_compiles_into_an_inductor_cache_of_its_own(tmp_path, monkeypatch):
    """torch's inductor cache is not keyed on ATEN_CPU_CAPABILITY: kernels compiled by an uncapped process and
    loaded by one capped at avx2 gave NaN in the fused NAG update (tests/gpu's CPU stand-in, under `make test`
    with ATEN_CPU_CAPABILITY=avx2 after a native run; a fresh cache passed). Each capped setting gets a directory
    of its own; uncapped processes and a cache the user chose are left alone."""
    from nagmoe.base.environment import inductor_cache_per_cpu_isa

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert inductor_cache_per_cpu_isa({}) is None  # uncapped: torch's default directory
    assert inductor_cache_per_cpu_isa({"TORCHINDUCTOR_CACHE_DIR": "/mine", "ATEN_CPU_CAPABILITY": "avx2"}) is None
    dirs = {}
    for caps in ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"},
                 {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, {"MKL_ENABLE_INSTRUCTIONS": "../x"}):
        env = dict(caps)
        path = inductor_cache_per_cpu_isa(env)
        assert env["TORCHINDUCTOR_CACHE_DIR"] == path and os.path.dirname(path) == str(tmp_path), path
        dirs[path] = caps
    assert len(dirs) == 4  # one directory per setting, none of them torch's default (torchinductor_<user>)
    assert all("_isa-" in os.path.basename(p) and "/" not in os.path.basename(p) for p in dirs)
