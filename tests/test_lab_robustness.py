"""The Lab under what a notebook user can do to it (issue 38): two threads calling at once, an engine
killed or hung in the middle of a step loop, the stop button during a wait; on 2 real CPU engines of an ipyparallel cluster.

One cluster serves the module; every call has a timeout, and the fixture stops the cluster even when a
test fails. (tests/test_lab.py covers a rank stuck in a collective, an engine that exits through a
Lab call, and the restart after them.)"""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from xdit_lab import ParallelConfig
from xdit_lab.lab import Lab, LabError
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3, guidance_scale=3.0, seed=7)
COLLECTIVE_TIMEOUT_S = 10  # torch.distributed's timeout on the engines
LAB_TIMEOUT_S = 90  # the Lab's wait for any call


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))  # not the user's ~/.ipython
        with Lab(n=2, timeout_s=LAB_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S) as lab:
            yield lab


def _when_holding(lab, what, timeout_s=30):
    """Wait until lab.{what}, called from another thread, has the engines."""
    deadline = time.monotonic() + timeout_s
    while (lab.calls.holder is None or lab.calls.holder.what != what) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lab.calls.holder is not None and lab.calls.holder.what == what


def test_a_second_call_from_another_thread_waits_or_is_refused_by_name(lab):
    """A thread's call holds the engines (rank 0 sleeps 3 s). A call from this thread to rank 1 only, which
    engine 1 could run at once, runs only after it: engine 1's clock reads at least 2.5 s after it was made.
    Control: the same request sent to engine 1 through ipyparallel directly, past the Lab, runs within 1 s
    (engine 1 is free: the wait is the Lab's). With timeout_s=0.5 the second call is refused after 0.5 s
    by a LabError naming the call that holds the engines and its thread; the Lab then answers again."""
    engine_1 = lab.ranks[1]["engine"]
    with ThreadPoolExecutor(1, thread_name_prefix="widget-callback") as pool:
        slow = pool.submit(lab.call, time.sleep, 3, ranks=[0], state=False, what="slow")
        _when_holding(lab, "slow")
        holding = time.time()  # rank 0's sleep began about now, and ends 3 s later
        direct_ran = lab.client[engine_1].apply_async(time.time).get(timeout=30)
        ran = lab.call(time.time, ranks=[1], state=False, what="quick")[1]
        assert slow.done() and slow.result() == {0: None}
    assert direct_ran - holding < 1.0, direct_ran - holding  # the control: engine 1 was free
    assert ran - holding >= 2.5, ran - holding  # the Lab's call ran after the sleep

    with ThreadPoolExecutor(1, thread_name_prefix="widget-callback") as pool:
        slow = pool.submit(lab.call, time.sleep, 3, ranks=[0], state=False, what="slow")
        _when_holding(lab, "slow")
        started = time.monotonic()
        with pytest.raises(LabError) as refused:
            lab.call(time.time, ranks=[1], state=False, timeout_s=0.5, what="quick")
        waited = time.monotonic() - started
        slow.result(timeout=30)
    message = str(refused.value)
    assert message.startswith("lab.quick: lab.slow (called from thread 'widget-callback_0"), message
    assert "still has the engines after 0.5 s" in message and "longer timeout_s" in message, message
    assert 0.5 <= waited < 2.0, waited
    assert set(lab.call(time.time, state=False, what="after")) == {0, 1}


def test_an_interrupted_wait_leaves_the_lab_usable(lab):
    """The notebook's stop button (SIGINT to the main thread) while the Lab waits for rank 0's 3 s call: the
    KeyboardInterrupt reaches the cell at once (under 1 s, not after the call), the engines are not held (a
    call from another thread does not wait for them), the next call is refused at once naming rank 0 as still
    busy with the interrupted call, and once that call has ended on the engine the Lab answers again."""
    main = threading.main_thread().ident
    interrupt = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
    # Python's own SIGINT handler, as a kernel has it: a pytest started in the background by a shell without
    # job control inherits SIGINT ignored, and Python then installs no handler (the signal would be lost).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            lab.call(time.sleep, 3, ranks=[0], state=False, what="slow")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert time.monotonic() - started < 1.5
    assert lab.calls.holder is None
    with pytest.raises(LabError, match=r"rank 0 \(engine \d+\) is still busy with lab.slow, started [01] s ago"):
        lab.call(time.time, state=False, timeout_s=1, what="next")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            assert set(lab.call(time.time, state=False, what="after")) == {0, 1}
            break
        except LabError as error:
            assert "still busy with lab.slow" in str(error)
            time.sleep(0.2)
    else:
        raise AssertionError("rank 0 stayed busy 30 s after a 3 s call")
    assert time.monotonic() - started >= 3  # not before the interrupted call ended on rank 0


