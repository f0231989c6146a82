"""The docs say what the program does: commands and flags, metrics and paths (docs_truth.py).

Each check runs on the real README.md and docs/*.md, and once on a planted case (a flag added
to the parser without docs, a documented flag the parser no longer has, a metric registered
without docs, a path that is not there) to show that it fails when the docs stop being true.
"""

from __future__ import annotations

import argparse
from typing import Dict, Set

from tests.docs import docs_truth
from tests.docs.docs_truth import Page
from xmem_admission.cli import build_parser


def _cli() -> Dict[docs_truth.Command, Set[str]]:
    return docs_truth.cli_flags(build_parser())


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(f"no subcommand {name}")


def test_every_documented_xmem_command_line_names_commands_and_flags_that_exist() -> None:
    _, unknown = docs_truth.undocumented_or_unknown(_cli(), docs_truth.pages())
    assert not unknown, "documented but not in --help:\n" + "\n".join(unknown)


def test_every_command_and_every_flag_in_help_is_documented() -> None:
    missing, _ = docs_truth.undocumented_or_unknown(_cli(), docs_truth.pages())
    assert not missing, ("in --help but in no documented `xmem ...` line of that command "
                         "(docs/cli.md has one per command):\n" + "\n".join(missing))


def test_every_metric_the_code_registers_is_named_in_the_docs() -> None:
    metrics = docs_truth.registered_metrics(docs_truth.source_files())
    assert "xmem_controller_held_workloads" in metrics  # the scan finds the real registrations
    assert "xmem_admission_requests_total" in metrics
    missing = docs_truth.undocumented_metrics(metrics, docs_truth.pages())
    assert not missing, "registered but not in the docs:\n" + "\n".join(missing)


def test_every_relative_path_the_docs_name_exists() -> None:
    missing = docs_truth.missing_paths(docs_truth.pages())
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)


# -- the checks fail on planted cases ----------------------------------------------------------

def test_a_flag_added_to_a_command_without_docs_is_reported() -> None:
    parser = build_parser()
    _subparser(parser, "gpus").add_argument("--planted-flag", action="store_true")
    before, _ = docs_truth.undocumented_or_unknown(_cli(), docs_truth.pages())
    after, _ = docs_truth.undocumented_or_unknown(docs_truth.cli_flags(parser),
                                                  docs_truth.pages())
    assert sorted(set(after) - set(before)) == ["xmem gpus --planted-flag"]


def test_a_documented_flag_the_command_no_longer_has_is_reported() -> None:
    page = Page("README.md", "Run `xmem simulate TRACE.json --capacity-bytes N --old-flag`.\n"
                "```sh\nxmem estimate --gpu H200 \\\n    --gone -- python train.py --layers 2\n```\n")
    _, unknown = docs_truth.undocumented_or_unknown(_cli(), [page])
    assert unknown == [
        "README.md: `xmem estimate --gpu H200 --gone -- python train.py --layers 2`: "
        "`xmem estimate` has no flag --gone",
        "README.md: `xmem simulate TRACE.json --capacity-bytes N --old-flag`: "
        "`xmem simulate` has no flag --old-flag",
    ]


def test_a_documented_command_that_does_not_exist_is_reported() -> None:
    page = Page("docs/x.md", "`xmem bench imagenet --runs R` and `xmem frobnicate`")
    _, unknown = docs_truth.undocumented_or_unknown(_cli(), [page])
    assert sorted(unknown) == ["docs/x.md: `xmem bench imagenet --runs R`: no command "
                               "`xmem bench imagenet`",
                               "docs/x.md: `xmem frobnicate`: no command `xmem frobnicate`"]


def test_a_flag_documented_only_for_another_command_does_not_count() -> None:
    page = Page("README.md", "`xmem estimate --json`")
    missing, _ = docs_truth.undocumented_or_unknown(_cli(), [page])
    assert "xmem gpus --json" in missing
    assert "xmem estimate --json" not in missing


def test_a_metric_registered_without_docs_is_reported() -> None:
    source = ("from prometheus_client import Counter, Histogram\n"
              "A = Counter(\n    'xmem_planted_events', 'help')\n"
              "B = Histogram(\"xmem_planted_seconds\", 'help')\n")
    metrics = docs_truth.registered_metrics([("src/planted.py", source)])
    assert metrics == {"xmem_planted_events_total": "src/planted.py",
                       "xmem_planted_seconds": "src/planted.py"}
    page = Page("docs/ops.md", "`xmem_planted_seconds` and xmem_planted_events_total in prose")
    assert docs_truth.undocumented_metrics(metrics, [page]) == [
        "xmem_planted_events_total (registered in src/planted.py)"]


def test_a_path_that_does_not_exist_is_reported_and_urls_and_placeholders_are_not() -> None:
    page = Page("docs/ops.md", "See `helm/xmem-admission/values.yaml`, `docs/gone.md`, "
                "[install](install.md), [away](https://example.com/x.md), "
                "`xmem.io/held-reason`, `OUT.traces/`, `~/.cache/xmem-admission/`, "
                "`nvidia.com/gpumem` and [missing](nowhere.md#a-section).")
    assert docs_truth.missing_paths([page]) == ["docs/ops.md: docs/gone.md",
                                                "docs/ops.md: nowhere.md"]
