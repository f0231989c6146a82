"""What a program can tell about the docs being true (README.md and docs/*.md).

Four checks, each a pure function over texts so that a test can run it on a doctored page:

- every ``xmem ...`` command line the docs show (inline code or a code block) names a command
  that exists and only flags that command's ``--help`` has;
- every flag of every command's ``--help`` appears in some documented ``xmem ...`` line of that
  same command (``docs/cli.md`` has one synopsis per command);
- every Prometheus metric the code registers (a ``Counter``/``Gauge``/``Histogram``/``Summary``
  built with a literal name anywhere under ``src/``) is named, as Prometheus exposes it, in the
  docs;
- every relative path the docs name (in inline code, a code block or a link) exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Sequence, Set, Tuple

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
