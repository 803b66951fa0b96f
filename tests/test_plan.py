"""plan_run decides devices, backend, world size, rendezvous and threads.
It takes torch's and DGL's CUDA availability as arguments, so every mode is
checked here without a GPU."""
import socket

import pytest

from gbrun.cli import UsageError
from gbrun.launch import INSTALL_CUDA_DGL, Machine, plan_run
from node_classification import parse_args


def plan(argv, cuda=False, num_gpus=0, cores=2, env=None, dgl_cuda=None,
         gpu_bf16=True):
    # By default DGL can use CUDA exactly when torch can.
    dgl_cuda = cuda if dgl_cuda is None else dgl_cuda
    machine = Machine(cuda, dgl_cuda, num_gpus, cores, gpu_bf16)
    return plan_run(parse_args(argv), env or {}, machine)


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
    assert cpu.rank_env == {"OMP_NUM_THREADS": "1",
                               "CUDA_VISIBLE_DEVICES": ""}
    gpu = plan(["--gpu=0,1"], cuda=True, num_gpus=2)
    assert gpu.rank_env == {"OMP_NUM_THREADS": "1"}


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
    assert plan([f"--gpu={gpus}"], cores=cores).threads == threads


def test_rendezvous_port_is_free_unless_given():
    def port(p):
        assert p.init_method.startswith("tcp://127.0.0.1:")
        return int(p.init_method.rsplit(":", 1)[1])

    # While another job holds the port one plan picked, the next plan picks
    # another one, and that one can be bound. Both lie below the ephemeral
    # range, where outgoing connections cannot take them meanwhile.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert port(plan([])) < ephemeral_low
    with socket.socket() as held:
        held.bind(("127.0.0.1", port(plan([]))))
        held.listen()
        again = port(plan([]))
        assert again != held.getsockname()[1] and again < ephemeral_low
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", again))
    given = plan(["--master-port", "29999"])
    assert given.init_method == "tcp://127.0.0.1:29999"
    assert given.launcher == "spawn"


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
    assert plan_run(args, {}, machine).autocast
    assert plan(["--precision", "bf16"], cuda=True, num_gpus=1).autocast
    assert not plan([]).autocast
