"""Launcher command lines: which training program a distributed launcher starts, on how many ranks.

``torchrun [--nnodes M] --nproc-per-node N train.py ARGS`` (also ``python -m
torch.distributed.run`` and the deprecated ``torch.distributed.launch``) and ``accelerate launch
--multi_gpu --num_processes N train.py ARGS`` start N processes on each of M nodes, each running
``train.py ARGS`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set; DeepSpeed's ``deepspeed
--num_gpus N train.py ARGS`` starts N on one node, each running ``train.py --local_rank=R ARGS``;
``accelerate launch --use_deepspeed`` also hands each rank its DeepSpeed options in variables.
``parse`` reads such a command line into a ``Launch``: the program one rank runs and the world it
runs in. The estimator traces rank 0 of that world in one process; the cluster side reads the
world size of a Job from it. One parser, so that both sides agree. Standard library only
(contract package, probe bundle).

The option tables are the launchers' own: torch/distributed/run.py ``get_args_parser`` (torch
2.14), accelerate/commands/launch.py ``launch_command_parser`` (accelerate 1.15) and
deepspeed/launcher/runner.py ``parse_args`` (DeepSpeed 0.19.8); every option not listed as a flag
there takes a value.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.contract.errors import LaunchError


class Launcher(str, enum.Enum):
    """The program that starts the training processes."""

    TORCHRUN = "torchrun"  # torchrun, python -m torch.distributed.run / .launch
    ACCELERATE = "accelerate"  # accelerate launch, python -m accelerate.commands.launch
    DEEPSPEED = "deepspeed"  # deepspeed, python -m deepspeed.launcher.runner (one node)


# Options of torch.distributed.run that take no value (get_args_parser, nargs=0 actions).
_TORCHRUN_FLAGS = frozenset({
    "--standalone", "--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path",
    "--virtual-local-rank", "--virtual_local_rank", "--use-env", "--use_env",
})
# Options of accelerate launch that take no value (launch_command_parser, nargs=0 actions).
_ACCELERATE_FLAGS = frozenset({
    "--cpu", "--debug", "--downcast-bf16", "--downcast_bf16", "--dynamo-use-dynamic",
    "--dynamo-use-fullgraph", "--dynamo-use-regional-compilation", "--dynamo_use_dynamic",
    "--dynamo_use_fullgraph", "--dynamo_use_regional_compilation", "--enable-cpu-affinity",
    "--enable_cpu_affinity", "--fp8-use-autocast-during-eval", "--fp8_use_autocast_during_eval",
    "--module", "--multi-gpu", "--multi_gpu", "--no-python", "--no-tpu-cluster", "--no_python",
    "--no_tpu_cluster", "--quiet", "--same-network", "--same_network", "--tpu", "--tpu-cluster",
    "--tpu-use-sudo", "--tpu_cluster", "--tpu_use_sudo", "--use-deepspeed", "--use-fsdp",
    "--use-megatron-lm", "--use-parallelism-config", "--use_deepspeed", "--use_fsdp",
    "--use_megatron_lm", "--use_parallelism_config", "-m", "-q",
})
# Options of DeepSpeed's runner that take no value (deepspeed/launcher/runner.py, parse_args:
# store_true actions), with underscores made dashes as ``_options`` does.
_DEEPSPEED_FLAGS = frozenset({
    "--module", "--no-python", "--no_python", "--no-local-rank", "--no_local_rank", "--no-ssh",
    "--no_ssh", "--no-ssh-check", "--no_ssh_check", "--force-multi", "--force_multi",
    "--save-pid", "--save_pid", "--bind-cores-to-rank", "--bind_cores_to_rank", "-q", "--quiet",
})
_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
_ACCELERATE_MODULES = frozenset({"accelerate.commands.launch", "accelerate.commands.accelerate_cli"})
_DEEPSPEED_MODULES = frozenset({"deepspeed.launcher.runner"})
# Interpreter options that take a value (python -W ignore -m torch.distributed.run ...).
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})

# What the probe does not trace of a DeepSpeed launch, by the option that asks for it.
DEEPSPEED_MULTI_NODE = (
    "multi-node DeepSpeed launches ({option}) are not estimated: the runner takes the nodes and "
    "their GPU slots from a hostfile (deepspeed/launcher/runner.py, fetch_hostfile) that the "
    "probe does not read; estimate one node's launch, deepspeed --num_gpus N (each rank's memory "
    "depends on the data-parallel world size: give the whole job's rank count there), or use "
    "torchrun with --nnodes")
ACCELERATE_DEEPSPEED_CONFIG = (
    "accelerate launch --use_deepspeed with an Accelerate config file ({path}) is not estimated: "
    "Accelerate merges the file's DeepSpeed options into what it hands the ranks, and the probe "
    "reads no YAML; give the options on the command line (--zero_stage, "
    "--deepspeed_config_file, --mixed_precision), or launch the script with deepspeed "
    "--num_gpus N")
# accelerate launch's DeepSpeed options and the variables its launcher hands them to the ranks
# in (accelerate/utils/launch.py, prepare_deepspeed_cmd_env); True: the value lower-cased.
_ACCELERATE_DEEPSPEED_ENV = {
    "--zero-stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", False),
    "--gradient-accumulation-steps": ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", False),
    "--gradient-clipping": ("ACCELERATE_GRADIENT_CLIPPING", True),
    "--offload-optimizer-device": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", True),
    "--offload-param-device": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", True),
    "--zero3-init-flag": ("ACCELERATE_DEEPSPEED_ZERO3_INIT", True),
    "--zero3-save-16bit-model": ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
    "--deepspeed-config-file": ("ACCELERATE_DEEPSPEED_CONFIG_FILE", False),
    "--deepspeed-moe-layer-cls-names": ("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", False),
}
DEEPSPEED_AUTOTUNING = (
    "DeepSpeed's --autotuning runs many trial jobs with different ZeRO stages and batch sizes; "
    "it is not estimated: estimate the configuration it settles on")

UNSUPPORTED: Dict[Launcher, str] = {}


@dataclass(frozen=True)
class Launch:
    """One rank's program and the world it runs in."""

    launcher: Launcher
    program: Tuple[str, ...]  # (script, args...) or ("-m", module, args...)
    nnodes: int
    nproc_per_node: int
    # never set (estimator.command.launch_of refuses a launch that sets it): accelerate launch
    # --use_deepspeed is traced, its options reaching rank 0 through ``environment``
    use_deepspeed: bool = False
    environment: Tuple[Tuple[str, str], ...] = ()  # more variables the launcher sets

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def rank0_environment(self, master_port: int = 29500) -> Dict[str, str]:
        """What the launcher gives rank 0 (torch/distributed/elastic/agent/server/api.py,
        ``_assign_worker_ranks`` and the worker env of ``local_elastic_agent``; DeepSpeed's
        deepspeed/launcher/launch.py, ``main``, adds ``CROSS_RANK``, ``CROSS_SIZE`` and
        ``LOCAL_SIZE``)."""
        env = {
            "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
            "NODE_RANK": "0",
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        }
        if self.launcher is Launcher.DEEPSPEED:
            env.update({"CROSS_RANK": "0", "CROSS_SIZE": str(self.nnodes),
                        "LOCAL_SIZE": str(self.nproc_per_node)})
        env.update(dict(self.environment))
        return env


