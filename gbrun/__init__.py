"""Support for node_classification.py: everything a user of the example does
not need to edit. The example imports it; it never imports the example, and
receives what is model- or data-specific (keys, the resume key, the layer
count, the function each rank runs) as arguments.

    cli         the one-line error for bad input, argument types
    launch      the device plan, mp.spawn and torchrun, a rank's lifecycle
    stop        SIGTERM/SIGINT: every rank stops at one step, resumably
    data        dataset loading and checks, placement, GraphBolt API shapes,
                seeded batches
    checkpoint  the run state, checkpoint files, model.pt, metrics.jsonl
    tuning      CPU allocator and prefetcher settings
    ondisk      the OnDiskDataset writer the dataset scripts share
"""
from .graphbolt import INSTALL_CUDA_DGL, gb  # first: sets DGLBACKEND
from .checkpoint import (
    CHECKPOINT_FILE, METRICS_FILE, MODEL_FILE, Job, RunState, open_checkpoint,
)
from .cli import (
    ArgumentParser, UsageError, check_fanout, fail, fanout_list, int_at_least,
    port, positive_float,
)
from .data import (
    BUILTIN_DATASETS, check_dataset, check_train_split, dataset_identity,
    graphbolt_options, index_select_store, load_dataset, node_key, place_dataset,
    store_in_bf16,
    synchronized_time,
)
from .launch import MODES, barrier, launch_ranks, load_job_in_turn, plan_run
from .tuning import keep_freed_memory, poll_less
