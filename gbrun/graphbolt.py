"""dgl.graphbolt, imported once with a one-line error where it cannot be:
dgl 2.4+ refuses to import GraphBolt's CPU build next to a CUDA torch, and
dgl 2.1-2.3 have no GraphBolt library for a torch they were not built for."""
import os
import sys


# PyPI's torch 2.2.1 is a CUDA 12.1 build, PyPI's dgl a CPU-only one. DGL's
# CUDA build of the same release comes from DGL's own wheel index.
INSTALL_CUDA_DGL = (
    "pip install dgl==2.1.0+cu121 "
    "-f https://data.dgl.ai/wheels/torch-2.2/cu121/repo.html"
)

def cannot_load(error):
    """One line saying why dgl.graphbolt cannot load, and what to do."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("dgl", "torch"):
        return (f"{error.name} is not installed "
                "(pip install -r requirements.txt)")
    if isinstance(error, FileNotFoundError):
        # dgl 2.1-2.3 ship one GraphBolt library per torch release.
        import torch

        return (f"{error} (this DGL has no GraphBolt library for torch "
                f"{torch.__version__}: pip install -r requirements.txt "
                "installs the versions that match)")
    return (f"{error} (for GPUs: {INSTALL_CUDA_DGL}; for CPU ranks: "
            "CUDA_VISIBLE_DEVICES= python ...)")


try:
    import dgl.graphbolt as gb
except (ImportError, FileNotFoundError) as error:
    print(f"{os.path.basename(sys.argv[0])}: error: {cannot_load(error)}",
          file=sys.stderr)
    sys.exit(2)

__all__ = ["gb", "INSTALL_CUDA_DGL"]
