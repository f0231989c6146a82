"""What a program can tell about the docs being true (README.md and docs/*.md).

Nine checks, each a pure function over texts so that a test can run it on a doctored page:

- every ``xmem ...`` command line the docs show (inline code or a code block) names a command
  that exists and only flags that command's ``--help`` has;
- every flag of every command's ``--help`` appears in some documented ``xmem ...`` line of that
  same command (``docs/cli.md`` has one synopsis per command);
- every Prometheus metric the code registers (a ``Counter``/``Gauge``/``Histogram``/``Summary``
  built with a literal name anywhere under ``src/``) is named, as Prometheus exposes it, in the
  docs;
- every relative path the docs name (in inline code, a code block or a link) exists;
- every release of a pinned component the docs name (``Kueue v0.19.0``) is the one its
  ``scripts/*-versions.env`` pins, unless the sentence cites that release's source files;
- every path the chart's comments name (``values.yaml``, templates, CRDs, ``Chart.yaml``) exists;
- the workload kinds and backends docs/architecture.md lists are those of the registries
  (``cluster.integrations.ALL``, ``BackendName``);
- no sentence of the docs' prose runs to 100 words or more (code blocks and tables aside);
- no comment or docstring under src/, localkube/, bench/ or tests/ cites this repository's issue
  numbers ("issue" or "#" and a number): they mean nothing to a reader of the code. Another project's
  issue, named with its project (``pytorch issue 49207``, ``carolchenyx/MGFN issue 35``), is a
  source and stays. Nor does any file of the chart ("issue" and a number: its comments, the CRDs'
  descriptions, the dashboard's titles).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shlex
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Dict, Iterable, Iterator, List, Mapping, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]

# Where a path named in prose is looked for besides the repository root and the page's own
# folder: the docs name modules relative to the package (`contract/overhead.py`) and probe
# modules relative to the estimator (`probe/cuda_surface.py`).
PATH_BASES = ("", "src/xmem_admission", "src/xmem_admission/estimator",
              "src/xmem_admission/cluster", "helm/xmem-admission")
# Flags every command takes without listing them as its own.
ALWAYS = {"--help"}
PATH_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".json", ".jsonl", ".env", ".txt",
                 ".toml", ".tar", ".html", ".cfg", ".tpl")
METRIC_CLASSES = ("Counter", "Gauge", "Histogram", "Summary")

Command = Tuple[str, ...]


@dataclass(frozen=True)
class Page:
    """One documentation page: its path relative to the repository root, and its text."""

    path: str
    text: str


def pages(root: Path = ROOT) -> List[Page]:
    """README.md and every docs/*.md."""
    found = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [Page(str(p.relative_to(root)), p.read_text(encoding="utf-8")) for p in found]


# --- the CLI ---------------------------------------------------------------------------------

def cli_flags(parser: argparse.ArgumentParser, prefix: Command = ()) -> Dict[Command, Set[str]]:
    """Every command path of the parser (``()`` is ``xmem`` itself, ``("bench", "paper")`` a
    nested one) and the long flags its ``--help`` lists (``-h/--help`` left out)."""
    flags: Set[str] = set()
    commands: Dict[Command, Set[str]] = {prefix: flags}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands.update(cli_flags(sub, prefix + (name,)))
        elif not isinstance(action, argparse._HelpAction):
            flags.update(o for o in action.option_strings if o.startswith("--"))
    return commands


def code_snippets(text: str) -> Iterator[str]:
    """The texts of inline code spans and the logical lines of fenced code blocks (a line ending
    in a backslash continues on the next)."""
    in_block = False
    pending = ""
    prose: List[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            stripped = line.rstrip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            yield " ".join((pending + stripped).split())
            pending = ""
        else:
            prose.append(line)
    # Inline spans may wrap across lines of a paragraph.
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        yield " ".join(span.split())


def xmem_lines(text: str) -> Iterator[str]:
    """Every documented ``xmem ...`` command line: the words from ``xmem`` on (a leading
    ``.venv/bin/`` or ``$ `` is allowed), up to a ``#`` comment."""
    for snippet in code_snippets(text):
        match = re.match(r"\s*(?:\$\s+)?(?:\S*/)?xmem(\s.*)?$", snippet)
        if match:
            yield ("xmem" + (match.group(1) or "")).split(" #", 1)[0].strip()


