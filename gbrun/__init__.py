"""Support for node_classification.py: everything a user of the example does
not need to edit. The example imports it; it never imports the example, and
receives what is model- or data-specific (keys, the resume key, the layer
count, the function each rank runs) as arguments. Import the module you use
(`from gbrun import checkpoint, launch`): `import gbrun.cli` loads no torch.

    cli         the one-line error for bad input, argument types, the
                options gbrun reads (add_run_options)
    launch      the device plan, mp.spawn and torchrun, a rank's lifecycle
    stop        SIGTERM/SIGINT: every rank stops at one step, resumably
    progress    a run's progress: restore, epochs, stop, save (Progress)
    checkpoint  where a run starts, checkpoint files, the resume key
    datasets    dataset loading and checks
    placement   where --mode puts the graph and features, the GPU cache
    batches     a rank's seeded, skippable mini-batches of one pass
    graphbolt   GraphBolt's import, its API shapes by release, the private
                attributes read
    metrics     torchmetrics across ranks where a rank has no items
    predicting  --predict: every node, layer by layer across ranks, and the
                file in the dataset's node ids
    distributed DGL's distributed engine under the example's loop (imported
                by the distributed trainer only)
    tuning      a rank's settings for speed: CPU memory, the prefetcher, the
                model's dropout and bf16 products (tune_rank)
    dropout     nn.Dropout, and ReLU then dropout, in one pass on CPU ranks
                (a C kernel built once, where a plan uses it)
    products    nn.Linear's bf16 products on CPU ranks in shapes that recur
    ondisk      the OnDiskDataset writer the dataset scripts share
"""
import os

# Before any import of dgl (the scripts import it after gbrun): without it,
# importing dgl warns that no backend is configured.
os.environ.setdefault("DGLBACKEND", "pytorch")