def _script_name(word: str) -> str:
    return os.path.basename(word)


def _split_python(argv: Sequence[str]) -> Optional[Tuple[str, List[str]]]:
    """``python [opts] -m MODULE ARGS`` -> (MODULE, ARGS); None for anything else."""
    rest = list(argv[1:])
    while rest:
        head = rest[0]
        if head == "-m":
            return (rest[1], rest[2:]) if len(rest) >= 2 else None
        if head.startswith("-m") and len(head) > 2:
            return head[2:], rest[1:]
        if not head.startswith("-") or head == "-c":
            return None
        rest = rest[2:] if head in _PYTHON_OPTIONS_WITH_VALUE else rest[1:]
    return None


def launcher_of(argv: Sequence[str]) -> Optional[Tuple[Launcher, List[str]]]:
    """Which launcher ``argv`` runs (and its own arguments), or None for a plain program."""
    if not argv:
        return None
    name = _script_name(argv[0])
    if name == "torchrun":
        return Launcher.TORCHRUN, list(argv[1:])
    if name == "accelerate":
        if len(argv) >= 2 and argv[1] == "launch":
            return Launcher.ACCELERATE, list(argv[2:])
        return None
    if name == "deepspeed":
        return Launcher.DEEPSPEED, list(argv[1:])
    if name.startswith("python"):
        found = _split_python(argv)
        if found is None:
            return None
        module, rest = found
        if module in _TORCHRUN_MODULES:
            return Launcher.TORCHRUN, rest
        if module in _ACCELERATE_MODULES:
            if module.endswith("accelerate_cli"):
                return (Launcher.ACCELERATE, rest[1:]) if rest[:1] == ["launch"] else None
            return Launcher.ACCELERATE, rest
        if module in _DEEPSPEED_MODULES:
            return Launcher.DEEPSPEED, rest
    return None


