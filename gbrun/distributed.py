"""DGL's distributed engine (DistGraph, graph servers) under the example's
own training loop: a trainer's mini-batches in the shape GraphBolt hands
the example, and processes that end when their job has failed.

DGL 2.1-2.4 leave a job running for ever when a trainer dies: a server
exits only on a shutdown request, which only a trainer's clean exit sends
after every other trainer has reached the same point, and DGL's sampler
processes wait for tasks from a trainer that is gone (read in
dgl/distributed/dist_context.py and rpc_server.py at v2.1.0, unchanged
through v2.4.0). DGL's tools/launch.py waits for the servers first, so the
job never ends. Here a server leaves once every trainer and sampler of its
machine has gone (exit_when_clients_are_gone), a sampler dies with its
trainer (die_with_trainer), and a trainer fails when the job cannot go on
(TrainerWatch).
"""
import ctypes
import json
import multiprocessing.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from types import SimpleNamespace

import dgl
import torch

from .batches import derived_seed

# How long a server waits, once its last client has gone, before it
# leaves: a clean shutdown (every trainer done) comes well within it.
CLIENTS_GONE_GRACE_S = 5
# How long a server waits for its first client (a trainer that failed before
# connecting never comes).
FIRST_CLIENT_TIMEOUT_S = 30 * 60
# How long a trainer, once serving, may go without a batch before it fails:
# a hung trainer, or a machine cut off the network (no connection closes).
PROGRESS_TIMEOUT_S = 45
# When this trainer last made progress (time.monotonic()): a batch handed
# out, or a chunk of the predictions read back.
LAST_PROGRESS = [None]
# Rows of every node's predictions read back from the servers at a time.
READ_ROWS = 1 << 20
ESTABLISHED, LISTEN = "01", "0A"  # TCP states as /proc/net/tcp shows them


# The dataset's item sets in the partitioned graph's node ids (written by
# partition_graph.py): the trainer's Job holds them, as on one machine.
ITEM_SETS_FILE = "item_sets.pt"
# orig_nids[i] is the dataset id of node i in the partitioned graph.
ORIG_NIDS_FILE = "orig_nids.pt"
# What the partition config does not record, beside it (dataset_info).
DATASET_INFO_FILE = "dataset_info.json"
# Node data of the partitions: a mask per split, as node_split takes them.
SPLIT_MASKS = ("train_mask", "val_mask", "test_mask")
SPLITS = ("train_set", "validation_set", "test_set")


def dataset_info(graph_name, num_classes, features, example, num_train,
                 use_graphbolt=False, node_types=None):
    """What the trainer reads beside the partition config and the config
    does not record: the example's feature widths (`features`, {key:
    width}, or {node type: {key: width}}), label key and kind, the number of
    classes and of training nodes; for a graph of several node types
    (`node_types`), its target type and edge types."""
    def widths(features):
        return {key: widths(width) if isinstance(width, dict) else int(width)
                for key, width in features.items()}

    return {
        "graph_name": graph_name,
        "num_classes": int(num_classes),
        "features": widths(features),
        "label_key": example.LABEL_KEY,
        "labels": example.LABELS,
        "num_train": int(num_train),
        "use_graphbolt": use_graphbolt,
        **(node_types or {}),
    }


def write_dataset_info(directory, info):
    """dataset_info.json in `directory`; returns its path."""
    path = os.path.join(directory, DATASET_INFO_FILE)
    with open(path, "w") as f:
        json.dump(info, f, indent=2)
    return path


def save_item_sets(out_dir, splits, orig_nids):
    """`splits`: (seed node ids, labels) of train, validation and test, in
    dataset ids ({target type: (seeds, labels)} on a graph of several node
    types, whose `orig_nids` are per type); saved with the seeds renumbered
    as the partitions number them (`orig_nids[new id]` is a node's dataset
    id)."""
    def renumbered(seeds, orig_nids):
        new_ids = torch.empty_like(orig_nids)
        new_ids[orig_nids] = torch.arange(len(orig_nids), dtype=orig_nids.dtype)
        return new_ids[torch.as_tensor(seeds)]

    saved = {}
    for name, split in zip(SPLITS, splits):
        if isinstance(split, dict):
            saved[name] = {ntype: (renumbered(seeds, orig_nids[ntype]), labels)
                           for ntype, (seeds, labels) in split.items()}
        else:
            seeds, labels = split
            saved[name] = (renumbered(seeds, orig_nids), labels)
    torch.save(saved, os.path.join(out_dir, ITEM_SETS_FILE))


