"""distributed/dist_node_classification.py trained on simulated machines,
on partition_graph.py's METIS partitions (2 parts of a 2,000-node synthetic
dataset, conftest.py's `partitions`, made once for this file), with
distributed/launch_local.py running 2 simulated machines (a network and a
mount namespace each) on this host, training the example or an edited copy
of it outside the checkout. The checks: the partitions hold the dataset;
bad input is refused before anything starts; the example's edits and
output lines reach the distributed run; SIGTERM to the launcher stops every
trainer at one step with a checkpoint and --resume trains every seed of
the stopped epoch exactly once; a killed server, signals and --timeout end
the job promptly; and nothing is left behind (processes, network
namespaces, temporary files), checked by watching each run from outside
(helpers.Watch) rather than through the marker the launcher sets on its
processes. Runs that need namespaces are skipped without root and
iproute2, except when CI=true, where a missing prerequisite fails the test
instead. The options docs/distributed.md names (samplers, 2 servers a
machine, random partitions, GraphBolt on the servers) are
test_distributed_options.py's; docs/customising.md's other edits, each on
partitions of its own, test_distributed_edits.py's; the failures of a job
started as DGL's tools/launch.py starts one test_tools_launch_failures.py's."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (
    JOB_TIMEOUT_S, LAUNCHER, NUM_CLASSES, REPO, SCRIPT,
    TRAIN_ARGS, edited_copy, launch, missing_prerequisite, run_in_process,
    run_script, start_launcher, wait_for_output,
)
from helpers import TRAINER_EPOCH_LINE as EPOCH_LINE
from helpers import TRAINER_TEST_LINE as TEST_LINE
from helpers import finish_launcher as finish


def wait_for_job_processes(proc, num_machines, timeout):
    """Wait until every server and trainer of the job has been started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (len(child_pids(proc.pid, "DGL_ROLE", "server")) == num_machines
                and len(child_pids(proc.pid, "DGL_ROLE", "client")) == num_machines):
            return
        time.sleep(0.2)
    pytest.fail(f"the job's servers and trainers were not all started within {timeout} s")


