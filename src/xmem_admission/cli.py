"""The ``xmem`` command line.

Each subcommand lives in its own module that exposes ``register(subparsers)``; the modules are
listed in ``COMMANDS`` and imported when the parser is built, so they must import nothing heavy
(torch, FastAPI, kubernetes) at module level: ``xmem --help`` must stay instant and must work in
an image without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Sequence

from xmem_admission import __version__
from xmem_admission.contract.errors import XmemError

# (module that defines the subcommand). Order is the order ``xmem --help`` lists them.
COMMANDS: List[str] = [
    "xmem_admission.commands.estimate",
    "xmem_admission.commands.bench",
    "xmem_admission.commands.gpus",
    "xmem_admission.commands.simulate",
    "xmem_admission.commands.replay",
    "xmem_admission.commands.serve",
    "xmem_admission.commands.controller",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xmem",
        description="Estimate the GPU memory of a training job on a CPU, and admit Kubernetes "
        "workloads with that request.",
    )
    parser.add_argument("--version", action="version", version=f"xmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script: returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except XmemError as exc:
        print(f"xmem {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"xmem {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
