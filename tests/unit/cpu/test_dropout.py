"""--fused-dropout (gbrun/cpu/dropout.py, dropout.c): nn.Dropout, and ReLU then
nn.Dropout, as one pass on CPU ranks. The kernel keeps each element with
probability 1 - p and scales it as torch's dropout does, independently of
its neighbours and of other calls; its mask repeats with torch's seed at
any thread count; backward applies the forward's mask; ReLU then dropout
equals the two one after the other, to the bit; everything it does not
handle, and a machine where it cannot be built, falls back to torch's."""
import ctypes
import math
import subprocess
import sys

import dgl.nn as dglnn
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gbrun.cache
import gbrun.graphbolt
import gbrun.cpu.dropout as fused
from gbrun import planning
import node_classification as nc
from helpers import REPO, with_plan

DTYPES = [torch.float32, torch.bfloat16]


def dropout(p):
    return gbrun.cpu.dropout.fuse_dropout(nn.Sequential(nn.Dropout(p)))[0]


def nonzero(shape, dtype):
    """Inputs that are never 0, so a zero output means dropped."""
    return (torch.rand(shape) + 0.5).to(dtype)


def scale(p, dtype):
    # What torch's dropout multiplies a kept element by (noise.div_(1 - p)).
    return torch.ones((), dtype=dtype).div_(1 - p)


def test_the_kernel_builds_here():
    assert fused.kernel_problem() is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_elements_are_scaled_as_torch_scales_them_at_rate_1_minus_p(
        dtype, p):
    x = nonzero((1000, 1000), dtype)
    torch.manual_seed(0)
    y = dropout(p)(x)
    kept = y != 0
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[kept], x[kept] * scale(p, dtype))
    n = x.numel()
    # Within 5 standard deviations of a binomial(n, 1 - p) count.
    assert abs(kept.sum().item() - n * (1 - p)) < 5 * math.sqrt(n * p * (1 - p))


def test_elements_and_calls_are_independent():
    p, n = 0.5, 1 << 20
    torch.manual_seed(0)
    layer = dropout(p)
    first = layer(torch.ones(n)) != 0
    second = layer(torch.ones(n)) != 0
    bound = 5 * math.sqrt(n * 0.25 * 0.75)  # binomial(n, 1/4)

    def both_kept(a, b):
        return abs((a & b).sum().item() - len(a) * 0.25) < bound

    # Neighbours in memory, in a row of 256, and two calls.
    assert both_kept(first[1:], first[:-1])
    assert both_kept(first[256:], first[:-256])
    assert both_kept(first, second)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_applies_the_forward_mask(dtype):
    p = 0.3
    x = nonzero((300, 257), dtype).requires_grad_()
    torch.manual_seed(0)
    y = dropout(p)(x)
    upstream = torch.randn(x.shape).to(dtype)
    y.backward(upstream)
    mask = (y != 0).to(dtype) * scale(p, dtype)
    assert torch.equal(x.grad, upstream * mask)


def test_the_mask_repeats_with_the_seed_at_any_thread_count():
    x = torch.randn(1000, 300)
    layer = dropout(0.5)
    threads = torch.get_num_threads()
    masks = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            torch.manual_seed(7)
            masks.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    torch.manual_seed(8)
    assert not torch.equal(layer(x), masks[0])


def test_a_non_contiguous_input_is_masked_as_its_contiguous_copy():
    x = torch.randn(300, 400)
    layer = dropout(0.5)
    torch.manual_seed(0)
    strided = layer(x.t())
    torch.manual_seed(0)
    assert torch.equal(strided, layer(x.t().contiguous()))


@pytest.mark.parametrize("case", ["eval", "p=0", "p=1", "inplace", "float64"])
def test_what_the_kernel_does_not_handle_is_torchs_dropout(case):
    p = {"p=0": 0.0, "p=1": 1.0}.get(case, 0.5)
    layer = gbrun.cpu.dropout.fuse_dropout(nn.Sequential(
        nn.Dropout(p, inplace=case == "inplace")))[0]
    assert isinstance(layer, fused.Dropout)
    dtype = torch.float64 if case == "float64" else torch.float32
    x = torch.randn(200, 300, dtype=dtype)
    if case == "eval":
        layer.eval()
    torch.manual_seed(0)
    expected = F.dropout(x.clone(), p, case != "eval")
    torch.manual_seed(0)
    assert torch.equal(layer(x.clone()), expected)