@pytest.fixture(scope="module")
def before(lab, tmp_path_factory):
    """The tiny PixArt under cfg 2 on the Lab, and its 3-step latents before anything went wrong."""
    folder = save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))
    lab.load(folder, ParallelConfig(cfg=2), progress=False)
    latents = lab.session(PROMPTS, **KWARGS).run().latents
    assert latents.abs().max() > 0
    return latents


def _signal_rank_1_mid_run(lab, signal_number):
    """Start a long session.run under cfg 2 from another thread, send rank 1's engine process the signal once
    both ranks are in the loop; the LabError the run ends in, and the seconds from the signal to it."""
    long_run = lab.session(PROMPTS, **dict(KWARGS, num_inference_steps=5000))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_run.run)
        _when_holding(lab, "session.run")
        time.sleep(2)  # both ranks are in the loop, exchanging cfg halves every step
        assert not running.done()
        os.kill(lab.ranks[1]["pid"], signal_number)
        signalled = time.monotonic()
        with pytest.raises(LabError) as caught:
            running.result(timeout=LAB_TIMEOUT_S + 30)
        return caught.value, time.monotonic() - signalled


def _restart_gives_the_same_latents(lab, old_engine, before):
    lab.restart()
    assert [row["rank"] for row in lab.ranks] == [0, 1] and old_engine not in [r["engine"] for r in lab.ranks]
    assert lab.config == ParallelConfig(cfg=2)  # reloaded
    assert torch.equal(lab.session(PROMPTS, **KWARGS).run().latents, before)


def test_an_engine_killed_mid_run_is_named_then_restart_works(lab, before):
    """Rank 1's engine process is killed (SIGKILL, as the out-of-memory killer does) while both ranks are in a
    long session.run under cfg 2. The run ends in a LabError naming rank 1 as dead (ipyparallel's
    EngineError) and rank 0's collective that lost its peer, within 10 s (measured: 2.6 s; not the
    collective timeout, 10 s, nor the Lab's 90 s); the next call is refused at once naming rank 1 as
    gone; lab.restart() gives two fresh engines with the pipeline reloaded, whose 3-step latents equal
    those before the kill, bit for bit."""
    victim = dict(lab.ranks[1])
    error, seconds = _signal_rank_1_mid_run(lab, signal.SIGKILL)
    message = str(error)
    assert seconds < COLLECTIVE_TIMEOUT_S, (seconds, message)
    assert message.startswith("lab.session.run failed:"), message
    by_rank = {failure["rank"]: failure for failure in error.failures}
    assert sorted(by_rank) == [0, 1] and by_rank[1]["engine"] == victim["engine"], error.failures
    assert by_rank[1]["error"].startswith(f"EngineError: Engine {victim['engine']} died while running task")
    assert f"rank 1 (engine {victim['engine']} on {victim['host']}): EngineError" in message, message
    assert "An engine's process ended" in message and "lab.restart()" in message, message

    deadline = time.monotonic() + 30  # the controller unregisters the dead engine (measured: at once)
    while victim["engine"] in lab.client.ids and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    with pytest.raises(LabError, match=rf"rank 1 \(engine {victim['engine']} on .*\): the engine is gone"):
        lab.session(PROMPTS, **KWARGS)
    assert time.monotonic() - started < 5
    _restart_gives_the_same_latents(lab, victim["engine"], before)


def test_a_hung_engine_mid_run_is_named_then_restart_works(lab, before):
    """Rank 1's engine process is stopped (SIGSTOP: hung, as in a deadlock, not dead) while both ranks are in
    a long session.run. Rank 0's collective gives up after the collective timeout (10 s), the Lab gives
    rank 1 its grace (5 s) and ends the run with a LabError naming rank 1 as not answering and rank 0's
    timeout, within 10 + 5 + 10 s (measured: 17.5 s; the Lab's own timeout is 90 s). The next call is
    refused at once naming rank 1 as still busy; lab.restart() ends the stopped engine and gives the same
    latents as before."""
    victim = dict(lab.ranks[1])
    error, seconds = _signal_rank_1_mid_run(lab, signal.SIGSTOP)
    message = str(error)
    assert COLLECTIVE_TIMEOUT_S <= seconds < COLLECTIVE_TIMEOUT_S + 5 + 10, (seconds, message)
    by_rank = {failure["rank"]: failure for failure in error.failures}
    assert sorted(by_rank) == [0, 1] and by_rank[1]["error"].startswith("no answer after"), error.failures
    assert "Timed out" in by_rank[0]["error"], error.failures
    assert f"rank 1 (engine {victim['engine']} on {victim['host']}): no answer after" in message, message
    assert f"collectives give up after {COLLECTIVE_TIMEOUT_S} s" in message and "lab.restart()" in message

    started = time.monotonic()
    with pytest.raises(LabError, match=rf"rank 1 \(engine {victim['engine']}\) is still busy with lab.session.run"):
        lab.session(PROMPTS, **KWARGS)
    assert time.monotonic() - started < 5
    _restart_gives_the_same_latents(lab, victim["engine"], before)
