"""Start the probe from ``sitecustomize``, so an estimation pod runs the user's command unchanged.

The controller cannot know what a workload's command does before it reaches Python
(``python train.py``, ``python -m pkg``, ``bash -c "cd /w && python train.py"``, ``torchrun
--nproc-per-node 1 train.py``, ``accelerate launch train.py``), so it does not rewrite it. It puts
the probe bundle first on ``PYTHONPATH`` and sets ``XMEM_PROBE=1``; every Python process of the
container then imports the bundle's ``sitecustomize``, which calls ``activate()`` here:

- a launcher (``torchrun``, ``accelerate launch``, ``python -m torch.distributed.run``,
  ``deepspeed``) does not start its workers: its interpreter traces rank 0 of the launcher's
  world itself, in one process with a fake process group (``distributed``; ``contract.launch``
  reads the command line); a launch it cannot trace (a DeepSpeed hostfile) is refused as
  ``unsupported`` with the reason; a script started with
  ``WORLD_SIZE``/``RANK`` already set (a PyTorchJob's pods) is traced as that rank;
- other launchers, ``python -c``, package tools (``pip``) and the interactive interpreter run as
  usual; the training processes they start are probed;
- any other script or ``-m`` module runs under the probe (``runner.run``) for the policy's number
  of steps on a virtual GPU, its trace is simulated for every target GPU model
  (``estimate.estimate_trace``), and the compact result (``termination``) is written to
  ``XMEM_RESULT_PATH`` (the container's ``terminationMessagePath``); the process then exits 0
  without running the rest of the script;
- fake mode that needs real values re-executes the same command line in profile mode;
- a script that fails before its last step writes the failure (traceback included, and how
  many steps it made if any) and exits with the script's status; one that ends without an
  optimizer step (a data-preparation script before the training one) writes ``no_step`` only
  if nothing better is there, and exits with its own status, so ``prepare.py && train.py`` goes
  on to the training script;
- once a successful result is written, later Python processes of the container exit at once,
  so nothing after the estimated training runs (an upload step, a second script);
- a batch (``XMEM_PROBE_BATCH``: several estimates of one program that differ only in their
  command lines' option values): this process imports torch and the probe once, then forks a
  child per trace, one after the other, each with its own command line (the container's words
  replaced at the end of this process's command line) and its own result file; a child that
  fails, is killed (``oom_killed``: SIGKILL, the pod's memory limit most likely) or passes
  ``XMEM_PROBE_TRACE_SECONDS`` (``deadline_exceeded``) ends its own entry only; the batch
  message (``termination.encode_batch``) is written before each trace and after the last, so a
  pod that dies mid-way still tells the finished traces' results.

Environment: ``XMEM_PROBE_GPUS`` (comma-separated catalogue names), ``XMEM_PROBE_STEPS``,
``XMEM_PROBE_MODE`` (auto, fake, profile), ``XMEM_RESULT_PATH``. Python >= 3.9, torch >= 2.2,
standard library otherwise: this module ships in the probe bundle.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract import probe_env
from xmem_admission.estimator.probe.leave import leave

LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "deepspeed", "torchx"})
LAUNCHER_MODULES = frozenset({
    "torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
    "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner",
})
TOOL_MODULES = frozenset({"pip", "ensurepip", "venv", "site", "sysconfig", "pydoc", "timeit",
                          "json.tool", "http.server", "compileall", "py_compile"})
# Options of the interpreter that take a value (python -W ignore -X dev script.py).
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def command_line() -> List[str]:
    """The interpreter's full command line (``sys.orig_argv`` on 3.10+, /proc on 3.9)."""
    argv = getattr(sys, "orig_argv", None)
    if argv:
        return list(argv)
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return [a.decode() for a in handle.read().split(b"\0") if a]
    except OSError:
        return [sys.executable] + list(sys.argv)