def child_pids(parent, env_key, env_value):
    """Children of parent whose environment has env_key=env_value."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"{env_key}={env_value}".encode() in env:
            found.append(int(pid))
    return found


def dumped_passes(dump_dir, rank):
    """{pass name: (node order, seeds handed out)} that trainer `rank` saved
    with --dump-seeds."""
    return {name: (order, torch.cat(seeds) if seeds else torch.empty(0))
            for name, order, seeds in torch.load(
                os.path.join(dump_dir, f"rank{rank}.pt"))}


def original_ids(part_out, ids):
    """Dataset ids of partitioned node ids, sorted."""
    orig_nids = torch.load(os.path.join(part_out, "orig_nids.pt"))
    return orig_nids[torch.as_tensor(ids).long()].sort().values


def dataset_ids(dataset, split):
    """Sorted node ids of one split, read the way the example reads them."""
    import dgl.graphbolt as gb

    task = gb.OnDiskDataset(dataset).load().tasks[0]
    item_set = {"train": task.train_set, "val": task.validation_set,
                "test": task.test_set}[split]
    return item_set[:][0].long().sort().values

# --- Partitioning --------------------------------------------------------------


@pytest.mark.slow
def test_partition_outputs(partitions):
    with open(partitions["part_config"]) as f:
        config = json.load(f)
    assert config["num_parts"] == 2
    assert "part_graph_graphbolt" in config["part-1"]
    with open(os.path.join(partitions["out"], "dataset_info.json")) as f:
        info = json.load(f)
    assert (info["num_classes"], info["features"], info["label_key"],
            info["labels"], info["num_train"]) == (
        NUM_CLASSES, {"feat": 16}, "label", "class", 1200)
    orig_nids = torch.load(os.path.join(partitions["out"], "orig_nids.pt"))
    assert torch.equal(orig_nids.sort().values, torch.arange(2000))
    # Each partition holds its own nodes' features (added after METIS ran
    # without them) and labels, in its partitioned order.
    import dgl

    import gbrun.data.datasets
    import gbrun.data.splits
    import gbrun.dgl_engine.files

    dataset = gbrun.data.datasets.load_dataset(partitions["dataset"])
    feat = dataset.feature.read("node", None, "feat")
    label = dataset.feature.read("node", None, "label").reshape(-1)
    train = dataset.tasks[0].train_set[:][0]
    for part, (start, end) in enumerate(config["node_map"]["_N"]):
        data = dgl.data.utils.load_tensors(os.path.join(
            partitions["out"], config[f"part-{part}"]["node_feats"]))
        ids = orig_nids[start:end]
        assert torch.equal(data["_N/feat"], feat[ids])
        in_train = torch.isin(ids, train)
        assert torch.equal(data["_N/label"][in_train], label[ids][in_train])
        assert torch.equal(data["_N/train_mask"].bool(), in_train)
    assert not [name for name in os.listdir(partitions["out"])
                if name.startswith(".features")]
    # The trainer's Job holds the dataset's item sets, renumbered as the
    # partitions number the nodes.
    item_sets = gbrun.dgl_engine.files.load_item_sets(partitions["out"])
    for split, item_set in zip(gbrun.data.splits.ATTRIBUTES, item_sets):
        seeds, labels = item_set[:]
        expected_seeds, expected_labels = getattr(dataset.tasks[0], split)[:]
        assert torch.equal(orig_nids[seeds], expected_seeds)
        assert torch.equal(labels, expected_labels)


@pytest.mark.parametrize("make_bad, message", [
    (lambda tmp: tmp / "absent", "is neither a builtin dataset"),
    (lambda tmp: tmp, "is a directory without metadata.yaml"),
], ids=["missing directory", "no metadata.yaml"])
def test_partition_rejects_bad_dataset(tmp_path, monkeypatch, capsys,
                                      make_bad, message):
    import partition_graph

    bad = make_bad(tmp_path)
    code, lines = run_in_process(
        monkeypatch, capsys, partition_graph.main,
        ["partition_graph.py", "--dataset", bad, "--num-parts", 2,
         "--out", tmp_path / "out"],
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("partition_graph.py: error: ")
    assert message in lines[0] and str(bad) in lines[0]


# --- Bad input: caught before anything starts ------------------------------------


def test_launcher_rejects_missing_part_config(tmp_path):
    done = run_script(LAUNCHER, ["--part-config", tmp_path / "none.json",
                                 "--num-machines", 2, "--", "--epochs", 1])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"launch_local.py: error: --part-config {tmp_path / 'none.json'} "
        "does not exist")


@pytest.mark.slow
def test_launcher_rejects_mismatched_part_config(partitions):
    done = run_script(LAUNCHER, ["--part-config", partitions["part_config"],
                                 "--num-machines", 3, "--", "--epochs", 1])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"launch_local.py: error: --part-config {partitions['part_config']} "
        "has 2 partitions "
        f"but --num-machines is 3"
    )


def test_launcher_names_missing_tools(tmp_path):
    # A PATH with python but without ip, unshare, nsenter and setpriv.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    config = tmp_path / "parts.json"
    config.write_text('{"num_parts": 2}')
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    done = subprocess.run(
        [sys.executable, LAUNCHER, "--part-config", str(config),
         "--num-machines", "2", "--", "--epochs", "1"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env=dict(os.environ, PATH=str(bin_dir), TMPDIR=str(tmp_dir)),
    )
    if os.geteuid() == 0:
        reason = ("missing ip, unshare, nsenter, setpriv "
                  "(iproute2, util-linux) on PATH")
    else:  # checked first
        reason = "root is needed to create network and mount namespaces"
    assert (done.returncode, done.stderr.splitlines()) == (
        2, [f"launch_local.py: error: {reason}"]), done.stderr
    assert os.listdir(tmp_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("args, env, message", [
    (["--ip-config", "THREE"], {},
     "--part-config has 2 partitions but --ip-config {three} lists 3 machines"),
    (["--gpu", "0,1"], {},
     "--gpu does not apply to the distributed trainer: each trainer takes "
     "the GPU of its LOCAL_RANK"),
    (["--dataset", "data/x"], {},
     "--dataset does not apply to the distributed trainer: the partitions "
     "are the data (--part-config)"),
    (["--mode", "pinned-cuda"], {},
     "--mode pinned-cuda needs CUDA"),
    (["--num-workers", "1"], {},
     "--num-workers 1 differs from the launcher's sampler count "
     "DGL_NUM_SAMPLER=0"),
    (["--fanout", "5,5"], {},
     "--fanout 5,5: 2 values, but the model has 3 layers"),
    (["--batch-size", "700"], {"WORLD_SIZE": "2"},
     "use --batch-size 600 or less"),
    (["--epochs", "0"], {}, "--epochs: 0 is too small (at least 1)"),
    (["--resume", "--checkpoint-dir", "NOWHERE"], {},
     "--resume: there is no checkpoint"),
], ids=["ip config", "gpu", "dataset", "mode", "samplers", "fanout",
        "batch size", "epochs", "no checkpoint"])
def test_trainer_refuses_bad_input_in_one_line(partitions, tmp_path,
                                               monkeypatch, capsys, args, env,
                                               message):
    # What a user of DGL's tools/launch.py sees: the same line from every
    # process that would connect (servers stay silent), before any does.
    import dist_node_classification as trainer

    three = tmp_path / "ip_config.txt"
    three.write_text("10.0.0.1\n10.0.0.2\n10.0.0.3\n")
    two = tmp_path / "ip2.txt"
    two.write_text("10.0.0.1\n10.0.0.2\n")
    args = [str(three) if a == "THREE" else
            str(tmp_path / "nowhere") if a == "NOWHERE" else a for a in args]
    for key, value in {"DGL_NUM_SAMPLER": "0", **env}.items():
        monkeypatch.setenv(key, value)
    # Its checks only (main would go on to start DGL's services).
    code, lines = run_in_process(
        monkeypatch, capsys,
        lambda: trainer.main(["--part-config", partitions["part_config"],
                              "--ip-config", str(two), "--batch-size", "128",
                              *args]),
        ["dist_node_classification.py"])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dist_node_classification.py: error: ")
    assert message.format(three=three) in lines[0], lines[0]


@pytest.mark.slow
def test_partitions_of_other_keys_are_refused(partitions, tmp_path,
                                              monkeypatch, capsys):
    import dist_node_classification as trainer

    copy = edited_copy(tmp_path, "two_features")  # reads feat and degree
    ip_config = tmp_path / "ip2.txt"
    ip_config.write_text("10.0.0.1\n10.0.0.2\n")
    # Servers refuse too; all but server 0 silently.
    monkeypatch.setenv("DGL_ROLE", "server")
    monkeypatch.setenv("DGL_SERVER_ID", "1")
    code, lines = run_in_process(
        monkeypatch, capsys,
        lambda: trainer.main(["--example", copy, "--part-config",
                              partitions["part_config"], "--ip-config",
                              str(ip_config)]), ["x"])
    assert (code, lines) == (2, [])
    monkeypatch.setenv("DGL_SERVER_ID", "0")
    code, lines = run_in_process(
        monkeypatch, capsys,
        lambda: trainer.main(["--example", copy, "--part-config",
                              partitions["part_config"], "--ip-config",
                              str(ip_config)]), ["x"])
    assert code == 2 and len(lines) == 1 and "the partitions hold" in lines[0]
    monkeypatch.delenv("DGL_ROLE")
    code, lines = run_in_process(
        monkeypatch, capsys,
        lambda: trainer.main(["--example", copy, "--part-config",
                              partitions["part_config"], "--ip-config",
                              str(ip_config)]), ["x"])
    assert code == 2 and len(lines) == 1
    assert ("the partitions hold the features ['feat'], labels 'label' "
            "(class); the example reads ['feat', 'degree']") in lines[0]


@pytest.mark.slow
def test_a_graph_server_builds_the_optimizer_only_to_check_a_resume(
        partitions, tmp_path, monkeypatch):
    # A server saves no checkpoint: the resume key, whose optimizer imports
    # torch._dynamo (about 1 CPU-s), serves it only to refuse a --resume as
    # the trainers do.
    import dist_node_classification as trainer

    ip_config = tmp_path / "ip2.txt"
    ip_config.write_text("10.0.0.1\n10.0.0.2\n")
    for key, value in {"DGL_ROLE": "server", "DGL_SERVER_ID": "0",
                       "DGL_NUM_CLIENT": "2", "DGL_NUM_SAMPLER": "0"}.items():
        monkeypatch.setenv(key, value)
    built = []

    def load_job(*extra):
        args, example = trainer.parse_args([
            "--part-config", partitions["part_config"], "--ip-config",
            str(ip_config), "--batch-size", "128", "--checkpoint-dir",
            str(tmp_path / "ckpt"), *extra])
        create = example.create_optimizer
        monkeypatch.setattr(example, "create_optimizer", lambda *a: (
            built.append(extra), create(*a))[1])
        return trainer.load_job(args, example, trainer.plan_devices(args))

    assert load_job().start.trains and built == []
    with pytest.raises(trainer.cli.UsageError,
                       match="--resume: there is no checkpoint"):
        load_job("--resume")
    assert built == [("--resume",)]


@pytest.mark.slow
def test_a_copy_whose_graphbolt_pipeline_is_edited_is_refused(
        partitions, tmp_path, monkeypatch, capsys):
    # The distributed engine loads with DGL's DistNodeDataLoader: an edit of
    # the GraphBolt pipeline would silently not run there.
    import dist_node_classification as trainer

    copy = tmp_path / "node_classification.py"
    text = open(SCRIPT).read()
    old = "    datapipe = datapipe.sample_neighbor(\n"
    assert text.count(old) == 1
    copy.write_text(text.replace(old, "    datapipe = datapipe.sample_layer_neighbor(\n"))
    ip_config = tmp_path / "ip2.txt"
    ip_config.write_text("10.0.0.1\n10.0.0.2\n")
    monkeypatch.setenv("DGL_NUM_SAMPLER", "0")
    code, lines = run_in_process(
        monkeypatch, capsys,
        lambda: trainer.main(["--example", str(copy), "--part-config",
                              partitions["part_config"], "--ip-config",
                              str(ip_config)]), ["x"])
    assert code == 2 and len(lines) == 1, lines
    assert (f"--example {copy}: its create_dataloader() edits the GraphBolt "
            "pipeline, which DGL's distributed engine does not run") in lines[0]
    # The branch for the distributed engine, edited, is the copy's to make.
    copy.write_text(text.replace("args.batch_size, fanout,\n",
                                 "args.batch_size // 2, fanout,\n"))
    assert trainer.graphbolt_pipeline(
        trainer.cli.load_example(str(copy)).create_dataloader) == (
        trainer.graphbolt_pipeline(trainer.cli.load_example(
            SCRIPT).create_dataloader))


def test_the_trainers_options_table_is_its_help(capsys):
    # docs/distributed.md's table of the trainer's own options names each
    # option --help shows, and nothing else.
    import dist_node_classification as trainer

    with pytest.raises(SystemExit) as exited:
        trainer.parse_args(["--help"])
    assert exited.value.code == 0
    ours = capsys.readouterr().out.split("\nThe example's options (")[0]
    shown = {name for names in re.findall(r"^  (-[\w-]+)(?:, (--[\w-]+))?",
                                          ours, re.M)
             for name in names if name}
    with open(os.path.join(REPO, "docs", "distributed.md")) as f:
        doc = f.read()
    table = doc.split("`dist_node_classification.py` takes its own options")[1]
    table = table.split("\n\n")[1]
    documented = set(re.findall(r"`(--?[a-z-]+)`", table))
    assert documented == shown, (documented, shown)


# --- The example, stopped and resumed on 2 machines x 2 trainers -----------------


# 300 training nodes a trainer: 9 full batches of 32 an epoch.
STOPPED_ARGS = [*TRAIN_ARGS, "--batch-size", 32, "--epochs", 2]


# Appended to the stopped run's copy of the example: each batch's features
# take 0.1 s more, so that epoch 1 lasts about a second on any machine and a
# SIGTERM sent a few batches into it lands there (at 22 batches a second
# the job could end first).
SLOW_BATCHES = """
import time as _time

