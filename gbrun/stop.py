"""Stopping on SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C): every
rank stops at the same step boundary, and the run saves where it stopped.

Signal handlers belong to a process, so a process has one StopSignal:
gbrun.launch.run_rank installs it first thing in a rank and hands it to
the rank's run() in the plan (plan.stop), where gbrun.progress.Progress
takes it."""
import os
import signal

import torch
import torch.distributed as dist


TEST_HOOK = "TEST_SIGTERM_AT_CHECK"


class Stopped(BaseException):
    """Raised on every rank, at one step boundary, once a signal stopped
    training and its checkpoint is written (gbrun.launch turns it into exit
    status 128 + the signal's number). A BaseException, as KeyboardInterrupt
    is, so that an `except Exception` in the example does not swallow it."""

    def __init__(self, signum):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def install(device, stop_request):
    """Makes this process's StopSignal, which takes over its SIGTERM and
    SIGINT (gbrun.launch does, first thing in a rank, and hands it on in
    the plan: plan.stop)."""
    return StopSignal(device, stop_request)


class StopSignal:
    """SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) stops every rank
    at a step boundary with a checkpoint to resume from; a second one stops
    at once. A rank cannot stop alone (DDP would hang), so at every boundary
    the ranks agree with one small all-reduce, whose result each rank reads
    at the next boundary: on a GPU the host then never waits for the step it
    has just queued, only for the one before (a stop takes effect one step
    after the signal; the checkpoint records where). Under Join, a rank
    that ran out of batches keeps answering (answer(), called by the join
    hook of gbrun.progress's epoch batches).

    Where the launcher started the ranks, it receives the signal (a Ctrl-C
    reaches every process, so ranks ignore SIGINT) and passes it on in
    `stop_request`, a shared integer; a rank also takes a SIGTERM of its
    own (a scheduler that signals every process of the job). Under
    torchrun each rank receives the signal itself.

    For tests, TEST_SIGTERM_AT_CHECK=N in the environment makes the first
    process to reach its Nth check act as if SIGTERM had arrived just before
    it: a stop at an exact step, with no timing involved."""

    def __init__(self, device, stop_request):
        self.device = device
        self.stop_request = stop_request
        self.received = 0  # the signal, under torchrun
        self.signum = 0  # what the ranks agreed on
        self.checks = 0
        self.test_signal_at = int(os.environ.get(TEST_HOOK, "0"))
        self.pending = None  # the last flag, on its way to the host
        signal.signal(signal.SIGTERM, self._receive)
        # With the launcher's ranks a Ctrl-C reaches every process, and it
        # relays it: a rank ignores its own copy.
        signal.signal(signal.SIGINT, signal.SIG_IGN if stop_request is not None
                      else self._receive)
        # The launcher starts ranks with both blocked; one that came since
        # is delivered now (an ignored SIGINT is dropped).
        signal.pthread_sigmask(signal.SIG_UNBLOCK,
                               {signal.SIGINT, signal.SIGTERM})

    def _receive(self, signum, frame):
        if self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def agreed(self):
        """At a step boundary: True on every rank, at the same step, once
        any rank had received a signal by the previous boundary."""
        previous, self.pending = self.pending, self._all_reduce()
        if previous is not None:
            self.signum = max(self.signum, previous.read())
        return self.signum > 0

    def agreed_now(self):
        """As agreed(), reading this boundary's own flag (once an epoch)."""
        self.settle()
        self.pending = self._all_reduce()
        self.settle()
        return self.signum > 0

    def settle(self):
        """Reads the flag still on its way (no collective): every rank ends
        a loop having read as many flags as the others."""
        if self.pending is not None:
            self.signum = max(self.signum, self.pending.read())
            self.pending = None

    def _all_reduce(self):
        self.checks += 1
        if self.checks == self.test_signal_at:
            if self.stop_request is not None:
                self.stop_request.value = signal.SIGTERM  # as the launcher
            else:
                self.received = signal.SIGTERM
        received = self.received
        if self.stop_request is not None:
            received = max(received, self.stop_request.value)
        return _Flag(received, self.device)

    def answer(self):
        """Under Join, a rank that has joined: the all-reduce of a step of
        the others, read at once (it has no step of its own to overlap)."""
        self.settle()
        self.pending = self._all_reduce()
        self.settle()


class _Flag:
    """The ranks' largest received signal, all-reduced. On a GPU the result
    is copied to pinned host memory behind the all-reduce on the rank's
    stream and an event marks it: reading it waits for that point only."""

    def __init__(self, received, device):
        flag = torch.tensor([received], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.value, self.ready = flag, None
        if device.type == "cuda":
            self.value = torch.empty(1, dtype=flag.dtype, pin_memory=True)
            self.value.copy_(flag, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self):
        if self.ready is not None:
            self.ready.synchronize()
        return int(self.value.item())


def relay_stop_signals(context, stop_request):
    """In the launcher: the first SIGTERM or SIGINT asks the ranks to stop
    at the next step boundary; a second kills them (`context.processes`,
    the ranks started so far)."""

    def relay(signum, frame):
        if stop_request.value:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            os._exit(128 + signum)
        stop_request.value = signum

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, relay)



def report_stop(checkpoint_dir, signum, epoch, step):
    where = f"epoch {epoch}" + (f" after step {step}" if step else "")
    if checkpoint_dir:
        then = (f"checkpoint saved in {checkpoint_dir}; run the same "
                "command with --resume to continue")
    else:
        then = "nothing saved (no --checkpoint-dir)"
    print(f"Stopped by {signal.Signals(signum).name} in {where}: {then}.",
          flush=True)