def load_item_sets(part_dir):
    """The item sets save_item_sets wrote, as the example's Job holds them
    on one machine: GraphBolt ItemSets of (seed_nodes, labels), in an
    ItemSetDict by node type on a graph of several."""
    from .cli import UsageError
    from .graphbolt import gb

    path = os.path.join(part_dir, ITEM_SETS_FILE)
    if not os.path.isfile(path):
        raise UsageError(
            f"{part_dir} has no {ITEM_SETS_FILE}: partitions written by an "
            "older partition_graph.py; run it again")
    splits = torch.load(path, weights_only=True)

    def item_set(items):
        return gb.ItemSet(items, names=("seed_nodes", "labels"))

    return tuple(
        gb.ItemSetDict({ntype: item_set(items)
                        for ntype, items in splits[name].items()})
        if isinstance(splits[name], dict) else item_set(splits[name])
        for name in SPLITS)


def node_dataloader_class():
    """DistNodeDataLoader: in dgl.distributed since 2.4, in dgl.dataloading
    before (told apart by what the modules hold, not by version)."""
    return getattr(dgl.distributed, "DistNodeDataLoader", None) or (
        dgl.dataloading.DistNodeDataLoader)


class Partitions:
    """DGL partitions served by the graph servers, where the example has a
    GraphBolt dataset (the distributed trainer puts it in the Job): the
    data source of the example's own run(), create_dataloader() and loop.
    `dtype`: the features' type in batches (bf16 under --precision bf16).
    `record`, `fail_after`, `hang`, `fail_rank`: the trainer's debugging
    options (`hang`: the failure is a sleep for ever, not an exception).
    `node_types`: of a graph of several node types, dataset_info's "target"
    (the type with labels and splits) and "edge_types"."""

    def __init__(self, graph_name, part_config, dtype=None, record=None,
                 fail_after=None, fail_rank=0, hang=False, node_types=None):
        self.graph_name, self.part_config = graph_name, part_config
        self.dtype, self.record = dtype, record
        self.fail_after, self.fail_rank = fail_after, fail_rank
        self.hang = hang
        self.target = (node_types or {}).get("target")
        # What gbrun.datasets.edge_types and num_nodes read for the
        # example's model (before the DistGraph exists).
        self.edge_types = [tuple(etype) for etype in
                           (node_types or {}).get("edge_types", [])]
        with open(part_config) as f:
            node_map = json.load(f)["node_map"]
        self.num_nodes = {ntype: sum(end - start for start, end in ranges)
                          for ntype, ranges in node_map.items()}
        self.g = None

    def place(self, device):
        """(this, the DistGraph, this trainer's share of each split): what
        gbrun.placement.place_dataset hands the example's run()."""
        import torch.distributed as dist

        self.g = dgl.distributed.DistGraph(self.graph_name,
                                           part_config=self.part_config)
        ########################################################################
        # (HIGHLIGHT) node_split gives each trainer a disjoint share of a
        # mask's nodes, mostly of its own machine's partition.
        # force_even=True makes the shares differ by at most one node and
        # cover every node exactly once, which keeps validation and test
        # metrics exact. rank= the trainer's torch rank: by default DGL
        # splits by the order in which trainers connected, and a resumed run
        # would give a trainer another share.
        ########################################################################
        book = self.g.get_partition_book()
        # On a graph of several node types: the target type's, by their ids
        # within the type, as {target: ids} (the item sets' shape there).
        data = self.g.nodes[self.target].data if self.target else self.g.ndata
        splits = tuple(
            self.typed(dgl.distributed.node_split(
                data[f"{name}_mask"], book, ntype=self.target or "_N",
                rank=dist.get_rank(), force_even=True))
            for name in ("train", "val", "test"))
        return self, self.g, splits

    def typed(self, nids):
        return {self.target: nids} if self.target else nids

    def every_node(self):
        """gbrun.predicting's share of every node on this engine and the
        outputs' storage: (item set, {node type: DistOutputs}), the type
        None for a graph of one."""
        if not self.target:
            shared = DistOutputs(self.g, self.part_config)
            return shared.item_set, {None: shared}
        types = {ntype: DistOutputs(self.g, self.part_config, ntype)
                 for ntype in self.g.ntypes}
        return {ntype: shared.item_set for ntype, shared in types.items()}, (
            types)

    def dataloader(self, nids, is_train, batch_size, fanout, feature_keys,
                   label_key, device):
        """The example's create_dataloader() on this data source: a
        DistLoader of this trainer's nodes `nids`. Training, as GraphBolt's
        drop_last and drop_uneven_inputs: every trainer trains as many full
        batches as the one with the fewest (a collective: every trainer
        makes its training loader at the same point)."""
        import torch.distributed as dist

        num_batches = None
        if is_train:
            count = torch.tensor(num_items(nids) // batch_size)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_batches = int(count)
        loader = DistLoader(self.g, nids, fanout, batch_size, feature_keys,
                            label_key, device, num_batches, self.dtype,
                            self.record, self.target)
        if is_train and dist.get_rank() == self.fail_rank:
            loader.fail_after, loader.hang = self.fail_after, self.hang
        return loader


class DistOutputs:
    """gbrun.predicting's layer outputs of every node on DGL's distributed
    engine: this trainer's even share of all nodes (`item_set`), and each
    layer's outputs in a DistTensor on the graph servers, as DGL's
    distributed example infers (one tensor a layer, persistent: DGL deletes
    a tensor with a collective that __del__ would run at any time), read
    back in the dataset's node ids through the partitioner's orig_nids."""

    def __init__(self, g, part_config, ntype=None):
        import torch.distributed as dist

        self.g, self.ntype = g, ntype  # ntype: of a graph of several
        self.num_nodes = g.num_nodes(ntype)
        self.part_dir = os.path.dirname(part_config)
        # node_split takes a mask: every node, once, shared evenly (DGL's
        # example passes np.arange(N), a mask that leaves out node 0).
        self.item_set = dgl.distributed.node_split(
            torch.ones(self.num_nodes, dtype=torch.bool),
            g.get_partition_book(), ntype=ntype or "_N", rank=dist.get_rank(),
            force_even=True)
        self.previous, self.layers = None, 0

    def read(self, nodes):
        return self.previous[nodes]

    def exchange(self, ids, values, width):
        name = f"gbrun_predict_layer{self.layers}"
        outputs = dgl.distributed.DistTensor(
            (self.num_nodes, width), torch.float32,
            f"{name}_{self.ntype}" if self.ntype else name,
            # A node type's tensor, indexed by its ids within the type.
            part_policy=self.g.get_node_partition_policy(self.ntype)
            if self.ntype else None, persistent=True)
        if len(ids):
            outputs[ids] = values
        self.g.barrier()  # every trainer's rows are on the servers
        self.previous, self.layers = outputs, self.layers + 1

    def outputs(self, here):
        if not here:
            return torch.zeros(0, self.previous.shape[1])
        chunks = []
        for start in range(0, self.num_nodes, READ_ROWS):
            end = min(start + READ_ROWS, self.num_nodes)
            chunks.append(self.previous[torch.arange(start, end)])
            LAST_PROGRESS[0] = time.monotonic()  # progress, for TrainerWatch
        return torch.cat(chunks)

    def dataset_ids(self):
        from .cli import UsageError

        path = os.path.join(self.part_dir, ORIG_NIDS_FILE)
        if not os.path.isfile(path):
            raise UsageError(f"{self.part_dir} has no {ORIG_NIDS_FILE}: "
                             "partition again with partition_graph.py")
        orig_nids = torch.load(path, weights_only=True)
        return orig_nids[self.ntype] if self.ntype else orig_nids


def num_items(nids):
    """How many nodes `nids` holds (ids, or {node type: ids})."""
    if isinstance(nids, dict):
        return sum(len(ids) for ids in nids.values())
    return len(nids)


def take(parts, start, end):
    """Positions start..end of `parts` ([(node type or None, ids)]) put end
    to end, in the same shape."""
    taken, first = [], 0
    for ntype, ids in parts:
        chosen = ids[max(start - first, 0):max(end - first, 0)]
        if len(chosen):
            taken.append((ntype, chosen))
        first += len(ids)
    return taken


class DistLoader:
    """What the example's loop calls a data loader, on a DistGraph: this
    trainer's nodes `nids` of one split, `batch_size` seeds a batch, their
    neighbors sampled with `fanout`, the node features `feature_keys` and
    the labels `label_key` fetched from the servers that own them, on
    `device`. A training loader (`num_batches` given) shuffles its nodes
    every epoch and hands out that many full batches, as many as every
    other trainer (GraphBolt's drop_last and drop_uneven_inputs); an
    evaluation loader hands out every node once. `record`: a list that
    gets (pass name, this pass's node order, the seeds of each batch
    handed out), for --dump-seeds. On a graph of several node types,
    `nids` is {node type: ids within the type} (one type, the `target`
    type with the labels, when training), and batches are in GraphBolt's
    shape for such graphs: node features keyed (node type, name), seeds and
    labels per type."""

    def __init__(self, g, nids, fanout, batch_size, feature_keys, label_key,
                 device, num_batches=None, dtype=None, record=None,
                 target=None):
        self.g, self.batch_size, self.target = g, batch_size, target
        # The nodes as [(node type, ids)], the type None for one.
        self.parts = list(nids.items()) if isinstance(nids, dict) else (
            [(None, nids)])
        self.sampler = dgl.dataloading.NeighborSampler(fanout)
        self.feature_keys, self.label_key = feature_keys, label_key
        self.device, self.dtype = device, dtype
        self.num_batches, self.record = num_batches, record
        # --fail-after-batches / --hang-after-batches, for the tests.
        self.fail_after, self.hang = None, False

    def order(self, seed, rank, epoch):
        """The nodes of one pass in the order they are handed out, as
        [(node type, ids)]. Training takes one type."""
        if self.num_batches is None:
            return self.parts
        [(ntype, nids)] = self.parts
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(derived_seed(seed, rank, epoch))
        else:
            generator.seed()
        shuffled = nids[torch.randperm(len(nids), generator=generator)]
        return [(ntype, shuffled[: self.num_batches * self.batch_size])]

    def batch(self, input_nodes, seeds, blocks):
        """A DistGraph mini-batch as the example reads a GraphBolt one."""
        if isinstance(seeds, dict):
            # Several node types: features per (type, name), labels of
            # the target type's seeds.
            data = lambda ntype: self.g.nodes[ntype].data  # noqa: E731
            features = {(ntype, key): data(ntype)[key][input_nodes[ntype]]
                        for ntype, keys in self.feature_keys.items()
                        for key in keys if ntype in input_nodes}
            labels = {ntype: data(ntype)[self.label_key][ids].to(self.device)
                      for ntype, ids in seeds.items() if ntype == self.target}
        else:
            features = {key: self.g.ndata[key][input_nodes]
                        for key in self.feature_keys}
            labels = self.g.ndata[self.label_key][seeds].to(self.device)
        return SimpleNamespace(
            input_nodes=input_nodes, seed_nodes=seeds,
            blocks=[block.to(self.device) for block in blocks],
            node_features={key: value.to(self.dtype or value.dtype).to(
                self.device) for key, value in features.items()},
            labels=labels,
        )

    def source(self, batches):
        """The batches of one pass (gbrun.batches.Batches asks): one
        DistNodeDataLoader a pass, over exactly the nodes this pass hands out
        (after the batches a stopped run trained, at most `batches.limit` in
        all), so no request is left behind in DGL's sampler processes when a
        pass ends. Shuffling derives from (seed, rank, epoch); the neighbors
        are sampled by DGL's servers and the trainer's own DGL random
        generator, which the seed does not reach. Returns (batches, their
        number)."""
        size, step, rank = self.batch_size, batches.step, batches.rank
        order = self.order(batches.seed, rank, batches.epoch or 0)
        total = -(-sum(len(ids) for _, ids in order) // size)
        if batches.limit is not None:
            total = min(total, batches.limit)
        handed_out = []
        if self.record is not None:
            self.record.append((batches.name, dict(order).get(None, order),
                                handed_out))
        parts = take(order, step * size, total * size)
        if not parts:
            return iter(()), total
        nids = parts[0][1] if parts[0][0] is None else dict(parts)
        sampled = node_dataloader_class()(
            self.g, nids, self.sampler, batch_size=size, shuffle=False,
            drop_last=False)

        def each():
            for index, (input_nodes, seeds, blocks) in enumerate(sampled, step):
                if index == self.fail_after and self.hang:
                    while True:  # a trainer that stops making progress
                        time.sleep(60)
                if index == self.fail_after:
                    raise RuntimeError(
                        f"--fail-after-batches {index} on rank {rank}")
                LAST_PROGRESS[0] = time.monotonic()  # for TrainerWatch
                handed_out.append(seeds)
                yield self.batch(input_nodes, seeds, blocks)

        return each(), total


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
        while True:
            peers = port_peers(port)
            if any(state == LISTEN for state, _ in peers):
                listening_since = listening_since or time.monotonic()
            clients = [(state, peer) for state, peer in peers
                       if state != LISTEN]
            seen = seen or bool(clients)
            seen_local = seen_local or any(peer == ip for _, peer in clients)
            if seen_local:
                clients = [(state, peer) for state, peer in clients
                           if peer == ip]
            if any(state == ESTABLISHED for state, _ in clients):
                gone_since = None
            elif seen:
                gone_since = gone_since or time.monotonic()
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


def tcp_rows(tables=("/proc/net/tcp", "/proc/net/tcp6")):
    """The rows (split into fields) of this network namespace's TCP tables:
    [1] local and [2] remote address (hex), [3] state, [9] socket inode."""
    rows = []
    for table in tables:
        try:
            with open(table) as f:
                rows += [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
    return rows


def port_peers(port):
    """(TCP state in hex, as /proc/net/tcp shows it, remote IPv4 address)
    of this network namespace's sockets whose local port is `port`, the
    listening one included (IPv6 ones with the remote address None)."""
    found = []
    for row in tcp_rows():
        if int(row[1].rsplit(":", 1)[1], 16) == port:
            address = row[2].rsplit(":", 1)[0]
            found.append((row[3], hex_ipv4(address)
                          if len(address) == 8 else None))
    return found


def hex_ipv4(address):
    """/proc/net/tcp's address (little-endian hex) as dotted IPv4."""
    return ".".join(str(b) for b in bytes.fromhex(address)[::-1])


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

    def __init__(self, servers, connect_timeout, graph_name,
                 progress_timeout=PROGRESS_TIMEOUT_S, poll_s=1.0):
        self.servers, self.connect_timeout = set(servers), connect_timeout
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
        self.samplers = children(os.getpid())
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
                ready = sum(self.servers <= established(pid)
                            for pid in children(os.getpid()))
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
            dead = [pid for pid in self.samplers if not alive(pid)]
            if dead:
                self.fail(f"its sampler process {dead[0]} died")
            last = max(self.serving_since, LAST_PROGRESS[0] or 0)
            if time.monotonic() - last > self.progress_timeout:
                self.fail(f"no batch for {self.progress_timeout:g} s "
                          f"(--progress-timeout), at {main_thread_at()}")

    def fail(self, cause):
        from .launch import FAILURE_REPORT

        # Unless the main thread has reported its own failure first (it then
        # ends the process itself).
        if self.stopped.is_set() or not FAILURE_REPORT.acquire(blocking=False):
            return
        rank = os.environ.get("RANK", "?")
        os.write(2, f"rank {rank} failed: {cause}; exiting\n".encode())
        for pid in self.samplers or children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
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
        os.path.dirname(__file__)})
    script = os.path.realpath(getattr(sys.modules["__main__"], "__file__", ""))
    own = [entry for entry in stack
           if not os.path.realpath(entry.filename).startswith(others)
           and os.path.realpath(entry.filename) != script]
    where = [stack[-1]] + ([own[-1]] if own and own[-1] is not stack[-1] else [])
    return " <- ".join(f"{entry.filename}:{entry.lineno} in {entry.name}"
                       for entry in where)


def established(pid="self"):
    """The (remote ip, remote port) of process `pid`'s established IPv4
    TCP connections."""
    return {address for address, state in own_connections(pid)
            if state == ESTABLISHED}


def own_connections(pid="self"):
    """[((remote ip, remote port), TCP state)] of process `pid`'s IPv4
    sockets (its /proc/PID/fd matched against /proc/net/tcp)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    except OSError:
        return []
    found = []
    for row in tcp_rows(("/proc/net/tcp",)):
        if len(row) > 9 and row[9] in inodes:
            ip_hex, port_hex = row[2].split(":")
            found.append(((hex_ipv4(ip_hex), int(port_hex, 16)), row[3]))
    return found


def children(pid):
    """The pids of `pid`'s living child processes but multiprocessing's
    resource tracker (left to unlink the pool's semaphores once `pid` has
    gone: killed, it would leave them in /dev/shm)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat and int(stat[1]) == pid and stat[0] != "Z":
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if b"resource_tracker" in f.read():
                            continue
                except OSError:
                    continue
                found.append(int(entry))
    return found


def alive(pid):
    stat = read_stat(pid)
    return stat is not None and stat[0] != "Z"


def read_stat(pid):
    """(state, ppid) from /proc/PID/stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[1]


PR_SET_PDEATHSIG = 1


def die_with_trainer(trainer_pid):
    """In each of DGL's sampler processes (a task the trainer sends them
    all): SIGKILL when the trainer dies, instead of waiting for its tasks
    for ever."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != trainer_pid:  # it died before the prctl
        os._exit(1)


