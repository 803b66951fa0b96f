"""Dropout, and ReLU then dropout, in one pass on CPU ranks (--fused-dropout,
docs/performance.md).

torch 2.2's CPU dropout makes four passes over its input: it draws a
Bernoulli mask with MKL (bound by random-number generation), scales it,
multiplies, and keeps the mask for backward, which multiplies again. On a
GraphSAGE step that was 13-33% of the time, depending on the CPU. This
kernel draws each element's mask bit from a hash of (seed, index) and
multiplies in the same pass; backward regenerates the mask from the seed
instead of storing it. Before dropout, ReLU costs two more passes (forward
and backward); the pair runs as one pass each way. The seed comes from
torch's generator, so a seeded run repeats digit for digit, at any thread
count.

The kernel is a small C file compiled once per machine with the C compiler
(`$CC`, else `cc`), cached in gbrun.cache's directory (~/.cache/gbrun,
where no other user can change what is in it); without a compiler, or where
the file of that name there is not this user's own build (a symlink, another
user's, writable by others, not the kernel), the model keeps torch's dropout
(kernel_problem() says why, in one line). It is loaded from a copy of the
file checked, made through descriptors (_open_library).

Module state: `_kernel`, the kernel this process loaded (or why it could
not), built or loaded at its first use and kept for the process's life (a
library loaded with ctypes stays loaded)."""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import psutil
import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from . import info
from .. import cache

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "dropout.c")
FLAGS = ["-O3", "-march=native", "-std=c99", "-fPIC"] + (
    # gcc and clang default to 256-bit vectors on x86; the bf16 loops, bound
    # by hashing, took 25% less time with 512 bits where the CPU has them.
    ["-mprefer-vector-width=512"] if platform.machine() == "x86_64" else [])
MAX_ELEMENTS = 2**32  # the kernel numbers elements with 32 bits
_kernel = None  # (library or None, the reason it is None)
AGAIN = "remove it, and the next launch builds the kernel again"


def kernel_problem():
    """None if the kernel is built (or was, on this machine), else why not,
    in a few words."""
    return _load()[1]


def _load():
    global _kernel
    if _kernel is None:
        try:
            library = _open_library()
        except (OSError, subprocess.SubprocessError) as error:
            _kernel = (None, str(error))
        else:
            _kernel = (library, None)
    return _kernel


def _open_library():
    """The kernel, loaded from the cache (built into it first where this
    source, compiler, OpenMP runtime and CPU have none yet). What is loaded
    is the file checked, through descriptors (gbrun.cache): a copy of its
    bytes, made from its descriptor into a fresh directory of the checked
    cache directory, reached through that directory's descriptor too."""
    compiler, openmp, key = _key()
    path, directory = cache.open_cache_dir()  # this user's only
    name = f"dropout-{key}.so"
    try:
        try:
            fd = _open_built(directory, name, os.path.join(path, name))
        except FileNotFoundError:
            _build(compiler, openmp, path, directory, name)
            fd = _open_built(directory, name, os.path.join(path, name))
        with os.fdopen(fd, "rb") as built:
            library = _load_copy(built, directory, name)
    finally:
        os.close(directory)
    return _declare(library, os.path.join(path, name))


def _open_built(directory, name, path):
    try:
        return cache.open_file(directory, name, path)
    except cache.CacheError as error:
        raise cache.CacheError(f"{error}; {AGAIN}") from None


def _load_copy(built, directory, name):
    """ctypes.CDLL of a copy of `built`'s bytes. A fresh path each time:
    the dynamic loader reuses a library already loaded under the same
    name, whatever the file there now."""
    fresh = tempfile.mkdtemp(dir=f"/proc/self/fd/{directory}", prefix="load-")
    try:
        copy = os.path.join(fresh, name)
        with open(copy, "xb") as f:
            shutil.copyfileobj(built, f)
        return ctypes.CDLL(copy)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def _declare(library, path):
    """`library` with its two functions' types set; OSError where it lacks
    them (a file of that name that is not this kernel)."""
    try:
        dropout = library.gbrun_dropout
        backward = library.gbrun_relu_dropout_backward
    except AttributeError:  # its own words name the copy, not `path`
        raise OSError(f"{path} is not gbrun's dropout kernel (no "
                      f"gbrun_dropout in it); {AGAIN}") from None
    dropout.restype = None
    dropout.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32,
        ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]
    backward.restype = None
    backward.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
    ]
    return library


def _key():
    """(compiler, OpenMP runtime, the key of what they build from this
    source on this CPU)."""
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
        str((stat.st_size, stat.st_mtime_ns)).encode(), info.description().encode(),
        str(openmp).encode(),
    ])).hexdigest()[:16]
    return compiler, openmp, key


