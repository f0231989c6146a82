"""A traced program that replaces itself with another one (``os.exec*``), as a tool's own command
starts its launcher: ``axolotl train cfg.yml`` runs ``accelerate launch -m axolotl.cli.train
cfg.yml`` with ``os.execvpe`` (axolotl/cli/utils/train.py, ``_launch_accelerate_training``).

An exec would replace the probe with the new program, untraced. While the probe runs, the exec
functions raise ``Replaced`` instead (a ``BaseException``, so the program's own ``except
Exception`` lets it through, as nothing returns from a real exec); the runner then goes on
tracing the new command line in this process, with the environment the exec gives it, as the new
process would run: a Python interpreter's script, a launcher's rank 0 (``contract.launch``), or
an installed Python program (a console script). Anything else is refused. ``os.execl*`` call
these (os.py), so they are followed too. Standard library only (probe bundle).
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Mapping, MutableMapping, Sequence

from xmem_admission.estimator.probe.outcomes import Refused

_FUNCTIONS = ("execv", "execve", "execvp", "execvpe")


class Replaced(BaseException):
    """The traced program called ``os.exec*``: the command line and environment it gave."""

    def __init__(self, argv: Sequence[str], path: str, env: Mapping[str, str]) -> None:
        super().__init__(f"exec {path} {' '.join(argv[1:])}")
        self.argv = list(argv)
        self.path = path  # the program, found on the environment's PATH where it had no folder
        self.env = dict(env)


def _found(file: str, env: Mapping[str, str]) -> str:
    """Where ``execvp(e)`` finds ``file``: itself when it names a folder, else the first
    executable file of that name on the environment's ``PATH`` (os.py, ``_execvpe``)."""
    if os.path.dirname(file):
        return file
    for folder in os.get_exec_path(dict(env)):
        candidate = os.path.join(folder, file)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, f"No such file or directory: {file!r}")


def _exec(real: Callable[..., Any], search: bool, with_env: bool) -> Callable[..., Any]:
    traced = os.getpid()

    def replace(file: Any, args: Sequence[Any], *rest: Any) -> Any:
        if os.getpid() != traced:  # a child the program forked: its exec is its own
            return real(file, args, *rest)
        env = dict(rest[0]) if with_env and rest else dict(os.environ)
        name = os.fsdecode(file)
        argv = [os.fsdecode(a) for a in args]
        path = _found(name, env) if search else name
        if not os.access(path, os.X_OK):  # as the real exec fails, in the program
            raise FileNotFoundError(2, f"No such file or directory: {name!r}")
        raise Replaced(argv, path, env)
    return replace


def install(patches: Any) -> None:
    """Make ``os.exec*`` raise ``Replaced`` while the probe runs (``patches`` restores them)."""
    for name in _FUNCTIONS:
        patches.set(os, name, _exec(getattr(os, name), search=name.startswith("execvp"),
                                    with_env=name.endswith("e")))


def _is_python_program(path: str) -> bool:
    """A Python source file: ``.py``, or a ``#!`` line that names a Python (pip's console
    scripts, also pip's ``#!/bin/sh`` form that execs the interpreter on its next lines)."""
    if path.endswith(".py"):
        return True
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024).decode("utf-8", "replace")
    except OSError:
        return False
    first, _, rest = head.partition("\n")
    if not first.startswith("#!"):
        return False
    if "python" in first:
        return True
    return os.path.basename(first[2:].split()[0]) == "sh" and rest.startswith("'''exec'")


def follow(exc: Replaced, environ: MutableMapping[str, str]) -> List[str]:
    """The command line the probe traces next for ``exc`` (its program by path), with
    ``environ`` made the new process's environment. Raises ``Refused`` for a program it cannot
    trace in this process."""
    from xmem_admission.contract.errors import LaunchError
    from xmem_admission.estimator.command import launch_of

    command = [exc.path] + exc.argv[1:]
    name = os.path.basename(exc.path)
    try:
        launch = launch_of(command)
    except LaunchError as error:
        raise Refused(f"the program replaces itself with {' '.join(command)}: {error}") from None
    python_word = name.startswith("python") and not name.endswith(".py")
    if launch is None and not python_word and not _is_python_program(exc.path):
        raise Refused(f"the program replaces itself (os.exec) with {exc.path}, which is not a "
                      f"Python program; the probe traces Python programs only: estimate the "
                      f"command that program runs")
    environ.clear()
    environ.update(exc.env)
    return command