def samplers_die_with_trainer():
    """Sends die_with_trainer to this trainer's DGL sampler processes, if
    it has any (DGL_NUM_SAMPLER > 0)."""
    from dgl.distributed.dist_context import get_sampler_pool

    pool, _ = get_sampler_pool()
    if pool is not None:
        pool.submit_task_to_all_workers(die_with_trainer, os.getpid())


def fail_fast(graph_name, flush=True):
    """A trainer's end on any error, once its traceback is printed: its
    machine's shared memory of the job (graph `graph_name`) unlinked, then
    exit status 1 at once. A clean exit would wait for ever in DGL's exit
    hook (a barrier with the other trainers) and in gloo's teardown; the
    other trainers fail at their next collective, and the servers and
    samplers leave once their trainers have gone (see above)."""
    if flush:  # (not from another thread: the main one may hold the lock)
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        unlink_job_memory(graph_name)
        # The temporary files that exit handlers, skipped here, remove.
        shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    finally:
        os._exit(1)


# DGL's shared memory names that do not start with the graph's name (read in
# v2.1.0: kvstore.py's features and DistTensors, GraphBolt's shared graph).
DGL_SEGMENT = re.compile(r"-kvdata-$|^dgl\.graphbolt\.")


def unlink_job_memory(graph_name):
    """Unlinks the POSIX shared memory (/dev/shm) of the job that this
    process maps or holds open: the partition's graph, its partition book,
    its features and DistTensors, named after `graph_name` or as DGL names
    them. DGL unlinks them only in destructors or in its own SIGTERM handler
    (dgl v2.1.0, src/runtime/shared_mem.cc and src/rpc/rpc.cc), which an
    os._exit or a killed process skips: each failed job would hold a
    partition's worth of memory until the machine reboots. Unlinking only
    removes the names; processes that map them go on until they exit.
    Returns the names unlinked."""
    names = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    names.add(fields[5].strip())
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        return []
    unlinked = []
    for path in sorted(names):
        name = path[len("/dev/shm/"):]
        if not path.startswith("/dev/shm/") or path.endswith(" (deleted)"):
            continue
        if name.startswith(graph_name) or DGL_SEGMENT.search(name):
            try:
                os.unlink(path)
                unlinked.append(name)
            except OSError:
                continue  # another process of the job was first
    return unlinked