def _options(args: Sequence[str], flags: frozenset[str]) -> Tuple[Dict[str, str], List[str]]:
    """Split a launcher's arguments into its options (name -> value; flags map to "") and the
    program after them. ``--`` ends the options."""
    options: Dict[str, str] = {}
    rest = list(args)
    while rest:
        head = rest[0]
        if head == "--":
            rest = rest[1:]
            break
        if not head.startswith("-") or head == "-":
            break
        if "=" in head and head.startswith("--"):
            name, value = head.split("=", 1)
            options[name.replace("_", "-")] = value
            rest = rest[1:]
            continue
        if head in flags:
            options[head.replace("_", "-")] = ""
            rest = rest[1:]
            continue
        if len(rest) < 2:
            raise LaunchError(f"launcher option {head} needs a value")
        options[head.replace("_", "-")] = rest[1]
        rest = rest[2:]
    return options, rest


def _count(name: str, value: str, gpus_per_node: Optional[int]) -> int:
    """A process or node count: an integer, ``MIN:MAX`` (elastic: the smallest world, where
    each rank holds the largest shard), or ``gpu``/``auto`` (one per GPU of the node)."""
    text = value.strip()
    if ":" in text:
        text = text.split(":", 1)[0]
    if text in ("gpu", "auto", "cuda"):
        if gpus_per_node is None:
            raise LaunchError(f"{name} {value} means one process per GPU of the node, which is "
                              f"not known here: give {name} a number")
        return gpus_per_node
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"{name} must be a positive integer, got {value!r}")
    return int(text)


def _program(rest: List[str], module_flag: bool, no_python: bool) -> Tuple[str, ...]:
    if not rest:
        raise LaunchError("the launcher names no training script")
    if no_python:
        raise LaunchError("--no-python launches a program that is not a Python script; the "
                          "probe traces Python training scripts only")
    if module_flag:
        return ("-m",) + tuple(rest)
    return tuple(rest)