def program(argv: Sequence[str]) -> Tuple[str, List[str]]:
    """What the interpreter was asked to run: ("script", [path, args...]), ("module", ["-m",
    name, args...]), ("command", []) for ``-c``, or ("interactive", [])."""
    rest = list(argv[1:])
    while rest:
        head = rest[0]
        if head == "-c":
            return "command", []
        if head == "-m":
            return ("module", rest[:]) if len(rest) >= 2 else ("interactive", [])
        if head.startswith("-m") and len(head) > 2:
            return "module", ["-m", head[2:]] + rest[1:]
        if head == "-" or not head.startswith("-"):
            return ("script", rest) if head != "-" else ("interactive", [])
        rest = rest[2:] if head in _OPTIONS_WITH_VALUE else rest[1:]
    return "interactive", []


def should_probe(kind: str, argv: Sequence[str]) -> bool:
    """Whether this process is a training program (and not a launcher or a tool)."""
    if kind == "script":
        return os.path.basename(argv[0]) not in LAUNCHER_SCRIPTS
    if kind == "module":
        name = argv[1]
        return name not in LAUNCHER_MODULES and name.split(".")[0] not in TOOL_MODULES \
            and name not in TOOL_MODULES
    return False


def result_path() -> str:
    return os.environ.get(probe_env.RESULT_PATH) or probe_env.DEFAULT_RESULT_PATH


def existing_status(path: str) -> Optional[str]:
    """The status of a result already written by an earlier process of the container (a batch
    whose traces all ran counts as ``ok``)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.loads(handle.read() or "null")
            status: Optional[str] = data.get("status")
            if status == "batch" and data.get("running") is None:
                return "ok"
            return status
    except (OSError, ValueError, AttributeError):
        return None


def write_result(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _settings() -> Tuple[List[str], int, str]:
    gpus = [g.strip() for g in os.environ.get(probe_env.GPUS, "").split(",") if g.strip()]
    steps = int(os.environ.get(probe_env.STEPS) or 3)
    mode = os.environ.get(probe_env.MODE) or "auto"
    return gpus, steps, mode


def _launched_program(kind: str, target: Sequence[str]) -> Optional[List[str]]:
    """For a launcher (torchrun, accelerate launch): the program its rank 0 runs, with rank 0's
    environment set here; the launcher itself never runs, so this process traces rank 0 of the
    launcher's world (``distributed``). None for any other program."""
    from xmem_admission.estimator.probe import runner

    if kind == "script":
        command = list(target)
    elif kind == "module":
        command = ["python"] + list(target)
    else:
        return None
    if runner.launch_of(command) is None:
        return None
    runner.prepare_rank(command, os.environ)
    return runner.split_command(command)


def _reexec_profile(argv: Sequence[str], reason: str) -> None:
    _reexec(argv, {probe_env.MODE: "profile", probe_env.FALLBACK: reason[:500]})


def _reexec(argv: Sequence[str], changes: Dict[str, str]) -> None:
    """This process's program started anew under the probe, with ``changes`` in its
    environment."""
    env: Dict[str, str] = {**os.environ, **changes}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, [sys.executable] + list(argv[1:]), env)


def activate() -> None:
    """Run this process's program under the probe if it is a training program (see above)."""
    argv = command_line()
    kind, target = program(argv)
    path = result_path()
    try:
        launched = _launched_program(kind, target)
    except Exception as exc:  # noqa: BLE001 - LaunchError: a launcher we do not trace
        from xmem_admission.contract import termination

        print(f"xmem probe: {exc}", file=sys.stderr)
        write_result(path, termination.encode_failure("unsupported", str(exc)))
        leave(1)
        return
    if launched is not None:
        target = launched
    elif not should_probe(kind, target):
        return
    if existing_status(path) == "ok":
        print("xmem probe: the estimate is already recorded; not running "
              f"{' '.join(target)}", file=sys.stderr)
        leave(0)
    from xmem_admission.contract import termination

    batch = os.environ.get(probe_env.BATCH)
    try:
        code = _batch(argv, path, json.loads(batch)) if batch else _probe(argv, target, path)
    except Exception as exc:  # noqa: BLE001 - any failure of ours must reach the controller
        import traceback

        text = traceback.format_exc()
        print(f"xmem probe: internal error: {exc}\n{text}", file=sys.stderr)
        write_result(path, termination.encode_failure("probe_error", f"{type(exc).__name__}: {exc}",
                                                      1, text))
        code = 1
    leave(code)


