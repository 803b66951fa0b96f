"""Support for node_classification.py and its sibling link_prediction.py:
everything a user of the examples does not need to edit. The examples
import it; it never imports them, and receives what is model- or
data-specific (keys, the resume key, the layer count, the function each
rank runs) as arguments. Import the module you use
(`from gbrun import checkpoint, launch`): `import gbrun.cli` loads no torch.

The rank runtime, which the example's run() and loop reach:

    cli         the one-line refusal of bad input, argument types, the
                options gbrun reads (add_run_options), loading an example
    planning    the launch plan (a Plan): devices, backend, world size,
                rendezvous, threads (plan_run), decided once from what a
                Machine has
    launch      the launcher and torchrun, the Job every rank gets, a rank's
                lifecycle (run_rank)
    fork_server how ranks start: CPU ranks fork from multiprocessing's fork
                server, which imports the script's modules once (preload);
                preloaded, its last import, freezes them
    stop        SIGTERM/SIGINT: every rank stops at one step, resumably
    collectives the process group's barrier and teardown, as torch 2.2
                needs them
    progress    a run's progress: epochs, stop, save (Progress)
    run_state   a run's state in one room: what checkpoint.pt holds (the
                example's states and a RunState), read, checked, saved and
                restored (CheckpointManager)
    trees       one walk over nested data (state_dicts, resume keys)
    batches     a rank's seeded, skippable mini-batches of one pass
    checkpoint  where a run starts (start_or_resume), the resume key's
                parts, model.pt and model.json
    records     metrics.jsonl
    outputs     the files a job writes, opened by descriptor and never
                through a link or over another's file, and saved atomically
    sources     the two kinds of data a run trains from (a GraphBolt
                dataset, DGL's partitions) and what each provides
    placement   where --mode puts GraphBolt's graph and features
    predicting  --predict: every node, layer by layer across ranks, and the
                file in the dataset's node ids
    metrics     torchmetrics across ranks where a rank has no items
    graphbolt   GraphBolt's import, its API shapes by release, the private
                attributes read
    cache       the user's private cache directory (preprocessed datasets,
                the dropout kernel)

And three subpackages, each for one audience:

    data        datasets: loading and the example's checks, the label
                check, and the dataset writer the scripts share
    dgl_engine  DGL's distributed engine under the example's loop
                (distributed/ imports it)
    cpu         the CPU speed pack: memory settings, one-pass dropout,
                bf16 products in shapes that recur (cpu.tune_rank)

State a process keeps: the signal handlers of gbrun.stop's StopSignal
(handed to the rank's run() in its plan), gbrun.cpu.dropout's loaded
kernel, the garbage collector's frozen objects (the fork server's imports,
which its CPU ranks inherit, the launcher's own once its ranks have
ended, and a DGL engine process's at a clean end: gbrun.preloaded,
gbrun.launch.launch_ranks, gbrun.dgl_engine.cleanup.skip_last_collection;
each module's docstring or comment says why), and DGLBACKEND, set below.
"""
import os

# Before any import of dgl (the scripts import it after gbrun): without it,
# importing dgl warns that no backend is configured. A value of the user's
# own stays.
os.environ.setdefault("DGLBACKEND", "pytorch")
