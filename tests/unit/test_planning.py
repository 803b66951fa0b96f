"""plan_run decides devices, backend, world size, rendezvous and threads.
It takes torch's and DGL's CUDA availability as arguments, so every mode is
checked here without a GPU."""

import os

import pytest

from gbrun.cli import UsageError
from gbrun.graphbolt import INSTALL_CUDA_DGL
from gbrun.planning import Machine, plan_run
from node_classification import parse_args


def plan(argv, cuda=False, num_gpus=0, cores=2, env=None, dgl_cuda=None,
         gpu_bf16=True):
    # By default DGL can use CUDA exactly when torch can.
    dgl_cuda = cuda if dgl_cuda is None else dgl_cuda
    machine = Machine(cuda, dgl_cuda, num_gpus, cores, gpu_bf16)
    args = parse_args(argv)
    return plan_run(args, args.gpu, args.num_workers, env or {}, machine)


def test_auto_without_cuda_is_cpu_ranks_with_gloo_and_a_notice():
    p = plan(["--gpu=0,1"])
    assert p.mode == "cpu-cpu" and p.storage == "cpu"
    assert p.backend == "gloo"
    assert p.devices == ["cpu", "cpu"] and p.world_size == 2
    assert "cpu-cpu" in p.notices[0]


def test_auto_with_cuda_torch_and_cpu_dgl_is_cpu_ranks_with_install_advice():
    # PyPI's wheels on a GPU machine: torch has CUDA, DGL does not.
    p = plan(["--gpu=0,1"], cuda=True, num_gpus=2, dgl_cuda=False)
    assert p.mode == "cpu-cpu" and p.backend == "gloo"
    assert p.devices == ["cpu", "cpu"]
    assert "this DGL is a CPU-only build: using --mode cpu-cpu" in p.notices[0]
    assert INSTALL_CUDA_DGL in p.notices[0]


def test_auto_with_cuda_dgl_but_no_cuda_torch_is_cpu_ranks():
    p = plan(["--gpu=0,1"], cuda=False, dgl_cuda=True)
    assert p.mode == "cpu-cpu" and "CUDA is not available" in p.notices[0]


def test_cpu_ranks_see_no_gpu_and_gpu_ranks_see_theirs():
    cpu = plan(["--gpu=0,1"], cuda=True, num_gpus=2, dgl_cuda=False)
    lo = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
          "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    assert cpu.rank_env == {"OMP_NUM_THREADS": "1",
                            "CUDA_VISIBLE_DEVICES": "", **lo}
    gpu = plan(["--gpu=0,1"], cuda=True, num_gpus=2)
    assert gpu.rank_env == {"OMP_NUM_THREADS": "1", **lo}


def test_auto_with_cuda_is_pinned_cuda_with_nccl():
    p = plan(["--gpu=0,1"], cuda=True, num_gpus=2)
    assert p.mode == "pinned-cuda" and p.storage == "pinned"
    assert p.backend == "nccl"
    assert p.devices == ["cuda:0", "cuda:1"]
    assert p.notices == []


@pytest.mark.parametrize(
    "mode,storage", [("cpu-cuda", "cpu"), ("pinned-cuda", "pinned"),
                     ("cuda-cuda", "cuda")]
)
def test_cuda_modes_with_cuda(mode, storage):
    p = plan(["--gpu=1,3", "--mode", mode], cuda=True, num_gpus=4)
    assert (p.storage, p.backend) == (storage, "nccl")
    assert p.devices == ["cuda:1", "cuda:3"]


@pytest.mark.parametrize("mode", ["cpu-cuda", "pinned-cuda", "cuda-cuda"])
def test_cuda_modes_without_cuda_are_refused(mode):
    with pytest.raises(UsageError, match=f"--mode {mode} needs CUDA"):
        plan(["--mode", mode])
    with pytest.raises(UsageError, match=f"--mode {mode} needs CUDA"):
        plan(["--mode", mode], dgl_cuda=True)


@pytest.mark.parametrize("mode", ["cpu-cuda", "pinned-cuda", "cuda-cuda"])
def test_cuda_modes_with_a_cpu_only_dgl_are_refused_with_install_advice(mode):
    with pytest.raises(UsageError) as refused:
        plan(["--mode", mode], cuda=True, num_gpus=2, dgl_cuda=False)
    assert f"--mode {mode} needs CUDA, but this DGL is a CPU-only build" in (
        str(refused.value))
    assert INSTALL_CUDA_DGL in str(refused.value)


def test_cpu_cpu_with_cuda_present_still_uses_gloo_on_cpu():
    p = plan(["--gpu=0,1,2", "--mode", "cpu-cpu"], cuda=True, num_gpus=1)
    assert p.backend == "gloo" and p.devices == ["cpu"] * 3


def test_missing_gpu_id_is_refused():
    with pytest.raises(UsageError, match="GPU 2 does not exist"):
        plan(["--gpu=0,2"], cuda=True, num_gpus=2)