def parse(argv: Sequence[str], gpus_per_node: Optional[int] = None,
          environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The launch ``argv`` describes, or None when it is not a launcher's command line.

    ``gpus_per_node`` answers ``--nproc-per-node gpu`` and an ``accelerate launch
    --multi_gpu`` without ``--num_processes`` (both mean one process per GPU); without it they
    raise ``LaunchError``. torchrun's options default to ``PET_NNODES`` / ``PET_NPROC_PER_NODE``
    from ``environ`` (torch/distributed/argparse_util.py, ``env``: ``PET_`` + the option's
    name), as a PyTorchJob's pods are given them.
    """
    environ = os.environ if environ is None else environ
    found = launcher_of(argv)
    if found is None:
        return None
    launcher, args = found
    if launcher is Launcher.DEEPSPEED:
        return _deepspeed(args, gpus_per_node, environ)
    if launcher is Launcher.TORCHRUN:
        options, rest = _options(args, _TORCHRUN_FLAGS)
        nnodes = _count("--nnodes", options.get("--nnodes", environ.get("PET_NNODES", "1")),
                        gpus_per_node)
        nproc = _count("--nproc-per-node", options.get(
            "--nproc-per-node", environ.get("PET_NPROC_PER_NODE", "1")), gpus_per_node)
        program = _program(rest, "--module" in options or "-m" in options,
                           "--no-python" in options)
        return Launch(launcher, program, nnodes, nproc)
    options, rest = _options(args, _ACCELERATE_FLAGS)
    machines = _count("--num-machines", options.get("--num-machines", "1"), gpus_per_node)
    deepspeed = "--use-deepspeed" in options
    if "--num-processes" in options:
        # accelerate's --num_processes is the total over all machines (launch.py,
        # multi_gpu_launcher: nproc_per_node = num_processes // num_machines).
        total = _count("--num-processes", options["--num-processes"], gpus_per_node)
    elif "--multi-gpu" in options or deepspeed:
        # without a config file, one process per GPU of the node (launch.py,
        # _validate_launch_command: num_processes = the device count)
        total = _count("--num-processes", "gpu", gpus_per_node) * machines
    else:
        total = machines
    if total % machines:
        raise LaunchError(f"--num_processes {total} is not a multiple of --num_machines "
                          f"{machines}")
    program = _program(rest, "--module" in options or "-m" in options, "--no-python" in options)
    environment = _accelerate_deepspeed(options, environ) if deepspeed else ()
    return Launch(launcher, program, machines, total // machines, environment=environment)


def _accelerate_deepspeed(options: Mapping[str, str],
                          environ: Mapping[str, str]) -> Tuple[Tuple[str, str], ...]:
    """The variables ``accelerate launch --use_deepspeed`` hands each rank, from its command
    line (accelerate/utils/launch.py, ``prepare_deepspeed_cmd_env``): Accelerate's
    ``DeepSpeedPlugin`` reads them (``ACCELERATE_USE_DEEPSPEED``, the ZeRO stage, the offload
    devices, the ds_config file). A config file, named or Accelerate's default one
    (accelerate/commands/config/config_args.py: ``$HF_HOME/accelerate/default_config.yaml``),
    would add options the probe cannot read: refused."""
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "~"), ".cache"),
        "huggingface")
    default = os.path.expanduser(os.path.join(home, "accelerate", "default_config.yaml"))
    named = options.get("--config-file")
    if named or os.path.isfile(default):
        raise LaunchError(ACCELERATE_DEEPSPEED_CONFIG.format(path=named or default))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": "",
           "ACCELERATE_MIXED_PRECISION": options.get("--mixed-precision", "no").lower()}
    for option, (name, lower) in _ACCELERATE_DEEPSPEED_ENV.items():
        if option in options:
            env[name] = options[option].lower() if lower else options[option]
    return tuple(sorted(env.items()))


def _slots(spec: str, option: str) -> Tuple[str, Optional[int]]:
    """``NAME[:SLOT[,SLOT...]]`` of DeepSpeed's --include/--exclude (runner.py,
    ``parse_resource_filter``) -> (host, number of slots or None for all of them); several hosts
    (``NAME@NAME``) are several nodes."""
    if "@" in spec.strip("@"):
        raise LaunchError(DEEPSPEED_MULTI_NODE.format(option=f"{option} {spec}"))
    host, _, slots = spec.strip("@").partition(":")
    if not slots:
        return host, None
    return host, len({s.strip() for s in slots.split(",") if s.strip()})


def _every_gpu(why: str, gpus_per_node: Optional[int]) -> int:
    if gpus_per_node is None:
        raise LaunchError(f"deepspeed with {why} starts one process per GPU of the node, which is "
                          f"not known here: give --num_gpus a number")
    return gpus_per_node


def _deepspeed(args: Sequence[str], gpus_per_node: Optional[int],
               environ: Mapping[str, str]) -> Launch:
    """``deepspeed [options] train.py ARGS`` on one node (deepspeed/launcher/runner.py,
    ``main``): ``--num_gpus N`` ranks, else the slots ``--include``/``--exclude`` name, else
    ``CUDA_VISIBLE_DEVICES``, else every GPU of the node. Each rank runs ``train.py
    --local_rank=R ARGS`` (deepspeed/launcher/launch.py, ``main``: unless --no_local_rank)."""
    options, rest = _options(args, _DEEPSPEED_FLAGS)
    for option in ("-H", "--hostfile"):
        if option in options:
            raise LaunchError(DEEPSPEED_MULTI_NODE.format(option=f"{option} {options[option]}"))
    if options.get("--autotuning"):
        raise LaunchError(DEEPSPEED_AUTOTUNING)
    nodes = options.get("--num-nodes", "-1").strip()
    if nodes not in ("-1", "1"):
        raise LaunchError(DEEPSPEED_MULTI_NODE.format(option=f"--num_nodes {nodes}"))
    gpus = options.get("--num-gpus", options.get("--num-accelerators", "-1")).strip()
    include = options.get("--include", options.get("-i", ""))
    exclude = options.get("--exclude", options.get("-e", ""))
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if (gpus != "-1" or nodes != "-1") and (include or exclude):
        # runner.py, main: "Cannot specify num_nodes/gpus with include/exclude"
        raise LaunchError("deepspeed takes --num_nodes/--num_gpus or --include/--exclude, not "
                          "both")
    if gpus != "-1":
        nproc = _count("--num_gpus", gpus, gpus_per_node)
    elif include:
        _, count = _slots(include, "--include")
        nproc = count if count is not None else _every_gpu(f"--include {include}", gpus_per_node)
    elif exclude:
        _, count = _slots(exclude, "--exclude")
        every = _every_gpu(f"--exclude {exclude}", gpus_per_node)
        nproc = every - (count if count is not None else every)
        if nproc < 1:
            raise LaunchError(f"--exclude {exclude} leaves no GPU of the node's {every}")
    elif visible:
        # runner.py: with no resource option, the visible devices become --include
        nproc = len([d for d in visible.split(",") if d.strip()])
    else:
        nproc = _every_gpu("no --num_gpus", gpus_per_node)
    program = list(_program(rest, "--module" in options, "--no-python" in options))
    if "--no-local-rank" not in options:
        at = 2 if program[0] == "-m" else 1
        program[at:at] = ["--local_rank=0"]
    return Launch(Launcher.DEEPSPEED, tuple(program), 1, nproc)