def start_one_machine(command, part_config, num_trainers, out_dir,
                      samplers=0, env=None):
    """Starts a one-machine job on this host as DGL's tools/launch.py
    starts a machine's part (v2.1.0, the same through v2.4.0): one graph
    server running `command` (a training script and its arguments) with
    DGL_ROLE=server, and `num_trainers` trainers running it under
    torch.distributed.run, each with the environment launch.py exports, on
    127.0.0.1. Nothing watches or kills them. Their output goes to
    out_dir/server.txt and out_dir/trainers.txt; returns (server, trainers),
    two Popen objects."""
    from .launch import free_port

    ip_config = os.path.join(out_dir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.write(f"127.0.0.1 {free_port()}\n")
    common = dict(
        os.environ, **(env or {}), DGL_NUM_SAMPLER=str(samplers),
        DGL_NUM_CLIENT=str(num_trainers * (1 + samplers)),
        DGL_CONF_PATH=part_config, DGL_IP_CONFIG=ip_config,
        DGL_NUM_SERVER="1", DGL_GRAPH_FORMAT="csc")

    def start(name, prefix, role_env):
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as log:
            return subprocess.Popen(
                [sys.executable, *prefix, *command], stdout=log,
                stderr=subprocess.STDOUT, env={**common, **role_env})

    server = start("server", [], {"DGL_ROLE": "server", "DGL_SERVER_ID": "0",
                                  "OMP_NUM_THREADS": "1"})
    trainers = start("trainers", [
        "-m", "torch.distributed.run", f"--nproc_per_node={num_trainers}",
        "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}"], {
        "DGL_DIST_MODE": "distributed", "DGL_ROLE": "client",
        "DGL_GROUP_ID": "0", "OMP_NUM_THREADS": "1"})
    return server, trainers
