"""Processes of DGL's distributed engine that end when their job has failed.

DGL 2.1-2.4 leave a job running for ever when a trainer dies: a server
exits only on a shutdown request, which only a trainer's clean exit sends
after every other trainer has reached the same point, and DGL's sampler
processes wait for tasks from a trainer that is gone (read in
dgl/distributed/dist_context.py and rpc_server.py at v2.1.0, unchanged
through v2.4.0). DGL's tools/launch.py waits for the servers first, so the
job never ends. Here a server leaves once every trainer and sampler of its
machine has gone (exit_when_clients_are_gone), a sampler dies with its
trainer (gbrun.dgl_engine.cleanup.samplers_die_with_trainer), and a trainer
fails when the job cannot go on (TrainerWatch), reading the Heartbeat its
loader beats.
Sockets and processes are read with psutil.
"""
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback

import psutil

from .cleanup import fail_fast

# How long a server waits, once its last client has gone, before it
# leaves: a clean shutdown (every trainer done) comes well within it.
CLIENTS_GONE_GRACE_S = 5
# How long a server waits for its first client (a trainer that failed before
# connecting never comes).
FIRST_CLIENT_TIMEOUT_S = 30 * 60
# How long a trainer, once serving, may go without a batch before it fails:
# a hung trainer, or a machine cut off the network (no connection closes).
PROGRESS_TIMEOUT_S = 45


class Heartbeat:
    """When a trainer last made progress (`last`, time.monotonic(), None
    before): its loader beats it for each batch handed out, and its
    predictions for each chunk read back; its TrainerWatch reads it."""

    def __init__(self):
        self.last = None

    def beat(self):
        self.last = time.monotonic()


def exit_when_clients_are_gone(ip, port, grace_s=CLIENTS_GONE_GRACE_S,
                               first_timeout_s=FIRST_CLIENT_TIMEOUT_S,
                               poll_s=1.0, on_leave=None):
    """In a graph server at `ip`:`port`, before it starts serving (a daemon
    thread): the server process exits with status 1 once every connection
    of a client on its own machine (trainers and samplers; every client if
    none is local) has closed for `grace_s` without the shutdown request
    that ends a job well, or when no client has come within
    `first_timeout_s` of the server listening (it listens once its
    partition is loaded, however long that takes). DGL's server would
    otherwise wait for ever: the receive thread of a client that died
    without closing its stream spins on the closed socket, and the shutdown
    request never comes. Its own machine's clients, because a machine cut
    off the network closes no connection: the other machines' stay open
    here while their trainers are long gone. `on_leave()` runs before the
    exit (the server's shared memory is unlinked there: os._exit skips
    DGL's cleanup)."""

    def watch():
        listening_since, seen, seen_local, gone_since = None, False, False, None
        spent = {}
        while True:
            peers = port_peers(port)
            if any(state == psutil.CONN_LISTEN for state, _ in peers):
                listening_since = listening_since or time.monotonic()
            clients = [(state, peer) for state, peer in peers
                       if state != psutil.CONN_LISTEN]
            seen = seen or bool(clients)
            seen_local = seen_local or any(peer == ip for _, peer in clients)
            if seen_local:
                clients = [(state, peer) for state, peer in clients
                           if peer == ip]
            if any(state == psutil.CONN_ESTABLISHED for state, _ in clients):
                gone_since, spent = None, {}  # measured afresh once gone
            elif seen:
                gone_since = gone_since or time.monotonic()
                spent = idle_spinning_threads(spent, poll_s)
                if time.monotonic() - gone_since > grace_s:
                    leave("every trainer of this machine has gone without "
                          "shutting the graph servers down (a trainer "
                          "failed)", on_leave)
            elif (listening_since is not None
                  and time.monotonic() - listening_since > first_timeout_s):
                leave(f"no trainer connected within {first_timeout_s:g} s "
                      "of the partition being served (--first-client-"
                      "timeout)", on_leave)
            time.sleep(poll_s)

    threading.Thread(target=watch, daemon=True, name="clients-gone").start()


def idle_spinning_threads(spent, interval_s):
    """In a graph server whose clients have gone: each thread but the main
    one and this one that spent over a tenth of the last `interval_s` on a
    core runs from now on only where nothing else wants one (SCHED_IDLE).
    Those are DGL's receive threads of a client that died without its stop
    signal: RecvDataSize loops on the closed socket for ever (v2.1.0's
    socket_communicator.cc, unchanged through v2.4.0), a core each, until
    the server leaves; a thread that reads a clean shutdown waits in recv
    and is left alone. `spent`: {thread id: CPU seconds}, as this call
    returns it, from the call `interval_s` earlier ({} the first time)."""
    now = {thread.id: thread.user_time + thread.system_time
           for thread in psutil.Process().threads()}
    for tid in now.keys() - {os.getpid(), threading.get_native_id()}:
        if tid in spent and now[tid] - spent[tid] > interval_s / 10:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass  # it ended
    return now


def port_peers(port):
    """(TCP state, as psutil names it, remote IPv4 address) of this
    process's sockets whose local port is `port`, the listening one
    included (IPv6 ones with the remote address None): a graph server's
    own sockets, its clients' connections among them."""
    return [(conn.status, conn.raddr.ip if conn.raddr
             and conn.family == socket.AF_INET else None)
            for conn in psutil.Process().net_connections(kind="tcp")
            if conn.laddr and conn.laddr.port == port]


def leave(reason, on_leave=None):
    print(f"graph server {os.getpid()}: {reason}; exiting", file=sys.stderr,
          flush=True)
    try:
        if on_leave is not None:
            on_leave()
    finally:
        os._exit(1)