def _build(compiler, openmp, path, directory, name):
    """Compiles the kernel into `directory` (descriptor; `path`) as `name`.
    Concurrent ranks each compile to files of their own and rename the
    result into place."""
    partial = tempfile.mkdtemp(dir=path, prefix="build-")
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
        # Writable by nobody else whatever the umask (open_file refuses
        # one that is).
        os.chmod(os.path.join(partial, "dropout.so"), 0o755)
        os.replace(os.path.join(partial, "dropout.so"), name,
                   dst_dir_fd=directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _openmp_runtime():
    """The OpenMP library torch runs its threads on (PyPI's wheels bring
    their own libgomp), or None."""
    try:
        paths = {m.path for m in psutil.Process().memory_maps(grouped=True)}
    except psutil.Error:
        return None
    runtimes = sorted(p for p in paths if os.path.basename(p).startswith(
        ("libgomp", "libiomp", "libomp")))
    return runtimes[0] if runtimes else None


def fuse_dropout(model):
    """Makes every nn.Dropout in `model` (the class itself, not its
    variants) a Dropout of this module, and every nn.Sequential of exactly
    nn.ReLU() and nn.Dropout a ReLUDropout, in place; returns `model`. Its
    repr, state_dict and eval behaviour stay the same."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                fused = Dropout(child.p, child.inplace)
            elif is_relu_then_dropout(child):
                fused = ReLUDropout(child[1].p)
            else:
                continue
            setattr(module, name, fused.train(child.training))
    return model


def is_relu_then_dropout(module):
    return (type(module) is nn.Sequential and len(module) == 2
            and type(module[0]) is nn.ReLU and not module[0].inplace
            and type(module[1]) is nn.Dropout and not module[1].inplace)


def runs_here(module, x):
    """True if the kernel does `module`'s training forward on `x`: float32
    or bfloat16 on the CPU, 0 < p < 1, not in place, and a kernel built."""
    return (module.training and 0 < module.p < 1 and not module.inplace
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() <= MAX_ELEMENTS and _load()[0] is not None)


class Dropout(nn.Dropout):
    """nn.Dropout whose training forward on a float32 or bfloat16 CPU tensor
    is one pass of the kernel; anything else (eval, GPUs, inplace, p of 0
    or 1, other dtypes, no kernel) is nn.Dropout's."""

    def forward(self, x):
        if runs_here(self, x):
            return FusedDropout.apply(x, self.p, False)
        return super().forward(x)


class ReLUDropout(nn.Sequential):
    """nn.Sequential(nn.ReLU(), nn.Dropout(p)) whose training forward, where
    Dropout's is the kernel's, is one pass for both, and its backward one
    pass too; anything else runs the two modules. Its repr is the
    Sequential's."""

    def __init__(self, p):
        super().__init__(nn.ReLU(), Dropout(p))

    def __repr__(self):  # the model looks the same
        return repr(nn.Sequential(*self))

    def forward(self, x):
        if runs_here(self[1], x):
            return FusedDropout.apply(x, self[1].p, True)
        return super().forward(x)


class FusedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, with_relu):
        # From torch's generator: --seed and each step's seed reach it.
        ctx.seed = int(torch.empty((), dtype=torch.int64).random_())
        ctx.p, ctx.with_relu = p, with_relu
        out = apply_mask(x.contiguous(), ctx.seed, p, with_relu)
        if with_relu:
            ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.with_relu:
            (forward_out,) = ctx.saved_tensors
            return relu_mask_backward(grad, forward_out, ctx.p), None, None
        return apply_mask(grad, ctx.seed, ctx.p), None, None


def keep_scale(dtype, p):
    """The scale torch's dropout multiplies by, in the tensor's dtype."""
    return torch.ones((), dtype=dtype).div_(1 - p).item()


def apply_mask(tensor, seed, p, with_relu=False):
    """tensor (with ReLU first) times the mask of `seed`: each element kept
    with probability 1 - p and scaled by 1 / (1 - p), or zeroed."""
    out = torch.empty_like(tensor)
    _load()[0].gbrun_dropout(
        tensor.dtype == torch.bfloat16, tensor.data_ptr(), out.data_ptr(),
        tensor.numel(), seed, round((1 - p) * 2**24),
        keep_scale(tensor.dtype, p), with_relu, torch.get_num_threads(),
    )
    return out


def relu_mask_backward(grad, forward_out, p):
    """ReLU then dropout's backward: `grad` scaled by 1 / (1 - p) where the
    forward's output is above 0, else 0."""
    out = torch.empty_like(grad)
    _load()[0].gbrun_relu_dropout_backward(
        grad.dtype == torch.bfloat16, grad.data_ptr(), forward_out.data_ptr(),
        out.data_ptr(), grad.numel(), keep_scale(grad.dtype, p),
        torch.get_num_threads(),
    )
    return out
