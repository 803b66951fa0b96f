"""Stopping on SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C): every
rank stops at the same step boundary, and the run saves where it stopped."""
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


TEST_HOOK = "TEST_SIGTERM_AT_CHECK"


class StopSignal(Joinable):
    """SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) stops every rank
    at the next step boundary with a checkpoint to resume from; a second one
    stops at once. A rank cannot stop alone (DDP would hang), so at every
    boundary the ranks agree with one small all-reduce. It is a Joinable so
    that, under Join, a rank that ran out of batches keeps answering.

    With mp.spawn the launcher receives the signal (a Ctrl-C reaches every
    process, so ranks ignore SIGINT) and passes it on in `stop_request`, a
    shared integer; under torchrun each rank receives it itself.

    For tests, TEST_SIGTERM_AT_CHECK=N in the environment makes the first
    process to reach its Nth check act as if SIGTERM had arrived just before
    it: a stop at an exact step, with no timing involved."""

    def __init__(self, device, stop_request):
        super().__init__()
        self.device = device
        self.stop_request = stop_request
        self.received = 0  # the signal, under torchrun
        self.signum = 0  # what the ranks agreed on
        self.checks = 0
        self.test_signal_at = int(os.environ.get(TEST_HOOK, "0"))
        if stop_request is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._receive)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _receive(self, signum, frame):
        if self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def agreed(self):
        """True on every rank once any rank has received a signal."""
        Join.notify_join_context(self)
        self.checks += 1
        if self.checks == self.test_signal_at:
            if self.stop_request is not None:
                self.stop_request.value = signal.SIGTERM  # as the launcher
            else:
                self.received = signal.SIGTERM
        return self.all_reduce() > 0

    def all_reduce(self):
        received = self.received
        if self.stop_request is not None:
            received = self.stop_request.value
        flag = torch.tensor([received], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return self.signum

    def join_hook(self, **kwargs):
        return _AnswerStopSignal(self)

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD



class _AnswerStopSignal(JoinHook):
    """What a rank that joined early does in each step of the others."""

    def __init__(self, stop):
        self.stop = stop

    def main_hook(self):
        self.stop.all_reduce()



def relay_stop_signals(context, stop_request):
    """In the launcher: the first SIGTERM or SIGINT asks the ranks to stop
    at the next step boundary; a second kills them."""

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