def _torch(path: str) -> Any:
    """torch, imported; None (the ``no_torch`` failure written) when the image has none."""
    try:
        import torch
    except ImportError as exc:
        from xmem_admission.contract import termination

        reason = (f"the image's Python ({sys.executable}, {sys.version.split()[0]}) cannot "
                  f"import torch: {exc}")
        print(f"xmem probe: {reason}", file=sys.stderr, flush=True)
        write_result(path, termination.encode_failure("no_torch", reason))
        return None
    return torch


def _probe(argv: Sequence[str], target: Sequence[str], path: str) -> int:
    from xmem_admission.contract import termination

    torch = _torch(path)
    if torch is None:
        return 1
    from xmem_admission.estimator.estimate import (
        allocator_config,
        device_json,
        estimate_trace,
        resolve_gpus,
    )
    from xmem_admission.estimator.probe import runner
    from xmem_admission.estimator.replays import Replays
    from xmem_admission.estimator.trace import allocation_digest

    names, steps, mode = _settings()
    if not names:
        raise ValueError(f"{probe_env.GPUS} names no GPU model")
    gpus = resolve_gpus(names)
    first = "profile" if mode == "profile" else "fake"
    print(f"xmem probe: tracing {' '.join(target)} ({first} mode, {steps} steps) as "
          f"{gpus[0].cuda_name}", file=sys.stderr, flush=True)
    result = runner.run(list(target), first, steps, json.loads(device_json(gpus[0])))
    if result.status == "unsupported" and result.retry_env and any(
            os.environ.get(k) != v for k, v in result.retry_env.items()):
        # a shortcut of the probe's own failed its check: trace again without it
        print(f"xmem probe: {result.reason}; tracing again with "
              f"{' '.join(f'{k}={v}' for k, v in sorted(result.retry_env.items()))}",
              file=sys.stderr, flush=True)
        _reexec(argv, result.retry_env)
    if result.status == "needs_real_values" and mode == "auto":
        print(f"xmem probe: fake mode needs real values ({result.reason}); tracing again in "
              "profile mode", file=sys.stderr, flush=True)
        _reexec_profile(argv, result.reason)
    if result.status == "ok":
        # the settings as the job's own torch read them (keys and rules per release), from the
        # environment it had at its first GPU block
        config = allocator_config(None, torch.__version__, result.trace.meta)
        replays = Replays(dict(os.environ))  # the first GPU's simulation serves its peak too
        per_gpu = estimate_trace(result.trace, gpus, config, replays=replays)
        rows = [g.to_dict() for g in per_gpu]
        write_result(path, termination.encode_ok(
            result.mode, result.steps, result.seconds, rows,
            os.environ.get(probe_env.FALLBACK, ""), _peak(result.trace, gpus[0], config, replays),
            allocation_digest(result.trace, [result.mode, rows])))
        print(f"xmem probe: {result.steps} steps traced in {result.seconds:.1f} s; estimates for "
              f"{', '.join(g.gpu for g in per_gpu)} written", file=sys.stderr, flush=True)
        return 0
    if result.status == "no_step":
        if existing_status(path) is None:
            write_result(path, termination.encode_failure("no_step", result.reason,
                                                          result.exit_code))
        return result.exit_code
    if result.status == "not_on_gpu":  # the contract's name for "refused, with the reason"
        result.status = "unsupported"
    if result.traceback:
        print(result.traceback, file=sys.stderr, end="" if result.traceback.endswith("\n") else "\n")
    write_result(path, termination.encode_failure(result.status, result.reason,
                                                  result.exit_code or 1, result.traceback))
    return result.exit_code or 1