class TrainerWatch:
    """A trainer's guard against waiting for ever on a job that has failed
    elsewhere, a daemon thread from before dgl.distributed.initialize to the
    end of training (DGL's client has no timeout for any of these; read in
    v2.1.0's rpc_client.py and dist_context.py):
    - connected to every graph server (`servers`: (ip, port) pairs), the
      trainer waits in DGL's handshake for every trainer and sampler of the
      job; one that failed before connecting never comes: after
      `connect_timeout` seconds (counted once this trainer and its
      samplers have reached every server, so neither a partition that
      takes long to load nor the samplers' start counts), it fails;
    - while training, a graph server's connection that closes (the server
      died) or a sampler process of this trainer that died would leave it
      waiting for an answer: it fails at once;
    - once serving, no batch for `progress_timeout` seconds (the trainer
      hung, or waits on one that did, or a machine is cut off the network,
      where no connection closes and gloo and DGL wait for ever): it fails,
      naming where its main thread is.
    Failing: one line naming the cause, this trainer's sampler processes
    killed and the job's shared memory unlinked (graph `graph_name`), exit
    status 1; the other trainers, the servers and their samplers then end
    as after any trainer's failure."""

    def __init__(self, servers, connect_timeout, graph_name, heartbeat,
                 report, progress_timeout=PROGRESS_TIMEOUT_S, poll_s=1.0):
        self.servers, self.connect_timeout = set(servers), connect_timeout
        self.heartbeat, self.report = heartbeat, report
        self.progress_timeout = progress_timeout
        self.graph_name, self.poll_s = graph_name, poll_s
        self.samplers = None  # set once initialize has returned
        self.serving_since = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True,
                                       name="trainer-watch")

    def start(self):
        self.thread.start()
        return self

    def serving(self):
        """After dgl.distributed.initialize: watch the servers' connections
        and this trainer's sampler processes (its children by now)."""
        self.samplers = children()
        self.serving_since = time.monotonic()

    def stop(self):
        """Before the trainers shut the servers down (a clean end)."""
        self.stopped.set()

    def _watch(self):
        connected_since = None
        samplers = int(os.environ.get("DGL_NUM_SAMPLER", "0"))
        while not self.stopped.wait(self.poll_s):
            connected = self.servers & established()
            if self.samplers is None:
                # Counted once this trainer and its sampler processes (they
                # start inside initialize, and connect as it does) have
                # reached every server: what is left is the other trainers.
                ready = sum(self.servers <= established(process)
                            for process in children())
                if connected == self.servers and ready >= samplers:
                    connected_since = connected_since or time.monotonic()
                    if time.monotonic() - connected_since > self.connect_timeout:
                        self.fail(
                            f"connected to every graph server "
                            f"{self.connect_timeout:g} s ago, but DGL still "
                            "waits for the job's other trainers (one failed "
                            "before connecting?) (--connect-timeout)")
                continue
            lost = sorted(self.servers - connected)
            if lost:
                self.fail(f"the graph server at {lost[0][0]}:{lost[0][1]} "
                          "closed its connection (it died?)")
            dead = [process for process in self.samplers if not alive(process)]
            if dead:
                self.fail(f"its sampler process {dead[0].pid} died")
            last = max(self.serving_since, self.heartbeat.last or 0)
            if time.monotonic() - last > self.progress_timeout:
                self.fail(f"no batch for {self.progress_timeout:g} s "
                          f"(--progress-timeout), at {main_thread_at()}")

    def fail(self, cause):
        # Unless the main thread has reported its own failure first (it then
        # ends the process itself).
        if self.stopped.is_set() or not self.report.acquire(blocking=False):
            return
        rank = os.environ.get("RANK", "?")
        os.write(2, f"rank {rank} failed: {cause}; exiting\n".encode())
        for process in self.samplers or children():
            try:
                process.kill()
            except psutil.Error:
                pass
        fail_fast(self.graph_name, flush=False)


def main_thread_at():
    """Where the main thread is: its innermost frame as "file:line in
    function", and the innermost one of the user's own code (not Python's,
    an installed package's, gbrun's or the trainer script's) if another."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    paths = sysconfig.get_paths()
    others = tuple(os.path.realpath(path) + os.sep for path in {
        paths["stdlib"], paths["purelib"], paths["platlib"],
        os.path.dirname(os.path.dirname(__file__))})  # gbrun
    script = os.path.realpath(getattr(sys.modules["__main__"], "__file__", ""))
    own = [entry for entry in stack
           if not os.path.realpath(entry.filename).startswith(others)
           and os.path.realpath(entry.filename) != script]
    where = [stack[-1]] + ([own[-1]] if own and own[-1] is not stack[-1] else [])
    return " <- ".join(f"{entry.filename}:{entry.lineno} in {entry.name}"
                       for entry in where)


def established(process=None):
    """The (remote ip, remote port) of `process`'s (a psutil.Process; this
    one by default) established IPv4 TCP connections."""
    try:
        connections = (process or psutil.Process()).net_connections("tcp4")
    except psutil.Error:
        return set()
    return {tuple(conn.raddr) for conn in connections
            if conn.status == psutil.CONN_ESTABLISHED}


def children():
    """This process's living child processes (psutil.Process) but
    multiprocessing's resource tracker (left to unlink the pool's
    semaphores once this process has gone: killed, it would leave them in
    /dev/shm)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                    "resource_tracker" in part for part in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def alive(process):
    """True while `process` (a psutil.Process) runs and is no zombie."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
