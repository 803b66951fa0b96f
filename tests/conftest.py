"""The tests' fixtures: synthetic datasets made once per session by
scripts/make_synthetic_dataset.py, the seeded reference run several tests
compare with, stand-ins for a machine without GPUs or a spawn that must
not happen, and the simulated machines' dataset and partitions. Helpers
live in helpers.py, the process hygiene every test gets in
process_hygiene.py (loaded here as a plugin)."""
import os

import pytest

pytest.register_assert_rewrite("helpers")
from helpers import (  # noqa: E402
    NO_GPU, NUM_CLASSES, REFERENCE, SCRIPTS, make_synthetic,
    missing_prerequisite, partition, run_example, run_script,
)

pytest_plugins = ["process_hygiene"]


@pytest.fixture(scope="session", autouse=True)
def gbrun_cache(tmp_path_factory):
    """One gbrun cache (preprocessed datasets, the dropout kernel) for the
    session (each xdist worker's) and every process it starts, never the
    user's: each session starts from none, as a clean clone's CI does."""
    path = tmp_path_factory.mktemp("gbrun-cache")
    os.environ["GBRUN_CACHE"] = str(path)
    yield path
    del os.environ["GBRUN_CACHE"]


@pytest.fixture(scope="session", autouse=True)
def passive_openmp():
    """Idle OpenMP threads of every process the tests start wait asleep,
    not spinning: two test files share 2 cores, where a spinning thread
    takes the time another process needs (a two-thread run's CPU time
    halved); no result changes."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    yield
    del os.environ["OMP_WAIT_POLICY"]


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """make(name, *args) -> path of a synthetic dataset, made once per name."""
    made = {}

    def make(name, *args):
        if name not in made:
            import gbrun.data.datasets

            out = tmp_path_factory.mktemp("data") / name
            made[name] = make_synthetic(out, *args)
            # Preprocessed into the cache on its first load: done here once,
            # so that the tests' runs only read it.
            gbrun.data.datasets.load_dataset(made[name])
        return made[name]

    return make


@pytest.fixture(scope="session")
def hetero_dataset(synthetic):
    """Users (labelled) and the items they buy (make_synthetic_dataset.py
    --hetero): 3,000 users, 1,500 items, 5 classes; 60 validation users, so
    that with batch 64 rank 1 of 2 scores none."""
    return synthetic("hetero", "--hetero", "--num-nodes", 3000, "--feat-dim",
                     16, "--num-classes", 5, "--split", "0.8,0.02,0.18")


@pytest.fixture(scope="session")
def small_dataset(synthetic):
    # 3,000 nodes with 10 classes: big enough to learn, small enough that a
    # two-rank run takes seconds.
    return synthetic(
        "small", "--num-nodes", 3000, "--feat-dim", 32, "--num-classes", 10
    )


@pytest.fixture(scope="session")
def link_dataset(synthetic):
    """2,000 nodes, 10 classes, 80% of edges within a class, with a link
    task: 8,959 train pairs, 489 validation and 489 test pairs with 50
    negatives each (link_prediction.py and its edits)."""
    return synthetic("links", "--num-nodes", 2000, "--avg-degree", 5,
                     "--feat-dim", 32, "--link-negatives", 50)


@pytest.fixture(scope="session")
def multi_label_dataset(tmp_path_factory):
    """3,000 nodes with multi-hot labels of 5 classes (a node has one to
    three), written by the converter's writer, with a second node feature
    "degree"; features and edges carry each node's main class."""
    import numpy as np

    from gbrun.data import inputs, ondisk

    rng = np.random.default_rng(0)
    num_nodes, num_classes = 3000, 5
    main = rng.integers(0, num_classes, num_nodes)
    labels = np.eye(num_classes, dtype=np.int64)[main]
    labels |= (rng.random((num_nodes, num_classes)) < 0.2).astype(np.int64)
    features = (2 * labels + rng.normal(0, 1, (num_nodes, num_classes))
                ).astype(np.float32)
    # Edges mostly between nodes of one main class.
    dst = rng.integers(0, num_nodes, 30000)
    same = np.flatnonzero(rng.random(30000) < 0.8)
    by_class = [np.flatnonzero(main == c) for c in range(num_classes)]
    src = rng.integers(0, num_nodes, 30000)
    src[same] = [rng.choice(by_class[main[d]]) for d in dst[same]]
    degree = np.bincount(dst, minlength=num_nodes).astype(np.float32)[:, None]
    train, val, test = inputs.split_nodes(num_nodes, (0.6, 0.2, 0.2), seed=1)
    out = str(tmp_path_factory.mktemp("data") / "multi_label")
    ondisk.write_ondisk_dataset(
        out, np.stack([src, dst]), features, labels, train, val, test,
        extra_features={"degree": np.log1p(degree)})
    import gbrun.data.datasets

    gbrun.data.datasets.load_dataset(out)  # preprocessed once, here
    return out


@pytest.fixture(scope="session")
def reference_run(small_dataset, tmp_path_factory):
    """(CompletedProcess, directory with ckpt/, logs/ and predictions.npy)
    of REFERENCE on the small dataset, with --predict, run once per
    session."""
    out = tmp_path_factory.mktemp("reference")
    result = run_example(
        [*REFERENCE, "--dataset", small_dataset,
         "--checkpoint-dir", out / "ckpt", "--log-dir", out / "logs",
         "--predict", out / "predictions.npy"],
        env=NO_GPU,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, out


@pytest.fixture
def no_cuda(monkeypatch):
    """This test process sees no GPU, whatever the machine has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def nothing_spawned(monkeypatch):
    """For tests of refused input: spawning a rank fails the test (refusals
    come before any process is started)."""
    import gbrun.launch

    def start(*args, **kwargs):
        pytest.fail("ranks were started for input that is refused")

    # gbrun.launch starts the ranks with start_processes (mp.spawn is it
    # with the spawn method).
    monkeypatch.setattr(gbrun.launch.mp, "start_processes", start)
    monkeypatch.setattr(gbrun.launch.mp, "spawn", start)


# --- Simulated machines (tests/e2e/test_distributed_*.py and
# test_tools_launch_failures.py): made once per test file.


@pytest.fixture
def namespaces():
    """Skip (or, under CI=true, fail) when namespaces cannot be made."""
    reason = missing_prerequisite()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    made = run_script(
        os.path.join(SCRIPTS, "make_synthetic_dataset.py"),
        [root / "synthetic", "--num-nodes", 2000, "--avg-degree", 10,
         "--feat-dim", 16, "--num-classes", NUM_CLASSES, "--seed", 0],
    )
    assert made.returncode == 0, made.stderr
    return str(root / "synthetic")


@pytest.fixture(scope="module")
def partitions(dataset, tmp_path_factory):
    """The 2,000-node dataset in 2 METIS partitions (both formats)."""
    return partition(dataset, tmp_path_factory.mktemp("metis") / "parts",
                     "--balance-train", "--balance-edges", "--use-graphbolt")