def batch_command_lines(argv: Sequence[str],
                        words: Sequence[Sequence[str]]) -> Optional[List[List[str]]]:
    """Each trace's command line for this process: the container's words of the first trace
    (``words[0]``) found at the end of ``argv`` (whole, or without their first word, the
    interpreter or launcher a path may name otherwise) and replaced by each trace's; None when
    they are not there or the traces differ where they are not."""
    base = list(words[0])
    for skip in (0, 1):
        tail = base[skip:]
        if not tail or len(argv) < len(tail) or list(argv[len(argv) - len(tail):]) != tail:
            continue
        if any(len(w) != len(base) or list(w[:skip]) != base[:skip] for w in words):
            return None
        head = list(argv[:len(argv) - len(tail)])
        return [head + [str(x) for x in w[skip:]] for w in words]
    return None


def _batch(argv: Sequence[str], path: str, spec: Dict[str, Any]) -> int:
    """Trace each command line of a batch in a child forked from this process (see above)."""
    from xmem_admission.contract import termination

    words = [list(w) for w in spec.get("argv") or []]
    if not words:
        raise ValueError(f"{probe_env.BATCH} lists no trace")
    lines = batch_command_lines(argv, words)
    if _torch(path) is None:  # once, for every child
        return 1
    _preload()
    folder = os.environ.get(probe_env.SCRATCH) or ""
    if not folder or not os.access(folder, os.W_OK):
        import tempfile

        folder = tempfile.gettempdir()
    limit = float(os.environ.get(probe_env.TRACE_SECONDS) or 0)
    entries: List[Optional[str]] = [None] * len(words)
    for index in range(len(words)):
        if lines is None and index > 0:
            entries[index] = termination.encode_failure(
                "not_run", "its command line is not the one this process runs with other "
                "option values: traced alone instead")
            continue
        own = lines[index] if lines is not None else list(argv)
        write_result(path, termination.encode_batch(entries, index))
        print(f"xmem probe: trace {index + 1} of {len(words)}: {' '.join(own[1:])}",
              file=sys.stderr, flush=True)
        entries[index] = _trace_forked(own, os.path.join(folder, f"xmem-trace-{index}.json"),
                                       limit)
    write_result(path, termination.encode_batch(entries))
    return 0


def _preload() -> None:
    """What every child would import: imported once, before the forks. ``torch._dynamo`` is
    most of it: every trace imports it (``torch_patches.apply``, and ``FakeTensorMode()``), and
    it was 2.5 s of each forked trace's 3 s on a quiet 2-core machine (py-spy, torch 2.14.1)."""
    try:
        import torch._dynamo  # noqa: F401
        from torch._subclasses import fake_tensor  # noqa: F401

        from xmem_admission.estimator import estimate  # noqa: F401
        from xmem_admission.estimator.allocator import alloc_conf  # noqa: F401
        from xmem_admission.estimator.probe import (  # noqa: F401
            distributed,
            runner,
            side_effects,
            torch_patches,
            tracker,
            virtual_cuda,
        )
    except Exception as exc:  # noqa: BLE001 - each child imports again and says what failed
        print(f"xmem probe: preloading the probe failed ({exc}); each trace imports it",
              file=sys.stderr, flush=True)