def parse_line(line: str, commands: Iterable[Command]) -> Tuple[Command, List[str]]:
    """The command path and the flags of one documented ``xmem`` line. Words after a lone
    ``--`` (the training command of ``xmem estimate``) belong to another program."""
    known = set(commands)
    try:
        words = shlex.split(line.replace("\\|", "|"))[1:]
    except ValueError:
        words = line.split()[1:]
    path: Command = ()
    while words and path + (words[0],) in known:
        path += (words.pop(0),)
    flags: List[str] = []
    for word in words:
        if word == "--":
            break
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", word):
            flags.append(flag)
    return path, flags


def undocumented_or_unknown(cli: Mapping[Command, Set[str]],
                            docs: Sequence[Page]) -> Tuple[List[str], List[str]]:
    """(flags of ``--help`` that no documented line of their command shows, documented lines
    that name a command or flag that does not exist), each as readable strings."""
    shown: Dict[Command, Set[str]] = {c: set() for c in cli}
    unknown: List[str] = []
    for page in docs:
        for line in xmem_lines(page.text):
            path, flags = parse_line(line, cli)
            rest = line.split()[1 + len(path):]
            has_subcommands = any(c[:len(path)] == path and len(c) > len(path) for c in cli)
            # An upper-case word stands for any command (`xmem COMMAND --help`).
            if has_subcommands and rest and not rest[0].startswith("-") \
                    and not re.match(r"[A-Z][A-Z_.:-]*$", rest[0]):
                name = " ".join(("xmem",) + path + (rest[0],))
                unknown.append(f"{page.path}: `{line}`: no command `{name}`")
                continue
            for flag in flags:
                if flag in cli[path]:
                    shown[path].add(flag)
                elif flag in ALWAYS:
                    continue
                else:
                    name = " ".join(("xmem",) + path)
                    unknown.append(f"{page.path}: `{line}`: `{name}` has no flag {flag}")
    missing = [f"xmem {' '.join(c)} {flag}".replace("  ", " ")
               for c in sorted(cli) for flag in sorted(cli[c] - shown[c])]
    leaves = [c for c in cli if not any(len(o) > len(c) and o[:len(c)] == c for o in cli)]
    missing += [f"xmem {' '.join(c)} (never shown)" for c in sorted(leaves)
                if c and not _command_shown(c, docs, cli)]
    return missing, unknown


def _command_shown(command: Command, docs: Sequence[Page],
                   cli: Mapping[Command, Set[str]]) -> bool:
    return any(parse_line(line, cli)[0] == command
               for page in docs for line in xmem_lines(page.text))


# --- metrics ---------------------------------------------------------------------------------

def registered_metrics(sources: Iterable[Tuple[str, str]]) -> Dict[str, str]:
    """Each metric built with a literal name in the given (path, text) sources, as Prometheus
    exposes it (a Counter gains ``_total``), mapped to the file that registers it."""
    found: Dict[str, str] = {}
    pattern = re.compile(r"\b(" + "|".join(METRIC_CLASSES) + r")\(\s*[\"']([a-zA-Z_:][\w:]*)[\"']")
    for path, text in sources:
        if "prometheus_client" not in text:
            continue
        for kind, name in pattern.findall(text):
            if kind == "Counter" and not name.endswith("_total"):
                name += "_total"
            found[name] = path
    return found


def source_files(root: Path = ROOT) -> List[Tuple[str, str]]:
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8"))
            for p in sorted((root / "src").rglob("*.py"))]