def test_only_nn_dropout_is_replaced_and_the_model_looks_the_same():
    model = nn.Sequential(
        nn.Dropout(0.2), nn.Dropout2d(0.3), nn.AlphaDropout(0.1),
        nn.ModuleList([dglnn.SAGEConv(4, 4, "mean", feat_drop=0.4)]),
    )
    before, state = repr(model), model.state_dict()
    assert gbrun.cpu.dropout.fuse_dropout(model) is model
    assert type(model[0]) is fused.Dropout and model[0].p == 0.2
    assert type(model[1]) is nn.Dropout2d
    assert type(model[2]) is nn.AlphaDropout
    assert type(model[3][0].feat_drop) is fused.Dropout
    assert model[3][0].feat_drop.p == 0.4
    assert repr(model) == before
    assert model.state_dict().keys() == state.keys()


def relu_dropout(p):
    return gbrun.cpu.dropout.fuse_dropout(nn.Sequential(
        nn.Sequential(nn.ReLU(), nn.Dropout(p))))[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_then_dropout_in_one_pass_equals_the_two_one_after_the_other(
        dtype):
    """The same mask as the kernel's dropout after torch's ReLU, forward
    and backward, to the bit."""
    p = 0.4
    x = torch.randn(300, 257).to(dtype)
    upstream = torch.randn(x.shape).to(dtype)
    outputs, grads = [], []
    for layer in (relu_dropout(p), nn.Sequential(nn.ReLU(), dropout(p))):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(0)
        y = layer(leaf)
        y.backward(upstream)
        outputs.append(y)
        grads.append(leaf.grad)
    assert isinstance(relu_dropout(p), fused.ReLUDropout)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(grads[0], grads[1])
    # And what that is: ReLU's output times the mask; the gradient passes,
    # scaled, where an element is kept and positive.
    kept = outputs[0] != 0
    assert torch.equal(outputs[0][kept], F.relu(x)[kept] * scale(p, dtype))
    assert torch.equal(grads[0], torch.where(x > 0, upstream * scale(p, dtype),
                                             0).to(dtype) * kept)
    assert abs(kept.float().mean().item() - 0.5 * (1 - p)) < 0.02


@pytest.mark.parametrize("case", ["eval", "float64", "p=0"])
def test_what_the_kernel_does_not_handle_is_relu_then_torchs_dropout(case):
    p = 0.0 if case == "p=0" else 0.5
    layer = relu_dropout(p)
    dtype = torch.float64 if case == "float64" else torch.float32
    x = torch.randn(200, 300, dtype=dtype)
    if case == "eval":
        layer.eval()
    torch.manual_seed(0)
    expected = F.dropout(F.relu(x), p, case != "eval")
    torch.manual_seed(0)
    assert torch.equal(layer(x), expected)


def test_only_relu_then_dropout_alone_in_a_sequential_runs_as_one_pass():
    model = nn.Sequential(
        nn.Sequential(nn.ReLU(), nn.Dropout(0.3)),
        nn.Sequential(nn.ReLU(inplace=True), nn.Dropout(0.3)),
        nn.Sequential(nn.ReLU(), nn.Dropout(0.3), nn.Linear(4, 4)),
        nn.Sequential(nn.ELU(), nn.Dropout(0.3)),
    )
    model[3].eval()
    before, state = repr(model), model.state_dict()
    gbrun.cpu.dropout.fuse_dropout(model)
    assert type(model[0]) is fused.ReLUDropout and model[0][1].p == 0.3
    # Each replacement keeps its module's mode.
    assert model[0].training and not model[3][1].training
    # Elsewhere only the nn.Dropout is replaced.
    for sequential in model[1:]:
        assert type(sequential) is nn.Sequential
        assert type(sequential[1]) is fused.Dropout
    assert repr(model) == before
    assert model.state_dict().keys() == state.keys()
    # The example's model has the pair between its layers.
    example = gbrun.cpu.dropout.fuse_dropout(nc.create_model(10, 3))
    assert [type(m) for m in example.modules()].count(fused.ReLUDropout) == 1


def test_the_examples_model_trains_with_it_as_with_torchs(small_dataset):
    """Same data, same initial weights: one step moves every parameter, and
    the loss falls over a few steps with either dropout."""
    job = nc.load_job(*with_plan(nc.parse_args(["--dataset", small_dataset])))
    dataloader = gbrun.graphbolt.gb.DataLoader(
        gbrun.graphbolt.gb.ItemSampler(job.item_sets[0], batch_size=256)
        .sample_neighbor(job.dataset.graph, job.fanout)
        .fetch_feature(job.dataset.feature, node_feature_keys=nc.FEATURE_KEYS))
    batches = [batch for _, batch in zip(range(4), dataloader)]
    losses = {}
    for name in ("torch", "fused"):
        torch.manual_seed(0)
        model = nc.create_model(job.in_size, job.num_classes)
        if name == "fused":
            gbrun.cpu.dropout.fuse_dropout(model)
        start = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        losses[name] = []
        for batch in batches * 3:
            loss = F.cross_entropy(
                model(batch.blocks, nc.node_features(batch)), batch.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
        assert all(not torch.equal(a, b)
                   for a, b in zip(start, model.parameters()))
    for name, values in losses.items():
        assert values[-1] < 0.8 * values[0], (name, values)


def test_without_a_compiler_the_model_keeps_torchs_dropout(
        monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for compiler, words in [(str(tmp_path / "no-cc"), "no C compiler"),
                            ("false", "failed to compile")]:
        monkeypatch.setenv("CC", compiler)
        monkeypatch.setattr(fused, "_kernel", None)
        assert words in fused.kernel_problem()
        x = torch.randn(100, 100)
        torch.manual_seed(0)
        expected = F.dropout(x, 0.5, True)
        torch.manual_seed(0)
        assert torch.equal(dropout(0.5)(x), expected)
    assert not list((tmp_path / "gbrun").glob("*.so"))


def test_a_fresh_cache_builds_the_kernel_once(monkeypatch, tmp_path):
    monkeypatch.setenv("GBRUN_CACHE", str(tmp_path / "gbrun"))
    monkeypatch.setattr(fused, "_kernel", None)
    assert fused.kernel_problem() is None
    built = list((tmp_path / "gbrun").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    monkeypatch.setattr(fused, "_kernel", None)
    mtime = built[0].stat().st_mtime_ns
    assert fused.kernel_problem() is None
    assert built[0].stat().st_mtime_ns == mtime


def test_a_cache_that_is_not_private_is_a_notice_not_a_kernel(
        monkeypatch, tmp_path):
    # The kernel is a shared library loaded into every rank: from a cache
    # another user could write, it could be anyone's code.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    monkeypatch.setenv("GBRUN_CACHE", str(shared))
    monkeypatch.setattr(fused, "_kernel", None)
    problem = fused.kernel_problem()
    assert problem and "is writable by others (mode 0777)" in problem
    assert list(shared.iterdir()) == []


# A library a local user could plant where the kernel is looked for: its
# constructor, run at dlopen, leaves a marker; it has the kernel's two
# functions (doing nothing), so a loader that takes it goes on without error.
PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) fclose(marker);
}
void gbrun_dropout(void) {}
void gbrun_relu_dropout_backward(void) {}
"""
# Another user: exchanges the entries gbrun and evil of the directory it is
# handed (descriptor argv[1]) with renameat2(RENAME_EXCHANGE), in a loop
# until SIGTERM (argv[2] "loop"; 60 s at most), or once per byte read, when
# the test says the moment has come ("ask": the exchange that wins every
# race); then prints how many exchanges were done and refused.
SWAPPER = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
static volatile sig_atomic_t stop;
static void on_term(int sig) { stop = 1; }
int main(int argc, char **argv) {
    int fd = atoi(argv[1]), ask = strcmp(argv[2], "ask") == 0;
    long done = 0, refused = 0;
    char byte;
    signal(SIGTERM, on_term);
    alarm(60);
    puts("started");
    fflush(stdout);
    while (!stop && (!ask || read(0, &byte, 1) == 1)) {
        if (syscall(SYS_renameat2, fd, "gbrun", fd, "evil", 2) == 0) done++;
        else refused++;
        if (ask) { puts("exchanged"); fflush(stdout); }
    }
    printf("%ld %ld\n", done, refused);
    return 0;
}
"""
OTHER_UID = 12345


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The kernel built here (its file's name and bytes), the planted library
    (with its marker's path), one without the kernel's functions, and the
    swapper."""
    assert fused.kernel_problem() is None
    maps = open("/proc/self/maps").read()
    name = os.path.basename(next(line.split()[5] for line in maps.splitlines()
                                 if "/dropout-" in line))
    kernel = open(os.path.join(gbrun.cache.cache_dir(), name), "rb").read()
    where = tmp_path_factory.mktemp("planted")
    made = {"name": name, "kernel": kernel, "marker": where / "constructor-ran"}
    for output, source, flags in [
            ("planted.so", PLANTED, ["-shared", "-fPIC",
                                     f'-DMARKER="{made["marker"]}"']),
            ("other.so", "int gbrun_nothing;", ["-shared", "-fPIC"]),
            ("swapper", SWAPPER, [])]:
        (where / f"{output}.c").write_text(source)
        subprocess.run(["cc", *flags, "-o", where / output,
                        where / f"{output}.c"], check=True)
        made[output] = (where / output).read_bytes()
    made["swapper_path"] = where / "swapper"
    made["openmp"] = fused._openmp_runtime()  # 0.2 s: once
    return made


@pytest.fixture
def fresh(built, monkeypatch):
    """A kernel not loaded yet, its OpenMP runtime (part of the key) looked
    up once for all tests; no marker."""
    monkeypatch.setattr(fused, "_openmp_runtime", lambda: built["openmp"])
    monkeypatch.setattr(fused, "_kernel", None)
    if built["marker"].exists():
        built["marker"].unlink()
    return built


def plant(path, content, uid=None, mode=0o755):
    path.write_bytes(content)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)


@pytest.mark.parametrize("make, problem", [
    (lambda at, b: os.symlink(b["planted_path"], at), "is a symlink"),
    (lambda at, b: plant(at, b["planted.so"], uid=OTHER_UID),
     f"belongs to uid {OTHER_UID}, not to this user"),
    (lambda at, b: plant(at, b["planted.so"], mode=0o666),
     "is writable by others (mode 0666)"),
    (lambda at, b: at.mkdir(), "is not a regular file"),
    (lambda at, b: plant(at, b["other.so"]), "is not gbrun's dropout kernel"),
])
def test_a_kernel_file_that_is_not_this_users_own_build_is_a_notice(
        fresh, monkeypatch, tmp_path, make, problem):
    """Where the kernel's file is a symlink, not a regular file, another
    user's, writable by others, or a library without its functions: one
    line saying which and what to do, torch's dropout, and nothing planted
    run."""
    if "uid" in problem and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    planted = tmp_path / "elsewhere.so"
    plant(planted, fresh["planted.so"])
    root = tmp_path / "gbrun"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("GBRUN_CACHE", str(root))
    make(root / fresh["name"], {**fresh, "planted_path": planted})
    said = fused.kernel_problem()
    assert str(root / fresh["name"]) in said and problem in said
    assert "remove it" in said and "\n" not in said
    assert not fresh["marker"].exists()
    x = torch.randn(100, 100)
    torch.manual_seed(0)
    expected = F.dropout(x, 0.5, True)
    torch.manual_seed(0)
    assert torch.equal(dropout(0.5)(x), expected)


TRIES = 50


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("schedule", ["loop", "ask"])
@pytest.mark.parametrize("mode, exchanged", [(0o777, True), (0o1777, False)])
def test_another_user_swapping_the_cache_never_gets_a_library_loaded(
        fresh, monkeypatch, tmp_path, mode, exchanged, schedule):
    """XDG_CACHE_HOME in a directory anyone may write (0777), where another
    user exchanges gbrun/ (the cache, with the kernel) and evil/ (theirs,
    with their library under the kernel's name), in a loop (TRIES loads of
    the kernel) or right before each load (a few): their library never runs
    (the cache under that directory is passed over). Under a sticky one of
    root's (1777, as /tmp) the cache is used, and their exchanges are
    refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    ours, theirs = shared / "gbrun", shared / "evil"
    ours.mkdir(mode=0o700)
    plant(ours / fresh["name"], fresh["kernel"])
    theirs.mkdir(mode=0o700)
    plant(theirs / fresh["name"], fresh["planted.so"], uid=OTHER_UID)
    os.chown(theirs, OTHER_UID, -1)
    fallback = tmp_path / "tmp" / f"gbrun-{os.getuid()}"
    fallback.mkdir(parents=True, mode=0o700)
    plant(fallback / fresh["name"], fresh["kernel"])
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv("GBRUN_CACHE", raising=False)
    directory = os.open(shared, os.O_RDONLY | os.O_DIRECTORY)
    program = os.open(fresh["swapper_path"], os.O_RDONLY)
    swapper = subprocess.Popen(
        [f"/proc/self/fd/{program}", str(directory), schedule],
        user=OTHER_UID, pass_fds=(directory, program),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if schedule == "ask":  # between the checks and the load, every time
        load = ctypes.CDLL

        def exchange_then_load(*args, **kwargs):
            swapper.stdin.write("x")
            swapper.stdin.flush()
            assert swapper.stdout.readline() == "exchanged\n"
            return load(*args, **kwargs)

        monkeypatch.setattr(ctypes, "CDLL", exchange_then_load)
    try:
        assert swapper.stdout.readline() == "started\n"
        for attempt in range(TRIES if schedule == "loop" else 4):
            # Spelled anew each time: the loader reuses a library already
            # loaded under the same name.
            monkeypatch.setenv("XDG_CACHE_HOME", str(shared) + "/." * attempt)
            monkeypatch.setattr(fused, "_kernel", None)
            assert fused.kernel_problem() is None
            assert not fresh["marker"].exists(), f"ran at attempt {attempt}"
    finally:
        swapper.stdin.close()
        swapper.terminate()
        done, refused = map(int, swapper.stdout.read().split())
        swapper.wait(timeout=60)
        os.close(directory)
        os.close(program)
    assert (done > 0) is exchanged and done + refused > 0, (done, refused)


@pytest.mark.parametrize("mode, problem, fused_dropout, notice", [
    ("cpu-cpu", None, True, False),
    ("cpu-cpu", "no C compiler 'cc' (set CC)", False, True),
    ("cpu-cuda", None, False, False),  # CUDA has torch's fused dropout
])
def test_the_plan_fuses_dropout_on_cpu_ranks_that_can_build_it(
        mode, problem, fused_dropout, notice):
    cuda = mode != "cpu-cpu"
    machine = planning.Machine(cuda, cuda, 2 if cuda else 0, 2,
                             dropout_problem=problem)
    args = nc.parse_args(["--mode", mode, "--gpu", "0"])
    plan = planning.plan_run(args, args.gpu, args.num_workers, {}, machine)
    assert plan.fused_dropout is fused_dropout
    lines = [n for n in plan.notices if n.startswith("--fused-dropout")]
    assert lines == ([f"--fused-dropout: {problem}; the model keeps torch's "
                      "dropout."] if notice else [])
    off = nc.parse_args(["--mode", mode, "--gpu", "0", "--no-fused-dropout"])
    assert planning.plan_run(off, off.gpu, off.num_workers, {}, machine).fused_dropout is False


# A fresh interpreter plans a launch as the example does, then says whether
# it loaded the kernel (a dropout-*.so mapped) and whether it asked for it.
PLANS_A_LAUNCH = """
import sys
import gbrun.cpu.dropout, gbrun.launch
import node_classification as nc

asked = []
problem = gbrun.cpu.dropout.kernel_problem
gbrun.cpu.dropout.kernel_problem = lambda: asked.append(1) or problem()
args = nc.parse_args(sys.argv[1:])
machine = gbrun.planning.detect_machine(args.precision)
if args.mode != "cpu-cpu":  # a GPU machine with DGL's CUDA build
    import dataclasses
    machine = dataclasses.replace(machine, cuda=True, dgl_cuda=True,
                                  num_gpus=1)
plan = gbrun.planning.plan_run(args, args.gpu, args.num_workers, {}, machine)
maps = open("/proc/self/maps").read()
print(plan.fused_dropout, bool(asked), "/dropout-" in maps)
"""


@pytest.mark.slow
@pytest.mark.parametrize("argv, fused", [
    (["--mode", "cpu-cpu"], "True True True"),
    (["--mode", "cpu-cpu", "--no-fused-dropout"], "False False False"),
    (["--mode", "pinned-cuda"], "False False False"),
])
def test_the_kernel_is_built_or_loaded_only_where_the_plan_uses_it(
        argv, fused):
    planned = subprocess.run(
        [sys.executable, "-c", PLANS_A_LAUNCH, "--gpu", "0", *argv],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert planned.stdout.split("\n")[-2] == fused