def _trace_forked(own: List[str], result: str, limit: float) -> str:
    """One trace of a batch in a forked child: its result message, whatever became of it."""
    import signal
    import time

    from xmem_admission.contract import termination

    try:
        os.unlink(result)
    except OSError:
        pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:  # the child: this trace alone, as a process of its own would run it
        code = 1
        try:
            os.environ.pop(probe_env.BATCH, None)
            os.environ[probe_env.RESULT_PATH] = result
            kind, target = program(own)
            launched = _launched_program(kind, target)
            code = _probe(own, launched if launched is not None else target, result)
        except BaseException as exc:  # noqa: BLE001 - every failure is this trace's entry
            import traceback

            write_result(result, termination.encode_failure(
                "probe_error", f"{type(exc).__name__}: {exc}", 1, traceback.format_exc()))
        leave(code)
    started = time.monotonic()
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if limit > 0 and time.monotonic() - started > limit and not timed_out:
            timed_out = True
            for stray in [pid] + _descendants(pid):  # its data loader workers too
                try:
                    os.kill(stray, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.02)
    text = ""
    try:
        with open(result, encoding="utf-8") as handle:
            text = handle.read()
        termination.decode(text)
    except Exception:  # noqa: BLE001 - no result, or not one: said below
        text = ""
    if timed_out:
        return termination.encode_failure(
            "deadline_exceeded", f"the trace did not finish within {int(limit)} s "
            f"({probe_env.TRACE_SECONDS})")
    if text:
        return text
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number == signal.SIGKILL:
            return termination.encode_failure(
                "oom_killed", "the trace was killed by SIGKILL: most likely it passed the "
                "estimation pod's memory limit")
        return termination.encode_failure(
            "script_error", f"the trace was killed by signal {number} "
            f"({signal.Signals(number).name})", 128 + number)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    return termination.encode_failure(
        "probe_error", f"the trace exited with code {code} without a result", code or 1)


def _descendants(pid: int) -> List[int]:
    """The processes a process started, and theirs (Linux's /proc; [] elsewhere). A trace
    stays in the container's process group and session, so the pod's own stop reaches it."""
    out: List[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as handle:
                    found = [int(c) for c in handle.read().split()]
            except (OSError, ValueError):
                continue
            out += found
            todo += found
    return out


def _peak(trace: Any, gpu: Any, config: Any, replays: Any) -> Dict[str, Any]:
    """The first target GPU's peak for the compact result: its three largest groups."""
    from xmem_admission.estimator import peak

    found = peak.explain(trace, [gpu], config, replays=replays)[0]
    return {"gpu": found.gpu, "groups": peak.compact(found),
            "cached": found.cached_free_bytes, "fragmentation": found.fragmentation_bytes}


SITECUSTOMIZE = f'''"""xmem probe bundle: start the probe in estimation pods ({probe_env.ON}={probe_env.ON_VALUE}), see
xmem_admission.estimator.probe.sitehook.

Written by ``python -m xmem_admission.bundle``; any sitecustomize this one shadows (a
distribution's, later on sys.path) still runs afterwards.
"""
import json
import os
import sys


def _image_env():
    """The image's own PYTHONPATH (recorded by the estimation pod's init container from the
    workload's image), after this folder on sys.path and in the environment of every process
    the program starts, as the workload's own pod has it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        with open(os.path.join(here, "{probe_env.IMAGE_ENV_FILE}")) as f:
            value = json.load(f).get("PYTHONPATH") or ""
    except (OSError, ValueError, AttributeError):
        return
    entries = [e for e in value.split(os.pathsep) if e]
    if not entries:
        return
    at = next((i for i, e in enumerate(sys.path) if e and os.path.abspath(e) == here), -1) + 1
    sys.path[at:at] = [e for e in entries if e not in sys.path]
    ours = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    os.environ["PYTHONPATH"] = os.pathsep.join(ours + [e for e in entries if e not in ours])


def _writable(path):
    return bool(path) and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _scratch():
    """HOME and TMPDIR in the pod's scratch folder where the image's are not writable for the
    pod's user (caches under HOME; tempfile's folder)."""
    scratch = os.environ.get("{probe_env.SCRATCH}", "")
    if not _writable(scratch):
        return
    if not _writable(os.environ.get("HOME", "")):
        os.environ["HOME"] = scratch
    tmp = os.environ.get("TMPDIR") or "/tmp"
    if not _writable(tmp):
        os.environ["TMPDIR"] = os.path.join(scratch, "tmp")
        os.makedirs(os.environ["TMPDIR"], exist_ok=True)


def _chain():
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_xmem_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_image_env()
_chain()
if os.environ.get("{probe_env.ON}") == "{probe_env.ON_VALUE}":
    _scratch()
    from xmem_admission.estimator.probe import sitehook

    sitehook.activate()
'''