def undocumented_metrics(metrics: Mapping[str, str], docs: Sequence[Page]) -> List[str]:
    """Metrics no page names in inline code by their exposed name."""
    named: Set[str] = set()
    for page in docs:
        for snippet in code_snippets(page.text):
            named.update(re.findall(r"[a-zA-Z_:][\w:]*", snippet))
    return [f"{name} (registered in {where})" for name, where in sorted(metrics.items())
            if name not in named]


# --- paths -----------------------------------------------------------------------------------

def named_paths(text: str) -> Iterator[str]:
    """Relative file and folder paths a page names: in code (a word with a ``/`` ending in a
    known file suffix or in ``/``) and as the target of a Markdown link."""
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target
    for snippet in code_snippets(text):
        for word in snippet.split():
            word = word.strip("\"'(),;:")
            if "/" not in word or word.startswith(("/", "~", "$", "-", ".venv", "http")) \
                    or re.search(r"[<>*{}\[\]=@]", word) or re.match(r"[A-Z]+[.\w]*/", word) \
                    or re.match(r"[a-z0-9-]+(\.[a-z0-9-]+)+/", word):  # a domain: xmem.io/...
                continue
            if word.endswith("/") or word.endswith(PATH_SUFFIXES):
                yield word


def missing_paths(docs: Sequence[Page], root: Path = ROOT) -> List[str]:
    """Paths named in the docs that exist neither from the repository root, nor from the page's
    folder, nor from the package's folders that prose names modules from."""
    missing: List[str] = []
    for page in docs:
        here = str(Path(page.path).parent)
        for path in sorted(set(named_paths(page.text))):
            bases = (here,) + PATH_BASES
            if not any((root / base / path).exists() for base in bases):
                missing.append(f"{page.path}: {path}")
    return missing


# --- pinned versions -------------------------------------------------------------------------

# How the docs name each component that a scripts/*-versions.env file pins, and its key there.
PINNED = {
    "Kubernetes": "KUBERNETES_VERSION", "kube-apiserver": "KUBERNETES_VERSION",
    "kubelet": "KUBERNETES_VERSION", "etcd": "ETCD_VERSION", "kwok": "KWOK_VERSION",
    "Kueue": "KUEUE_VERSION", "JobSet": "JOBSET_VERSION", "Trainer": "TRAINER_VERSION",
    "containerd": "CONTAINERD_VERSION", "training operator": "TRAINING_OPERATOR_VERSION",
    "cert-manager": "CERT_MANAGER_VERSION", "Prometheus Operator": "PROMETHEUS_OPERATOR_VERSION",
    "dra-example-driver": "DRA_DRIVER_VERSION",
}


def pinned_versions(root: Path = ROOT) -> Dict[str, str]:
    """Every ``KEY=VALUE`` line of ``scripts/*-versions.env``, the leading ``v`` dropped."""
    found: Dict[str, str] = {}
    for path in sorted((root / "scripts").glob("*-versions.env")):
        for line in path.read_text(encoding="utf-8").splitlines():
            match = re.match(r"([A-Z_]+)=v?(\S+)$", line.strip())
            if match:
                found[match.group(1)] = match.group(2)
    return found


def _sentences(text: str) -> Iterator[str]:
    """Sentences of a page, roughly: paragraphs and list items split after a full stop."""
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)", text):
        yield from re.split(r"(?<=[.!?])\s+(?=[A-Z`(*])", " ".join(block.split()))


def wrong_versions(docs: Sequence[Page], pins: Mapping[str, str]) -> List[str]:
    """Releases of a pinned component that the docs name and that are not the pin. A sentence
    that names a source file (``pkg/.../workload_controller.go, Kueue v0.17.0``) cites what that
    release's code says and is left alone."""
    names = "|".join(re.escape(n) for n in sorted(PINNED, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w-])(" + names + r")\*{0,2}\s+v?(\d+\.\d+\.\d+)(?![\w.]*\d)")
    wrong: List[str] = []
    for page in docs:
        for sentence in _sentences(page.text):
            if re.search(r"[\w-]/[\w./-]+\.(?:go|ya?ml)\b", sentence):
                continue
            for name, version in pattern.findall(sentence):
                pin = pins.get(PINNED[name])
                if pin is not None and version != pin:
                    wrong.append(f"{page.path}: {name} {version}, but scripts/*-versions.env "
                                 f"pins {PINNED[name]}=v{pin}")
    return wrong


