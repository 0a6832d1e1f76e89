"""The progress watchdog's rules in one process (nagmoe/train/hang_watchdog.py); the real hang of a gloo rank
whose peer stopped is tests/recovery/test_hang_ranks.py."""
import io
import os
import signal
import threading
import time

import pytest

from nagmoe.config import LEGACY_VALUES, load_config
from nagmoe.train.hang_watchdog import (EXIT_HUNG, HANG_FLOOR_S, HANG_MULTIPLE, ProgressWatchdog,
                                        start_watchdog)


def watchdog(**kw):
    codes = []
    kw.setdefault("stream", io.StringIO())
    return ProgressWatchdog(0, exit_fn=codes.append, **kw), codes


def test_the_derived_limit_is_twenty_median_steps_with_a_floor():
    w, _ = watchdog(long_phase_s=900)
    assert w.limit() == 900  # the first step is a long phase (compilation, the first batch)
    for step in range(1, 6):
        w.step_done(step, 0.5)
    assert w.limit() == HANG_FLOOR_S  # 20 x 0.5 s is below the floor
    for step in range(6, 60):
        w.step_done(step, 30.0)
    assert w.limit() == HANG_MULTIPLE * 30.0  # the median of the recent steps, not the mean of all
    with w.phase("a checkpoint save"):
        assert w.limit() == 900 and w.phase_name == "a checkpoint save"
    assert w.limit() == HANG_MULTIPLE * 30.0


def test_it_fires_only_past_the_allowance_and_names_the_phase():
    w, _ = watchdog(timeout_s=10, long_phase_s=100)
    w.step_done(7, 0.1)
    t = w.last_progress
    assert w.check(t + 9.9) is None
    assert "no progress for 11 s (limit 10 s)" in w.check(t + 11)
    with w.phase("a checkpoint save"):
        t = w.last_progress
        assert w.check(t + 99) is None
        assert "in a checkpoint save" in w.check(t + 101)


def test_a_sigterm_without_progress_fires_after_the_grace_a_step_boundary_cancels_it():
    w, _ = watchdog(timeout_s=1000, term_grace_s=5)
    w.step_done(3, 0.1)
    w.term_at = w.last_progress + 1
    assert w.check(w.term_at + 4) is None
    assert "SIGTERM 6 s ago" in w.check(w.term_at + 6)
    w.step_done(4, 0.1)
    w.last_progress = w.term_at + 2  # the boundary came after the signal: the preemption checkpoint runs
    assert w.check(w.term_at + 6) is None


def test_firing_writes_one_line_and_every_threads_stack_then_exits_76(tmp_path):
    log = open(tmp_path / "rank.log", "w+")
    w, codes = watchdog(timeout_s=0.2, stream=log)
    w.step_done(12, 0.01)
    w.start()
    try:
        deadline = time.monotonic() + 20
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w.stop()
    log.seek(0)
    text = log.read()
    assert codes == [EXIT_HUNG], text
    first = text.splitlines()[0]
    assert first.startswith("[nagmoe] rank 0 on ") and "hung after step 12: no progress for" in first
    assert "Current thread" in text or "Thread 0x" in text  # faulthandler's dump of every thread
    assert "test_firing_writes_one_line" in text  # the main thread's stack: where it was blocked


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread")
def test_a_real_sigterm_reaches_the_watchdog_while_the_main_thread_is_blocked():
    """The main thread blocked in C code runs no Python handler; the wakeup fd still tells the watchdog."""
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    w, codes = watchdog(timeout_s=1000, term_grace_s=0.5)
    w.step_done(1, 0.01)
    w.start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        end = time.monotonic() + 10
        while not codes and time.monotonic() < end:
            time.sleep(0.05)  # (a sleep returns to the eval loop; the wakeup byte was written at delivery)
    finally:
        w.stop()
        signal.signal(signal.SIGTERM, previous)
    assert codes == [EXIT_HUNG] and w.fired.startswith("SIGTERM")


def test_off_and_the_legacy_value():
    off = start_watchdog(0, 0, 0)
    assert off._thread is None and off._wake_r is None  # not started: nothing watched, no signal fd taken
    off.step_done(1, 0.1)
    off.stop()
    assert LEGACY_VALUES["train.hang_timeout_s"] == 0.0  # a run dir from before resumes without it
    assert load_config(None).train.hang_timeout_s is None  # new runs: derived
    w = start_watchdog(0, None, 5, environ={"NAGMOE_HANG_LONG_PHASE_S": "7", "NAGMOE_HANG_TERM_GRACE_S": "2"})
    try:
        assert (w.long_phase_s, w.term_grace_s, w.last_step) == (7.0, 2.0, 5)
    finally:
        w.stop()


def test_stop_wakes_the_watch_thread_instead_of_waiting_out_its_interval(monkeypatch):
    """Every Trainer.run ends with stop(): the thread sleeps in select() on the signal pipe for up to its interval
    (5 s), so stop() must wake it. With an interval of 60 s, a stop that only sets the event would leave the
    thread alive past stop()'s 5 s join."""
    w, _ = watchdog()
    monkeypatch.setattr(w, "_interval", lambda: 60.0)
    w.start()
    assert w._wake_r is not None  # the main thread: the signal pipe is in use
    time.sleep(0.2)  # the thread is in its select()
    w.stop()
    assert not w._thread.is_alive()