def test_gpu_cache_needs_pinned_features_on_a_cuda_device():
    with pytest.raises(UsageError, match="--gpu-cache-size 1000"):
        plan(["--gpu-cache-size", "1000"])
    p = plan(["--gpu-cache-size", "1000"], cuda=True, num_gpus=1)
    assert p.backend == "nccl" and p.storage == "pinned"
    # cpu-cuda fetches features before the ids reach the GPU; cuda-cuda has
    # the features on the GPU already: refused, never silently ignored.
    for mode in ("cpu-cuda", "cuda-cuda"):
        with pytest.raises(UsageError, match=f"but --mode is {mode}"):
            plan(["--gpu-cache-size", "1000", "--mode", mode], cuda=True,
                 num_gpus=1)


@pytest.mark.parametrize("mode", ["pinned-cuda", "cuda-cuda"])
def test_workers_are_refused_where_sampling_runs_on_the_gpu(mode):
    with pytest.raises(UsageError, match="--num-workers 2: with --mode"):
        plan(["--num-workers", "2", "--mode", mode], cuda=True, num_gpus=1)
    for ok in ("cpu-cuda", "cpu-cpu"):
        plan(["--num-workers", "2", "--mode", ok], cuda=True, num_gpus=1)


@pytest.mark.parametrize("gpu", ["a", "0,,1", "0,0", "-1"])
def test_bad_gpu_lists(gpu):
    with pytest.raises(UsageError, match="--gpu"):
        plan([f"--gpu={gpu}"])


@pytest.mark.parametrize(
    "cores,ranks,threads", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 4, 4)]
)
def test_threads_are_at_least_one(cores, ranks, threads):
    gpus = ",".join(map(str, range(ranks)))
    p = plan([f"--gpu={gpus}"], cores=cores)
    assert p.threads == threads
    # More CPU ranks than cores: one notice saying what it costs.
    shared = [n for n in p.notices if "take turns on the cores" in n]
    assert shared == ([f"{ranks} CPU processes on {cores} cores: they take "
                       "turns on the cores, one thread each, and each step "
                       f"trains {ranks} x --batch-size seeds (the batch size "
                       "is per process), so an epoch has fewer steps than "
                       f"with {cores} processes."]
                      if ranks > cores else [])


def test_spawned_ranks_meet_through_a_file_and_lo_not_a_port():
    # launch.spawn gives them a file:// store in a private directory; gloo
    # and NCCL connect them over lo. Under torchrun, its own rendezvous.
    p = plan([])
    assert p.launcher == "spawn" and p.init_method is None
    assert p.rank_env["GLOO_SOCKET_IFNAME"] == "lo"
    assert p.rank_env["NCCL_SOCKET_IFNAME"] == "lo"
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    torchrun = plan([], env=env)
    assert torchrun.init_method == "env://"
    assert "GLOO_SOCKET_IFNAME" not in torchrun.rank_env


def test_torchrun_environment_means_one_rank_per_process():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    p = plan(["--gpu=0,1,2,3"], cuda=True, num_gpus=2, cores=8, env=env)
    assert p.launcher == "torchrun" and p.init_method == "env://"
    assert (p.world_size, p.rank_offset, p.local_rank) == (4, 3, 1)
    # The device comes from LOCAL_RANK, not from --gpu.
    assert p.devices == ["cuda:1"]
    assert p.threads == 4
    cpu = plan([], env=env)
    assert cpu.devices == ["cpu"] and cpu.backend == "gloo"


def test_torchrun_local_rank_must_exist_as_a_gpu():
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2"}
    with pytest.raises(UsageError, match="GPU 2 does not exist"):
        plan(["--mode", "cuda-cuda"], cuda=True, num_gpus=2, env=env)


def test_bf16_on_a_gpu_without_bf16_is_refused():
    with pytest.raises(UsageError, match="--precision bf16: this GPU does not"):
        plan(["--precision", "bf16"], cuda=True, num_gpus=1, gpu_bf16=False)
    assert plan(["--precision", "bf16"], cuda=True, num_gpus=1).backend == "nccl"
    # CPU ranks compute bf16 whatever the GPUs can do.
    p = plan(["--precision", "bf16", "--mode", "cpu-cpu"], cuda=True,
             num_gpus=1, gpu_bf16=False)
    assert p.devices == ["cpu"]


def test_bf16_autocasts_only_where_the_device_computes_bf16():
    # A CPU without bfloat16 instructions: bf16 storage, fp32 compute.
    p = plan(["--precision", "bf16"])
    assert not p.autocast
    assert any("no bfloat16 instructions" in line for line in p.notices)
    machine = Machine(False, False, 0, 2, cpu_bf16=True)
    args = parse_args(["--precision", "bf16"])
    assert plan_run(args, args.gpu, args.num_workers, {}, machine).autocast
    assert plan(["--precision", "bf16"], cuda=True, num_gpus=1).autocast
    assert not plan([]).autocast