# --- the chart's comments --------------------------------------------------------------------

CHART = ROOT / "helm" / "xmem-admission"
# What a chart comment may name besides files: upstream sources read at a release.
_CHART_PATH_SUFFIXES = tuple(s for s in PATH_SUFFIXES if s not in (".tar", ".html"))


def chart_comments(chart: Path = CHART) -> Iterator[Tuple[str, int, str]]:
    """(file, line, text) of every comment in the chart's YAML, templates and NOTES: ``# ...``
    and ``{{/* ... */}}``."""
    for path in sorted(chart.rglob("*")):
        if path.suffix not in (".yaml", ".yml", ".tpl", ".txt") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = re.search(r"(?:^|\s)#(.*)$", line)
            if comment:
                yield str(path.relative_to(chart.parent.parent)), number, comment.group(1)
            for text in re.findall(r"\{\{-?\s*/\*(.*?)(?:\*/|$)", line):
                yield str(path.relative_to(chart.parent.parent)), number, text


def chart_dead_links(chart: Path = CHART, root: Path = ROOT) -> List[str]:
    """Paths named in the chart's comments that exist neither from the repository root, nor
    from the commented file's folder, nor from the folders prose names modules from."""
    dead: List[str] = []
    for where, number, text in chart_comments(chart):
        here = (chart.parent.parent / where).parent
        for word in re.findall(r"[\w./-]+", text):
            word = word.strip(".,;:")
            if "/" not in word or not word.endswith(_CHART_PATH_SUFFIXES) \
                    or word.startswith("/") or re.match(r"[a-z0-9-]+(\.[a-z0-9-]+)+/", word):
                continue
            bases = [here, chart] + [root / base for base in PATH_BASES]
            if not any((base / word).exists() for base in bases):
                dead.append(f"{where}:{number}: {word}")
    return dead


# --- docs/architecture.md against the registries ---------------------------------------------

def map_entry(page: Page, name: str) -> str:
    """The text of one entry of the page's package map (``integrations/`` and its wrapped
    lines), whitespace folded; empty when the map has no such entry."""
    lines = page.text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"(\s*)" + re.escape(name) + r"\s+(\S)", line)
        if not match:
            continue
        column = match.start(2)
        entry = [line[column:]]
        for more in lines[i + 1:]:
            if len(more) - len(more.lstrip()) < column or not more.strip():
                break
            entry.append(more.strip())
        return " ".join(" ".join(entry).split())
    return ""


def listed(page: Page, name: str) -> List[str]:
    """The comma-separated list in the first parentheses of a package-map entry."""
    found = re.search(r"\(([^)]*)\)", map_entry(page, name))
    return [item.strip() for item in found.group(1).split(",")] if found else []


def stale_registry_lists(page: Page, kinds: Iterable[str],
                         backends: Iterable[str]) -> List[str]:
    """Where docs/architecture.md's ``integrations/`` and ``backends/`` lists differ from the
    registries, each way."""
    stale: List[str] = []
    for name, registry in (("integrations/", set(kinds)), ("backends/", set(backends))):
        shown = set(listed(page, name))
        if shown - registry:
            stale.append(f"{page.path}: {name} lists {sorted(shown - registry)}, "
                         "which the registry does not have")
        if registry - shown:
            stale.append(f"{page.path}: {name} does not list {sorted(registry - shown)}")
    return stale


# --- issue numbers in code comments ----------------------------------------------------------

