"""The docs say what the program does: commands and flags, metrics, paths, pinned versions, the
chart's comments, the registries' kinds and backends, and no issue numbers in code comments
(docs_truth.py).

Each check runs on the real tree, and once on a planted case (a flag added to the parser without
docs, a documented flag the parser no longer has, a metric registered without docs, a path that
is not there, a release that is not the pin, a dead link in a copy of the chart's values.yaml, a
stale kind list, an issue number in a comment) to show that it fails when the docs stop being
true.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Dict, List, Set, Tuple

from tests.docs import docs_truth
from tests.docs.docs_truth import Page
from xmem_admission.cli import build_parser
from xmem_admission.cluster import integrations
from xmem_admission.cluster.policy.model import BackendName


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


# -- versions, the chart's comments, the registries, issue numbers -------------------------------

def test_every_release_the_docs_name_is_the_one_scripts_pin() -> None:
    pins = docs_truth.pinned_versions()
    assert pins["KUEUE_VERSION"] and pins["KUBERNETES_VERSION"]  # the scan reads the files
    wrong = docs_truth.wrong_versions(docs_truth.pages(), pins)
    assert not wrong, "named in the docs, not what scripts/*-versions.env pins:\n" + "\n".join(wrong)


def test_every_path_the_charts_comments_name_exists() -> None:
    comments = list(docs_truth.chart_comments())
    assert any("values.yaml" in where for where, _, _ in comments)  # the scan reads the chart
    dead = docs_truth.chart_dead_links()
    assert not dead, "named in the chart's comments but not in the repository:\n" + "\n".join(dead)


def _registries() -> Tuple[List[str], List[str]]:
    return [i.kind for i in integrations.ALL], [b.value for b in BackendName]


def _architecture() -> Page:
    return next(p for p in docs_truth.pages() if p.path == "docs/architecture.md")


def test_the_kinds_and_backends_docs_architecture_lists_are_the_registries() -> None:
    kinds, backends = _registries()
    stale = docs_truth.stale_registry_lists(_architecture(), kinds, backends)
    assert not stale, "\n".join(stale)


def test_no_comment_in_the_code_cites_an_issue_number_outside_the_allow_list() -> None:
    found = docs_truth.issue_references(docs_truth.code_files(), docs_truth.ISSUES_ALLOWED)
    assert not found, ("comments and docstrings citing this repository's issues (say what the "
                       "code does instead):\n" + "\n".join(found))


def test_every_file_on_the_issue_allow_list_still_needs_to_be_there() -> None:
    sources = dict(docs_truth.code_files())
    cleaned = sorted(path for path in docs_truth.ISSUES_ALLOWED
                     if path not in sources or not docs_truth.issue_references([(path,
                                                                                 sources[path])]))
    assert not cleaned, ("cite no issue number any more: take them off "
                         "docs_truth.ISSUES_ALLOWED:\n" + "\n".join(cleaned))


def test_a_version_that_is_not_the_pin_is_reported_and_a_cited_source_release_is_not() -> None:
    page = Page("docs/ops.md", "- **Kueue 0.17.0** (`scripts/kueue-versions.env`), its "
                "controller.\n- JobSet v0.12.0 and Kubeflow Trainer v2.3.0 run beside it.\n\n"
                "Kueue adds the check (`reconcileSyncAdmissionChecks`, "
                "pkg/controller/core/workload_controller.go, Kueue v0.17.0). The tests run "
                "kubelet v1.36.2.\n")
    pins = {"KUEUE_VERSION": "0.19.0", "JOBSET_VERSION": "0.12.0", "TRAINER_VERSION": "2.3.0",
            "KUBERNETES_VERSION": "1.36.3"}
    assert docs_truth.wrong_versions([page], pins) == [
        "docs/ops.md: Kueue 0.17.0, but scripts/*-versions.env pins KUEUE_VERSION=v0.19.0",
        "docs/ops.md: kubelet 1.36.2, but scripts/*-versions.env pins KUBERNETES_VERSION=v1.36.3",
    ]


def test_a_dead_link_planted_in_a_copy_of_values_yaml_is_reported(tmp_path: Path) -> None:
    chart = tmp_path / "helm" / "xmem-admission"
    shutil.copytree(docs_truth.CHART, chart)
    values = chart / "values.yaml"
    values.write_text(values.read_text() + "# learned overhead: docs/right-sizing.md; the\n"
                      "# policy's schema: crds/gpuadmissionpolicies.xmem.io.yaml\n")
    assert docs_truth.chart_dead_links(chart, docs_truth.ROOT) == [
        f"helm/xmem-admission/values.yaml:{len(values.read_text().splitlines()) - 1}: "
        "docs/right-sizing.md"]
    assert docs_truth.chart_dead_links() == []  # the tree's chart is untouched


def test_a_stale_kind_list_and_a_missing_backend_are_reported() -> None:
    kinds, backends = _registries()
    page = _architecture()
    stale = Page(page.path, page.text.replace("PyTorchJob, JobSet, TrainJob", "PyTorchJob, MPIJob")
                 .replace("MIGSingle,\n                         DRA)", "MIGSingle)"))
    assert stale.text != page.text
    assert docs_truth.stale_registry_lists(stale, kinds, backends) == [
        "docs/architecture.md: integrations/ lists ['MPIJob'], which the registry does not have",
        "docs/architecture.md: integrations/ does not list ['JobSet', 'TrainJob']",
        "docs/architecture.md: backends/ does not list ['DRA']",
    ]


def test_no_file_of_the_chart_cites_an_issue_number_and_a_planted_one_is_reported(
        tmp_path: Path) -> None:
    assert docs_truth.chart_issue_references() == []
    chart = tmp_path / "helm" / "xmem-admission"
    shutil.copytree(docs_truth.CHART, chart)
    rbac = chart / "templates" / "rbac.yaml"
    rbac.write_text(rbac.read_text() + "# Pods (issue 31); a kueue issue 15210 workaround.\n")
    assert docs_truth.chart_issue_references(chart) == [
        f"helm/xmem-admission/templates/rbac.yaml:{len(rbac.read_text().splitlines())}: "
        "issue 31"]

def test_issue_numbers_in_comments_and_docstrings_are_reported_and_other_projects_are_not() -> None:
    source = ('"""The real node (#29, item 3)."""\n\n'
              "# A pytorch issue 49207 workspace, and carolchenyx/MGFN issue 35's message;\n"
              "# since issue 38 the trace carries\n"
              "# reductions.\n"
              "MESSAGE = 'GPU #1 issue 12'  # a string is not a comment\n\n\n"
              "def f():\n    \"\"\"Sized bigger (issues 31\n    and 40).\"\"\"\n")
    assert docs_truth.issue_references([("bench/planted.py", source)]) == [
        "bench/planted.py:3: issue 38", "bench/planted.py:1: #29",
        "bench/planted.py:10: issues 31"]
    assert docs_truth.issue_references([("bench/planted.py", source)],
                                       frozenset({"bench/planted.py"})) == []


def test_no_sentence_of_the_docs_runs_to_a_hundred_words() -> None:
    found = docs_truth.long_sentences(docs_truth.pages(), docs_truth.LONG_SENTENCES_ALLOWED)
    assert not found, "split these into short sentences:\n" + "\n".join(found)
    pages = {page.path: page for page in docs_truth.pages()}
    still = [path for path in sorted(docs_truth.LONG_SENTENCES_ALLOWED)
             if path not in pages or not docs_truth.long_sentences([pages[path]])]
    assert not still, "no long sentence any more: take off LONG_SENTENCES_ALLOWED: " + str(still)


def test_a_long_sentence_is_reported_and_code_and_tables_are_not() -> None:
    long = "This " + " ".join(["word"] * 98) + " end."
    page = Page("docs/x.md", f"Short one. {long} Another short one.\n\n```sh\n{long}\n```\n\n"
                f"| {long} |\n")
    assert docs_truth.long_sentences([page]) == [
        "docs/x.md: 100 words: This word word word word word word word word word word word ..."]
    assert docs_truth.long_sentences([page], frozenset({"docs/x.md"})) == []