# --- Trainers on DGL's distributed engine (distributed/dist_node_classification.py)
TRAINER_1_OF_MACHINE_1 = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2"}


def trainer_plan(argv, cuda=False, num_gpus=0, dgl_cuda=None, env=None):
    dgl_cuda = cuda if dgl_cuda is None else dgl_cuda
    machine = Machine(cuda, dgl_cuda, num_gpus, 8)
    args = parse_args(argv)
    return plan_run(args, args.gpu, args.num_workers,
                    env or TRAINER_1_OF_MACHINE_1, machine,
                    distributed=True)


def test_a_distributed_trainer_takes_the_gpu_of_its_local_rank_with_nccl():
    # As DGL's example maps trainers to --num_gpus GPUs: the machine's
    # second trainer trains on its second GPU; the graph stays on the
    # servers (CPU storage).
    p = trainer_plan([], cuda=True, num_gpus=2)
    assert (p.mode, p.storage, p.backend) == ("cpu-cuda", "cpu", "nccl")
    assert p.devices == ["cuda:1"] and p.rank_offset == 3
    assert p.init_method == "env://" and p.notices == []
    cpu = trainer_plan([])
    assert (cpu.mode, cpu.backend, cpu.devices) == ("cpu-cpu", "gloo", ["cpu"])
    assert "one CPU process per trainer" in cpu.notices[0]


def test_distributed_trainers_with_a_cpu_only_dgl_train_on_the_cpu():
    p = trainer_plan([], cuda=True, num_gpus=2, dgl_cuda=False)
    assert (p.mode, p.backend, p.devices) == ("cpu-cpu", "gloo", ["cpu"])
    assert p.notices == [
        "torch sees 2 GPU(s), but this DGL is a CPU-only build: using --mode "
        "cpu-cpu (one CPU process per trainer, gloo backend). To train on "
        f"the GPUs: {INSTALL_CUDA_DGL}"]


def test_more_trainers_than_gpus_on_a_machine_is_refused():
    with pytest.raises(UsageError) as refused:
        trainer_plan([], cuda=True, num_gpus=1)
    assert str(refused.value) == (
        "2 trainers on this machine, one per GPU, but it has 1 CUDA "
        "device(s): start at most 1 trainers per machine, or train on the "
        "CPU (--mode cpu-cpu)")
    assert trainer_plan(["--mode", "cpu-cpu"], cuda=True,
                        num_gpus=1).devices == ["cpu"]


@pytest.mark.parametrize("mode", ["pinned-cuda", "cuda-cuda"])
def test_distributed_trainers_leave_the_graph_on_the_servers(mode):
    with pytest.raises(UsageError, match=f"--mode {mode}: on DGL's "
                       "distributed engine the graph and features stay on "
                       "the graph servers"):
        trainer_plan(["--mode", mode], cuda=True, num_gpus=2)


def test_a_graph_server_refuses_a_machine_with_too_few_gpus(tmp_path,
                                                            monkeypatch):
    # A server checks the plan of its machine's last trainer, so that the
    # whole job refuses (a server left waiting for trainers that refused
    # would never end): 2 machines, 4 trainers, 1 GPU a machine.
    import gbrun.planning
    import dist_node_classification as trainer

    monkeypatch.setattr(gbrun.planning, "detect_machine",
                        lambda precision: Machine(True, True, 1, 8))
    ip_config = tmp_path / "ip_config.txt"
    ip_config.write_text("10.0.0.1\n10.0.0.2\n")
    args = parse_args([])
    args.ip_config, args.num_workers = str(ip_config), 0
    server = {"DGL_ROLE": "server", "DGL_NUM_CLIENT": "4"}
    with pytest.raises(UsageError, match="2 trainers on this machine, one "
                       "per GPU, but it has 1 CUDA device"):
        trainer.plan_devices(args, server)
    # With one trainer a machine it plans as that trainer would.
    assert trainer.plan_devices(args, {**server, "DGL_NUM_CLIENT": "2"}
                                ).devices == ["cuda:0"]


def test_seeded_worker_processes_are_a_notice_that_says_what_a_resume_does():
    # GraphBolt's worker processes keep the order of the epoch they started
    # in, so on one machine a resume inside an epoch is not exact: said.
    args = ["--gpu=0", "--seed", "1", "--num-workers", "2"]
    [notice] = [n for n in plan(args).notices if "--num-workers" in n]
    assert notice.endswith("trains some of its nodes twice and others not at "
                           "all (the workers keep the order of the epoch they "
                           "started in).")
    [notice] = [n for n in trainer_plan(args).notices if "--num-workers" in n]
    assert notice.endswith("runs will differ.")
    assert not [n for n in plan(["--gpu=0", "--num-workers", "2"]).notices
                if "--num-workers" in n]