CODE_FOLDERS = ("src", "localkube", "bench", "tests")
# An issue of another project, named with it right before the number: a source, not a history.
UPSTREAM = re.compile(r"(?:\S+/\S+|pytorch|kueue|kubernetes|jobset|trainer|cudnn|triton)\s*$",
                      re.IGNORECASE)
_ISSUE = re.compile(r"(?<![\w&/#])#\d+\b|\b[Ii]ssues?\s+#?\d+")
# Files allowed to cite an issue number; the list only shrinks (a file that no longer cites one
# fails the check until it leaves the list).
ISSUES_ALLOWED: AbstractSet[str] = frozenset()


def code_files(root: Path = ROOT) -> List[Tuple[str, str]]:
    """(path, text) of every Python file under src/, localkube/, bench/ and tests/."""
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8"))
            for folder in CODE_FOLDERS for p in sorted((root / folder).rglob("*.py"))]


def comments_and_docstrings(source: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of every comment (a run of comments on consecutive lines as one text, the
    line of its first) and every module, class and function docstring."""
    runs: List[Tuple[int, int, str]] = []  # (first line, last line, text)
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            line, text = token.start[0], token.string.lstrip("#").strip()
            if runs and runs[-1][1] == line - 1:
                runs[-1] = (runs[-1][0], line, runs[-1][2] + " " + text)
            else:
                runs.append((line, line, text))
        tree = ast.parse(source)
    except (tokenize.TokenError, SyntaxError):
        return
    for first, _, text in runs:
        yield first, text
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def issue_references(sources: Iterable[Tuple[str, str]],
                     allowed: AbstractSet[str] = frozenset()) -> List[str]:
    """This repository's issue numbers cited in comments and docstrings, outside ``allowed``."""
    found: List[str] = []
    for path, text in sources:
        if path in allowed or not _ISSUE.search(text):  # most files: nothing to tokenize
            continue
        for line, comment in comments_and_docstrings(text):
            for match in _ISSUE.finditer(comment):
                if UPSTREAM.search(comment[:match.start()]):
                    continue
                found.append(f"{path}:{line}: {' '.join(match.group(0).split())}")
    return found


_ISSUE_WORD = re.compile(r"\b[Ii]ssues?\s+#?\d+")


def chart_issue_references(chart: Path = CHART) -> List[str]:
    """This repository's issue numbers ("issue" and a number) anywhere in the chart's files:
    its comments, the CRDs' descriptions (``kubectl explain`` shows them) and the dashboard's
    titles. Another project's issue, named with it before the number on its line, is a source."""
    found: List[str] = []
    for path in sorted(p for p in chart.rglob("*") if p.is_file()):
        if path.suffix not in (".yaml", ".tpl", ".json", ".txt"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in _ISSUE_WORD.finditer(line):
                if not UPSTREAM.search(line[:match.start()]):
                    found.append(f"{path.relative_to(chart.parents[1])}:{number}: "
                                 f"{match.group(0)}")
    return found


# --- sentence length -------------------------------------------------------------------------

LONGEST_SENTENCE = 100
# Pages whose long sentences wait for the engineers at work in them; the list only shrinks.
LONG_SENTENCES_ALLOWED: AbstractSet[str] = frozenset()


def long_sentences(docs: Sequence[Page], allowed: AbstractSet[str] = frozenset(),
                   limit: int = LONGEST_SENTENCE) -> List[str]:
    """Sentences of the pages' prose (code blocks and table rows left out) of ``limit`` words or
    more, each with its word count and first words."""
    found: List[str] = []
    for page in docs:
        if page.path in allowed:
            continue
        prose = re.sub(r"```.*?```", "", page.text, flags=re.DOTALL)
        prose = "\n".join(line for line in prose.splitlines()
                          if not line.lstrip().startswith("|"))
        for sentence in _sentences(prose):
            words = sentence.split()
            if len(words) >= limit:
                found.append(f"{page.path}: {len(words)} words: {' '.join(words[:12])} ...")
    return found