_node_features = node_features


def node_features(data):
    _time.sleep(0.1)
    return _node_features(data)
"""


@pytest.fixture(scope="module")
def stopped_and_resumed(partitions, dataset, tmp_path_factory):
    """A copy of the example with docs/customising.md's cosine, macro-F1,
    gradient accumulation and early stopping edits, trained on 2 machines x
    2 trainers, SIGTERM to the launcher in epoch 1, then resumed to the
    end. Early stopping, made to stop after epoch 1 (of 3), ends training
    on every trainer at once. Returns both runs' (code, stdout, stderr),
    their --dump-seeds directories and the output directory."""
    if missing_prerequisite() is not None:
        return None
    out = tmp_path_factory.mktemp("stopped")
    example = edited_copy(out, "cosine", "macro_f1", "accumulation",
                          "early_stopping")
    with open(example) as f:
        text = f.read()
    for old, new in (("PATIENCE = 3", "PATIENCE = 1"),
                     ("MIN_DELTA = 0.0", "MIN_DELTA = 1.0")):
        assert text.count(old) == 1
        text = text.replace(old, new)
    # An edit of run(), visible in its output: the trainers run the copy's,
    # and it reads the training labels from the Job, as on one machine
    # (class weights would).
    text = text.replace('print("Training...")', (
        'print("Training, edited run()...", "train labels per class",\n'
        '              torch.bincount(job.item_sets[0][:][1],\n'
        '                             minlength=job.num_classes).tolist())'))
    with open(example, "w") as f:
        f.write(text + SLOW_BATCHES)
    common = [*STOPPED_ARGS, "--epochs", 3, "--example", example,
              "--checkpoint-dir",
              out / "ckpt", "--log-dir", out / "logs"]
    stopped_dir = out / "stopped"
    stopped_dir.mkdir()
    proc = start_launcher(partitions["part_config"], 2,
                          [*common, "--dump-seeds", out / "seeds1"],
                          stopped_dir, JOB_TIMEOUT_S,
                          ["--trainers-per-machine", 2])
    # A few batches into epoch 1, as trainer 0's progress bar shows.
    wait_for_output(stopped_dir, r"train 1: .*\| [1-4]/9 ", proc, timeout=90,
                    stream="stderr.txt")
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, stopped_dir, timeout=60)
    resumed_dir = out / "resumed"
    resumed_dir.mkdir()
    resumed = launch(partitions["part_config"],
                     [*common, "--resume", "--dump-seeds", out / "seeds2"],
                     resumed_dir, launcher_args=["--trainers-per-machine", 2])
    return {"stopped": stopped, "resumed": resumed, "out": out,
            "dataset": dataset}


@pytest.mark.slow
def test_the_examples_edits_train_on_two_machines(namespaces,
                                                  stopped_and_resumed):
    code, out, err = stopped_and_resumed["resumed"]
    assert code == 0, err[-3000:]
    assert "Training with 4 trainers." in out
    assert "Training, edited run()..." in out
    # The Job's training item set is the dataset's, node for node.
    import dgl.graphbolt as gb

    labels = gb.OnDiskDataset(stopped_and_resumed["dataset"]).load().tasks[
        0].train_set[:][1]
    counts = torch.bincount(labels, minlength=NUM_CLASSES).tolist()
    assert f"train labels per class {counts}" in out, out
    # The edited example's metric, in its full epoch line; the cosine
    # schedule's state came back from the checkpoint.
    epochs = EPOCH_LINE.findall(out)
    assert [e[0] for e in epochs] == ["00001"], out
    assert "Early stopping before epoch 2." in out
    assert {e[1] for e in epochs} == {"Macro-F1"}
    assert TEST_LINE.search(out).group(1) == "Macro-F1"
    assert float(TEST_LINE.search(out).group(2)) > 2 / NUM_CLASSES
    ckpt = stopped_and_resumed["out"] / "ckpt"
    checkpoint = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    assert checkpoint["scheduler"]["last_epoch"] == 2
    records = [json.loads(line) for line in open(
        stopped_and_resumed["out"] / "logs" / "metrics.jsonl")]
    assert [r.get("epoch") for r in records] == [0, 1, None]
    assert records[-1]["metric"] == "Macro-F1" and records[-1]["ranks"] == 4


@pytest.mark.slow
def test_sigterm_stops_every_trainer_at_one_step_with_a_checkpoint(
        namespaces, stopped_and_resumed, no_cuda):
    code, out, err = stopped_and_resumed["stopped"]
    assert code == 128 + signal.SIGTERM, err[-3000:]
    stop = re.search(r"^Stopped by SIGTERM in epoch 1 after step (\d+): "
                     r"checkpoint saved in (\S+); run the same command with "
                     r"--resume to continue\.$", out, re.M)
    assert stop, out[-2000:]
    # Gradients of 2 batches make a step: a stop waits for one.
    assert int(stop.group(1)) % 2 == 0, out[-2000:]
    assert "Resuming from" in stopped_and_resumed["resumed"][1]
    # model.pt loads on a machine without a GPU (no_cuda: this process
    # sees none; a process of its own would only import torch again).
    model = torch.load(stopped_and_resumed["out"] / "ckpt" / "model.pt",
                       map_location="cpu", weights_only=True)
    assert len(model) > 0


@pytest.mark.slow
def test_a_resumed_epoch_trains_every_seed_once(namespaces,
                                                stopped_and_resumed,
                                                partitions):
    out = stopped_and_resumed["out"]
    step = int(re.search(r"after step (\d+)",
                         stopped_and_resumed["stopped"][1]).group(1))
    trained, batch = [], 32
    for rank in range(4):
        before = dumped_passes(out / "seeds1", rank)
        after = dumped_passes(out / "seeds2", rank)
        assert ("train 0" in before, "train 1" in before) == (True, True)
        assert sorted(name for name in after if name.startswith("train")
                      ) == ["train 1"]
        order, handed_out = before["train 1"]
        again, rest = after["train 1"]
        # The same order after the restart; the stopped run trained its
        # first `step` batches, the resumed one all the others.
        assert torch.equal(order, again) and len(order) == 9 * batch
        assert torch.equal(handed_out, order[: step * batch])
        assert torch.equal(rest, order[step * batch:])
        assert torch.equal(before["train 0"][1], before["train 0"][0])
        trained.append(order)
    # The trainers' shares are disjoint training nodes, and every one of
    # them trained as many full batches.
    trained = torch.cat(trained)
    assert len(trained.unique()) == len(trained) == 4 * 9 * batch
    train = dataset_ids(partitions["dataset"], "train")
    assert torch.isin(original_ids(partitions["out"], trained), train).all()
    for name, split in (("validate 1", "val"), ("test", "test")):
        seen = torch.cat([dumped_passes(out / "seeds2", r)[name][1]
                          for r in range(4)])
        assert torch.equal(original_ids(partitions["out"], seen),
                           dataset_ids(partitions["dataset"], split))


# --- Failures end the job, promptly and cleanly ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill a server", "SIGINT at start-up",
                                 "SIGHUP"])
def test_stopped_or_killed_jobs_end_and_clean_up(namespaces, partitions,
                                                 tmp_path, how):
    args = [*TRAIN_ARGS, "--epochs", 1000, "--checkpoint-dir",
            tmp_path / "ckpt"]
    if how == "kill a server":
        # The run is shared: it trains docs/customising.md's GAT edit (two
        # layers, so two fanout values).
        args += ["--example", edited_copy(tmp_path, "gat"), "--fanout", "5,5"]
    proc = start_launcher(partitions["part_config"], 2, args, tmp_path,
                          JOB_TIMEOUT_S)
    if how == "kill a server":
        # In the middle of training, once the GAT has trained an epoch.
        wait_for_output(tmp_path, r"^Epoch 00000 .* \| Accuracy 0\.\d{4} ",
                        proc, timeout=90)
        model = torch.load(tmp_path / "ckpt" / "checkpoint.pt",
                           weights_only=True)["model"]
        assert "layers.1.attn_l" in model, sorted(model)
    else:
        # As soon as every process of the job is there, while it starts up
        # (a job is stopped the same way at any stage; this is quicker).
        wait_for_job_processes(proc, 2, timeout=60)
    if how == "kill a server":
        servers = child_pids(proc.pid, "DGL_ROLE", "server")
        assert len(servers) == 2, servers
        os.kill(servers[1], signal.SIGKILL)
    else:
        proc.send_signal(getattr(signal, how.split()[0]))
    started = time.monotonic()
    code, out, err = finish(proc, tmp_path, timeout=60)
    assert time.monotonic() - started < 40
    if how == "kill a server":
        # docs/distributed.md: a failed process makes the launcher exit 1.
        assert code == 1, err[-2000:]
        assert "error: machine 1 server 0 exited with code -9" in err
    elif how == "SIGHUP":
        # The launcher's handler ran (and cleaned up); had the signal killed
        # it, the code would be -signum.
        assert code == 128 + signal.SIGHUP
    else:
        # A stop request that came while the trainers started waits for
        # them: they stop at their first steps, with a checkpoint.
        assert code == 128 + signal.SIGINT, err[-2000:]
        assert re.search(r"^Stopped by SIGINT in epoch 0 after step \d+: "
                         "checkpoint saved", out, re.M), out[-2000:]
        assert (tmp_path / "ckpt" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_timeout_stops_the_job(namespaces, partitions, tmp_path):
    # Far longer than --timeout, which expires while the job starts up.
    timeout = 6
    started = time.monotonic()
    proc = start_launcher(partitions["part_config"], 2,
                          [*TRAIN_ARGS, "--epochs", 1000], tmp_path, timeout)
    code, _, err = finish(proc, tmp_path, timeout=timeout + 30)
    elapsed = time.monotonic() - started
    assert code == 1
    reason = "error: the job did not finish within --timeout; stopping it"
    assert [line for line in err.splitlines() if line.startswith("error:")] == [reason], err[-2000:]
    assert err.splitlines()[-1] == reason
    assert timeout <= elapsed < timeout + 15, elapsed
