"""Support for node_classification.py: everything a user of the example does
not need to edit. The example imports it; it never imports the example, and
receives what is model- or data-specific (keys, the resume key, the layer
count, the function each rank runs) as arguments.

    cli         the one-line error for bad input, argument types
    launch      the device plan (and the model as CPU ranks run it), mp.spawn
                and torchrun, a rank's lifecycle
    stop        SIGTERM/SIGINT: every rank stops at one step, resumably
    data        dataset loading and checks
    placement   where --mode puts the graph and features, the GPU cache
    batches     a rank's seeded, skippable mini-batches of one pass
    graphbolt   GraphBolt's import, its API shapes by release, the private
                attributes read
    checkpoint  the run state, checkpoint files, model.pt, metrics.jsonl
    metrics     torchmetrics across ranks where a rank has no items
    distributed DGL's distributed engine under the example's loop (imported
                by the distributed trainer only)
    tuning      CPU memory (glibc's malloc, oneDNN's cache) and prefetcher
                settings
    dropout     nn.Dropout, and ReLU then dropout, in one pass on CPU ranks
                (a C kernel built once)
    products    nn.Linear's bf16 products on CPU ranks in shapes that recur
    ondisk      the OnDiskDataset writer the dataset scripts share
"""
import importlib
import os

# Before any import of dgl (the scripts import it after gbrun): without it,
# importing dgl warns that no backend is configured.
os.environ.setdefault("DGLBACKEND", "pytorch")

# Cheap to import: `import gbrun.cli` (argument types, the one-line error)
# loads no torch or DGL. The names below come from their modules on first
# use; GraphBolt's one-line install check (graphbolt.py) runs where
# GraphBolt is first needed.
_NAMES = {
    "graphbolt": ["INSTALL_CUDA_DGL", "gb", "graphbolt_options"],
    "checkpoint": ["CHECKPOINT_FILE", "METRICS_FILE", "MODEL_FILE", "Job",
                   "RunState", "open_checkpoint", "settings"],
    "cli": ["ArgumentParser", "UsageError", "check_fanout", "fail",
            "fanout_list", "int_at_least", "load_example", "port",
            "positive_float", "python_file"],
    "data": ["BUILTIN_DATASETS", "check_dataset", "check_train_split",
             "dataset_identity", "feature_size", "load_dataset", "node_key",
             "store_in_bf16"],
    "placement": ["index_select_store", "place_dataset"],
    "batches": ["synchronized_time"],
    "metrics": ["gather_all_tensors"],
    "launch": ["MODES", "barrier", "launch_ranks", "load_job_in_turn",
               "plan_run", "tune_model"],
    "stop": ["StopSignal"],
    "tuning": ["keep_freed_memory", "poll_less"],
    "dropout": ["fuse_dropout"],
    "products": ["split_products"],
}
_MODULE_OF = {name: module for module, names in _NAMES.items()
              for name in names}
_SUBMODULES = set(_NAMES) | {"distributed", "ondisk"}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'gbrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__),
                    name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF) | _SUBMODULES)
