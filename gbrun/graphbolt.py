"""dgl.graphbolt, imported once with a one-line error where it cannot be:
dgl 2.4+ refuses to import GraphBolt's CPU build next to a CUDA torch."""
import os
import sys

# Without this, importing dgl warns that no backend is configured.
os.environ.setdefault("DGLBACKEND", "pytorch")

# PyPI's torch 2.2.1 is a CUDA 12.1 build, PyPI's dgl a CPU-only one. DGL's
# CUDA build of the same release comes from DGL's own wheel index.
INSTALL_CUDA_DGL = (
    "pip install dgl==2.1.0+cu121 "
    "-f https://data.dgl.ai/wheels/torch-2.2/cu121/repo.html"
)

try:
    import dgl.graphbolt as gb
except ImportError as error:
    print(
        f"{os.path.basename(sys.argv[0])}: error: {error} (for GPUs: "
        f"{INSTALL_CUDA_DGL}; for CPU ranks: CUDA_VISIBLE_DEVICES= python ...)",
        file=sys.stderr,
    )
    sys.exit(2)

__all__ = ["gb", "INSTALL_CUDA_DGL"]
