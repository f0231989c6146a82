"""Launcher command lines are read as the launchers read them: the program rank 0 runs and the world size."""

from __future__ import annotations

import pytest

from xmem_admission.contract import launch
from xmem_admission.contract.errors import LaunchError
from xmem_admission.estimator.probe import runner


@pytest.mark.parametrize("command, world, local", [
    (["torchrun", "--nproc-per-node", "4", "train.py", "--lr", "1"], 4, 4),
    (["torchrun", "--nproc_per_node=2", "train.py"], 2, 2),
    (["torchrun", "--nnodes", "2", "--nproc-per-node=8", "--rdzv-backend", "c10d", "train.py"],
     16, 8),
    (["torchrun", "--nnodes=1:4", "--nproc-per-node", "8", "train.py"], 8, 8),
    (["torchrun", "--standalone", "--nproc_per_node", "2", "train.py"], 2, 2),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "8", "train.py"], 8, 8),
    (["python3", "-u", "-m", "torch.distributed.launch", "--use-env", "--nproc_per_node", "2",
      "train.py"], 2, 2),
    (["accelerate", "launch", "--multi_gpu", "--num_processes", "8", "--num_machines", "2",
      "train.py"], 8, 4),
    (["accelerate", "launch", "--mixed_precision", "bf16", "train.py"], 1, 1),
])
def test_launchers_give_the_world_size_and_rank_0s_program(command, world, local):
    found = launch.parse(command)
    assert found is not None
    assert (found.world_size, found.nproc_per_node) == (world, local)
    assert found.program[0] == "train.py"
    env = found.rank0_environment()
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "0", "0", str(world), str(local))


def test_a_module_launched_with_dash_m_stays_a_module():
    found = launch.parse(["torchrun", "--nproc-per-node", "2", "-m", "pkg.train", "--x", "1"])
    assert found is not None and found.program == ("-m", "pkg.train", "--x", "1")


def test_plain_python_commands_are_not_launches():
    assert launch.parse(["python", "train.py"]) is None
    assert launch.parse(["python", "-m", "pkg.train"]) is None
    assert launch.parse(["accelerate", "config"]) is None


def test_one_process_per_gpu_needs_the_gpu_count():
    with pytest.raises(LaunchError, match="give --nproc-per-node a number"):
        launch.parse(["torchrun", "--nproc-per-node", "gpu", "train.py"])
    found = launch.parse(["torchrun", "--nproc-per-node", "gpu", "train.py"], gpus_per_node=4)
    assert found is not None and found.world_size == 4


def test_bad_counts_and_missing_scripts_are_clear_errors():
    with pytest.raises(LaunchError, match="positive integer"):
        launch.parse(["torchrun", "--nproc-per-node", "zero", "train.py"])
    with pytest.raises(LaunchError, match="names no training script"):
        launch.parse(["torchrun", "--nproc-per-node", "2"])
    with pytest.raises(LaunchError, match="needs a value"):
        launch.parse(["torchrun", "--nproc-per-node"])


def test_deepspeed_launches_one_node_whose_ranks_get_their_local_rank():
    assert runner.split_command(["deepspeed", "--num_gpus", "8", "train.py", "--x", "1"]) == [
        "train.py", "--local_rank=0", "--x", "1"]
    found = launch.parse(["deepspeed", "--include", "localhost:0,2", "--no_local_rank",
                          "--module", "pkg.train"])
    assert found is not None and found.world_size == 2
    assert found.program == ("-m", "pkg.train")
    with pytest.raises(LaunchError, match="give --num_gpus a number"):
        launch.parse(["deepspeed", "train.py"])
    # no resource option: the node's GPUs, or the visible ones (runner.py turns them into
    # --include); --exclude leaves the others
    assert launch.parse(["deepspeed", "train.py"], gpus_per_node=8).world_size == 8
    assert launch.parse(["deepspeed", "train.py"],
                        environ={"CUDA_VISIBLE_DEVICES": "1,3,5"}).world_size == 3
    assert launch.parse(["deepspeed", "--exclude", "localhost:0,1", "train.py"],
                        gpus_per_node=8).world_size == 6
    with pytest.raises(LaunchError, match="not both"):
        launch.parse(["deepspeed", "--num_gpus", "2", "--include", "localhost:0", "train.py"])
    found = launch.parse(["accelerate", "launch", "--use_deepspeed", "--num_processes", "4",
                          "--zero_stage", "3", "--offload_optimizer_device", "CPU", "train.py"],
                         environ={"HF_HOME": "/nonexistent"})
    assert found is not None and found.world_size == 4 and found.program == ("train.py",)
    env = found.rank0_environment()
    assert (env["ACCELERATE_USE_DEEPSPEED"], env["ACCELERATE_DEEPSPEED_ZERO_STAGE"],
            env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"],
            env["ACCELERATE_MIXED_PRECISION"]) == ("true", "3", "cpu", "no")
    with pytest.raises(LaunchError, match="with an Accelerate config file"):
        launch.parse(["accelerate", "launch", "--use_deepspeed", "--config_file", "c.yaml",
                      "--num_processes", "2", "train.py"])


def test_the_probe_runs_the_program_the_launcher_would_start():
    assert runner.split_command(["torchrun", "--nproc-per-node", "2", "train.py", "-v"]) == [
        "train.py", "-v"]
