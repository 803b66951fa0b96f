"""A trainer's mini-batches on DGL's distributed engine, in the shape
GraphBolt hands the example (DistLoader, a gbrun.sources.BatchSource), and
the failures and records the distributed trainer's tests ask of them
(DebugHooks)."""
import dataclasses
import time
from types import SimpleNamespace

import dgl
import torch

from ..sources import BatchSource


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


@dataclasses.dataclass(frozen=True)
class DebugHooks:
    """The distributed trainer's debugging options (for the tests), one
    object beside the data source's own arguments: `record`, a list that
    gets (pass name, this pass's node order, the seeds of each batch handed
    out) from every loader (--dump-seeds); trainer `fail_rank`'s training
    loader raises at batch `fail_after` (--fail-after-batches), or sleeps
    for ever there when `hang` (--hang-after-batches)."""
    record: list | None = None
    fail_after: int | None = None
    fail_rank: int = 0
    hang: bool = False

    def of_loader(self, is_train, rank):
        """The hooks of one loader of trainer `rank`: all record (into the
        same list), only trainer `fail_rank`'s training loader fails."""
        if is_train and rank == self.fail_rank:
            return self
        return dataclasses.replace(self, fail_after=None, hang=False)


NO_HOOKS = DebugHooks()


class DistLoader(BatchSource):
    """What the example's loop calls a data loader, on a DistGraph: this
    trainer's nodes `nids` of one split, `batch_size` seeds a batch, their
    neighbors sampled with `fanout`, the node features `feature_keys` and
    the labels `label_key` fetched from the servers that own them, on
    `device`. A training loader (`num_batches` given) shuffles its nodes
    every epoch and hands out that many full batches, as many as every
    other trainer (GraphBolt's drop_last and drop_uneven_inputs); an
    evaluation loader hands out every node once. `hooks`: its DebugHooks
    (records and failures for the tests). On a graph of several node types,
    `nids` is {node type: ids within the type} (one type, the `target`
    type with the labels, when training), and batches are in GraphBolt's
    shape for such graphs: node features keyed (node type, name), seeds and
    labels per type. Each batch handed out beats `heartbeat` (a
    gbrun.dgl_engine.watch.Heartbeat: the trainer is making progress)."""

    def __init__(self, g, nids, fanout, batch_size, feature_keys, label_key,
                 device, heartbeat, num_batches=None, dtype=None, target=None,
                 hooks=NO_HOOKS):
        self.g, self.batch_size, self.target = g, batch_size, target
        self.heartbeat = heartbeat
        # The nodes as [(node type, ids)], the type None for one.
        self.parts = list(nids.items()) if isinstance(nids, dict) else (
            [(None, nids)])
        self.sampler = dgl.dataloading.NeighborSampler(fanout)
        self.feature_keys, self.label_key = feature_keys, label_key
        self.device, self.dtype = device, dtype
        self.num_batches, self.hooks = num_batches, hooks

    def order(self, seed):
        """The nodes of one pass in the order they are handed out, as
        [(node type, ids)]: a training pass shuffled by the pass's `seed`
        (None: unseeded). Training takes one type."""
        if self.num_batches is None:
            return self.parts
        [(ntype, nids)] = self.parts
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
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
        pass ends. Shuffling derives from the pass's seed; the neighbors
        are sampled by DGL's servers and the trainer's own DGL random
        generator, which the seed does not reach. Returns (batches, their
        number)."""
        size, step, rank = self.batch_size, batches.step, batches.rank
        order = self.order(batches.pass_seed())
        total = -(-sum(len(ids) for _, ids in order) // size)
        if batches.limit is not None:
            total = min(total, batches.limit)
        handed_out = []
        if self.hooks.record is not None:
            self.hooks.record.append(
                (batches.name, dict(order).get(None, order), handed_out))
        parts = take(order, step * size, total * size)
        if not parts:
            return iter(()), total
        nids = parts[0][1] if parts[0][0] is None else dict(parts)
        sampled = node_dataloader_class()(
            self.g, nids, self.sampler, batch_size=size, shuffle=False,
            drop_last=False)
        if len(parts) == 1:  # one type, as every training pass
            sampled = in_request_order(sampled, *parts[0], size)

        def each():
            for index, (input_nodes, seeds, blocks) in enumerate(sampled, step):
                if index == self.hooks.fail_after and self.hooks.hang:
                    while True:  # a trainer that stops making progress
                        time.sleep(60)
                if index == self.hooks.fail_after:
                    raise RuntimeError(
                        f"--fail-after-batches {index} on rank {rank}")
                self.heartbeat.beat()  # for TrainerWatch
                handed_out.append(seeds)
                yield self.batch(input_nodes, seeds, blocks)

        return each(), total


def in_request_order(sampled, ntype, ids, size):
    """The batches of `sampled` (DGL's distributed loader over the nodes
    `ids` of one type, `ntype` or None for a graph of one, `size` seeds a
    batch, not shuffled) in the order they were asked for. With several
    sampler processes DGL 2.1 hands them out as they finish (one result
    queue for all, dist_context.py), and a resumed pass skips what the
    stopped one trained by position: out of order, it would train some
    nodes twice and skip others. A batch is known by its first seed."""
    index_of = {int(first): index for index, first in enumerate(ids[::size])}
    waiting, expected = {}, 0
    for batch in sampled:
        seeds = batch[1] if ntype is None else batch[1][ntype]
        waiting[index_of[int(seeds[0])]] = batch
        while expected in waiting:
            yield waiting.pop(expected)
            expected += 1
    if waiting:
        raise RuntimeError(
            f"DGL's loader handed out batches {sorted(waiting)} of a pass "
            f"but not batch {expected}")


def node_dataloader_class():
    """DistNodeDataLoader: in dgl.distributed since 2.4, in dgl.dataloading
    before (told apart by what the modules hold, not by version)."""
    return getattr(dgl.distributed, "DistNodeDataLoader", None) or (
        dgl.dataloading.DistNodeDataLoader)
