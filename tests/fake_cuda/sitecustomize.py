"""Put this folder on PYTHONPATH to make every Python process (spawned
ranks included) look like a GPU machine set up from PyPI: torch (a CUDA
build) reports FAKE_CUDA_DEVICES GPUs (default 2), DGL stays PyPI's CPU-only
build. As with real GPUs, CUDA_VISIBLE_DEVICES= hides them. Nothing can run
on the fake devices: tests use this to check what the example decides."""
import os

import torch

_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
_count = int(os.environ.get("FAKE_CUDA_DEVICES", "2"))
if _visible is not None:
    _count = min(_count, len([i for i in _visible.split(",") if i.strip()]))
torch.cuda.is_available = lambda: _count > 0
torch.cuda.device_count = lambda: _count
