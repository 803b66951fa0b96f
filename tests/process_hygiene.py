"""Process hygiene for every test (a pytest plugin, loaded by conftest.py's
pytest_plugins): every test has a deadline (TEST_DEADLINE_S) that kills
every process the test started, ranks and grandchildren included, and fails
it; after every test no process it started may be left
(no_process_outlives_its_test). pytest (each xdist worker, which runs
whole test files) is made a child subreaper, so that orphaned
grandchildren stay visible among its descendants."""
import ctypes
import multiprocessing.resource_tracker
import signal
import time

import psutil
import pytest

from helpers import cleans_up_after_others

# A backstop far above the slowest test (under 30 s here): it ends hangs.
TEST_DEADLINE_S = 300
# How long processes of a finished test may take to exit on their own (a
# launcher's resource tracker, say, once the launcher is gone).
EXIT_GRACE_S = 10
PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper():
    """Orphaned descendants (a rank whose launcher was killed, say) are
    reparented to this process instead of init, so they stay visible among
    its descendants. Zombies are never reaped here: waiting for an arbitrary
    child could take the exit status a subprocess.Popen is waiting for."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


_become_subreaper()


def descendants():
    """The live processes this pytest process started, directly or not,
    except its own multiprocessing resource tracker (it lives as long as
    this process, by design)."""
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid != tracker and (
                    process.status() != psutil.STATUS_ZOMBIE):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def kill_descendants(spare_cleaners=False):
    """SIGKILLs every descendant (until none is left: one may fork while
    the others die), or all but those that clean up after the others and
    then leave; returns what each was, for the failure message."""
    killed = []
    for _ in range(10):
        processes = [process for process in descendants() if not (
            spare_cleaners and cleans_up_after_others(process))]
        if not processes:
            break
        for process in processes:
            try:
                killed.append(" ".join(process.cmdline())[:120])
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(processes, timeout=5)
    return killed


def _deadline_passed(signum, frame):
    # The cleaners left are waited for, as after any test.
    killed = kill_descendants(spare_cleaners=True)
    pytest.fail(
        f"the test did not end within its {TEST_DEADLINE_S} s deadline; "
        f"killed {len(killed)} processes: {killed}", pytrace=True)


def _within_deadline(item, at_least=0):
    """Arms SIGALRM for what is left of `item`'s deadline (but `at_least`
    seconds), for one phase (setup, call, teardown); the handler runs in the
    main thread, where pytest runs the test, and interrupts any blocking
    wait there."""
    left = item.stash.setdefault(_DEADLINE, time.monotonic() + TEST_DEADLINE_S)
    left = max(left - time.monotonic(), at_least)
    previous = signal.signal(signal.SIGALRM, _deadline_passed)
    signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_DEADLINE = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _within_deadline(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _within_deadline(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # Time to clean up, even after the deadline ended the test.
    return (yield from _within_deadline(item, at_least=3 * EXIT_GRACE_S))


# Processes that clean up after a finished test's job and then leave by
# themselves (helpers.cleans_up_after_others: torch's shared-memory manager
# waits 2 s for new clients, then unlinks and leaves): pid -> (process, when
# it must be gone, the test that left it). The tests after it go on
# meanwhile; each test's end, and the session's, checks the deadlines.
_LEAVING = {}


def _check_leaving(wait=False):
    """Fails (killing them) where cleaners outlived their grace; with
    `wait`, first waits for each until its deadline."""
    late = []
    for pid, (process, deadline, test) in list(_LEAVING.items()):
        while wait and process.is_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            alive = (process.is_running()
                     and process.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            del _LEAVING[pid]
        elif time.monotonic() >= deadline:
            del _LEAVING[pid]
            late.append(f"{' '.join(process.cmdline())[:120]} (left by {test})")
            process.kill()
    return late


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """Fails a test (and kills them) if processes it started outlive it.
    subprocess.run(timeout=) kills only the direct child, spawned ranks
    ignore SIGINT, and a killed launcher leaves its ranks running. The
    first test after a session fixture also answers for that fixture.
    Processes that clean up after the others get EXIT_GRACE_S to leave by
    themselves while the next tests run (checked at each test's end and
    at the session's)."""
    yield
    survivors = [p for p in descendants() if p.pid not in _LEAVING]
    deadline = time.monotonic() + EXIT_GRACE_S
    for process in survivors:
        if cleans_up_after_others(process):
            _LEAVING[process.pid] = (process, deadline, request.node.nodeid)
    survivors = [p for p in survivors if p.pid not in _LEAVING]
    while survivors and time.monotonic() < deadline:
        time.sleep(0.05)
        survivors = [p for p in descendants() if p.pid not in _LEAVING]
    if survivors:
        killed = kill_descendants(spare_cleaners=True)
        pytest.fail(f"{len(killed)} processes outlived the test (killed): "
                    f"{killed}")
    late = _check_leaving()
    if late:
        pytest.fail(f"{len(late)} cleaning processes did not leave within "
                    f"{EXIT_GRACE_S} s (killed): {late}")


def pytest_sessionfinish(session, exitstatus):
    late = _check_leaving(wait=True)
    if late:
        print(f"\nerror: {len(late)} cleaning processes did not leave within "
              f"{EXIT_GRACE_S} s (killed): {late}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
