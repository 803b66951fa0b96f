"""Dropout in one pass on CPU ranks (--fused-dropout, docs/performance.md).

torch 2.2's CPU dropout makes four passes over its input: it draws a
Bernoulli mask with MKL (bound by random-number generation), scales it,
multiplies, and keeps the mask for backward, which multiplies again. On a
GraphSAGE step that was 13-33% of the time, depending on the CPU. This
kernel draws each element's mask bit from a hash of (seed, index) and
multiplies in the same pass; backward regenerates the mask from the seed
instead of storing it. The seed comes from torch's generator, so a seeded
run repeats digit for digit, at any thread count.

The kernel is a small C file compiled once per machine with the C compiler
(`$CC`, else `cc`), cached under ~/.cache/gbrun; without a compiler the
model keeps torch's dropout (kernel_problem() says why)."""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "dropout.c")
FLAGS = ["-O3", "-march=native", "-std=c99", "-fPIC"]
MAX_ELEMENTS = 2**32  # the kernel numbers elements with 32 bits
_kernel = None  # (library or None, the reason it is None)


def kernel_problem():
    """None if the kernel is built (or was, on this machine), else why not,
    in a few words."""
    return _load()[1]


def _load():
    global _kernel
    if _kernel is None:
        try:
            library = ctypes.CDLL(_build())
        except (OSError, subprocess.SubprocessError) as error:
            _kernel = (None, str(error))
        else:
            library.gbrun_dropout.restype = None
            library.gbrun_dropout.argtypes = [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32,
                ctypes.c_float, ctypes.c_int,
            ]
            _kernel = (library, None)
    return _kernel


def _build():
    """The path of the compiled kernel, compiling it first if this source,
    compiler, OpenMP runtime and CPU have none yet. Concurrent ranks each
    compile to files of their own and rename the result into place."""
    name = os.environ.get("CC") or "cc"
    compiler = shutil.which(name)
    if compiler is None:
        raise OSError(f"no C compiler '{name}' (set CC)")
    openmp = _openmp_runtime()
    with open(SOURCE, "rb") as f:
        source = f.read()
    stat = os.stat(compiler)
    key = hashlib.sha256(b"\0".join([
        source, " ".join(FLAGS).encode(), os.path.realpath(compiler).encode(),
        str((stat.st_size, stat.st_mtime_ns)).encode(), _cpu().encode(),
        str(openmp).encode(),
    ])).hexdigest()[:16]
    directory = _cache_dir()
    path = os.path.join(directory, f"dropout-{key}.so")
    if os.path.exists(path):
        return path
    partial = tempfile.mkdtemp(dir=directory, prefix="build-")
    # Compiled with OpenMP, but linked against torch's runtime rather than
    # the compiler's: one pool of threads, no second one competing with it.
    steps = [
        [compiler, *FLAGS, *(["-fopenmp"] if openmp else []), "-c", SOURCE,
         "-o", os.path.join(partial, "dropout.o")],
        [compiler, "-shared", "-o", os.path.join(partial, "dropout.so"),
         os.path.join(partial, "dropout.o"),
         *([openmp, f"-Wl,-rpath,{os.path.dirname(openmp)}"] if openmp
           else [])],
    ]
    try:
        for command in steps:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise OSError(f"{compiler} failed to compile {SOURCE}: {last}")
        os.replace(os.path.join(partial, "dropout.so"), path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path


def _openmp_runtime():
    """The OpenMP library torch runs its threads on (PyPI's wheels bring
    their own libgomp), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    runtimes = sorted(p for p in paths if os.path.basename(p).startswith(
        ("libgomp", "libiomp", "libomp")))
    return runtimes[0] if runtimes else None


def _cpu():
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(
        sorted({line for line in lines if line.startswith(wanted)}))


def _cache_dir():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    for directory in (os.path.join(root, "gbrun"),
                      os.path.join(tempfile.gettempdir(),
                                   f"gbrun-{os.getuid()}")):
        try:
            os.makedirs(directory, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
        except OSError:
            continue
    raise OSError("no writable cache directory for the dropout kernel")


def fuse_dropout(model):
    """Makes every nn.Dropout in `model` (the class itself, not its
    variants) a Dropout of this module, in place; returns `model`. Its
    repr, state_dict and eval behaviour stay the same."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, Dropout(child.p, child.inplace))
    return model


class Dropout(nn.Dropout):
    """nn.Dropout whose training forward on a float32 or bfloat16 CPU tensor
    is one pass of the kernel; anything else (eval, GPUs, inplace, p of 0
    or 1, other dtypes, no kernel) is nn.Dropout's."""

    def forward(self, x):
        if (self.training and 0 < self.p < 1 and not self.inplace
                and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16)
                and x.numel() <= MAX_ELEMENTS and _load()[0] is not None):
            return FusedDropout.apply(x, self.p)
        return super().forward(x)


class FusedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        # From torch's generator: --seed and each step's seed reach it.
        ctx.seed = int(torch.empty((), dtype=torch.int64).random_())
        ctx.p = p
        return apply_mask(x.contiguous(), ctx.seed, p)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return apply_mask(grad.contiguous(), ctx.seed, ctx.p), None


def apply_mask(tensor, seed, p):
    """tensor times the mask of `seed`: each element kept with probability
    1 - p and scaled by 1 / (1 - p), or zeroed."""
    out = torch.empty_like(tensor)
    _load()[0].gbrun_dropout(
        tensor.dtype == torch.bfloat16, tensor.data_ptr(), out.data_ptr(),
        tensor.numel(), seed, round((1 - p) * 2**24),
        # The scale torch's dropout multiplies by, in the tensor's dtype.
        torch.ones((), dtype=tensor.dtype).div_(1 - p).item(),
        torch.get_num_threads(),
    )
    return out
