"""``xmem estimate --report``'s page, opened as a person would: in headless Chromium (Debian's
package, installed by scripts/install-tools.sh). The page records script errors through
``window.onerror`` and marks ``<body data-drawn="yes">`` only once its script drew everything;
the DOM is read back with ``--dump-dom``, and a screenshot is kept under build/test-artifacts/."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xmem_admission.contract import gpus as catalogue
from xmem_admission.estimator import peak, report
from xmem_admission.estimator.estimate import Estimate, allocator_config, estimate_trace
from xmem_admission.estimator.trace import Trace

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("XMEM_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
GPUS = [catalogue.lookup("H100-80GB"), catalogue.lookup("A100-40GB"), catalogue.lookup("L4")]


def _chromium() -> str:
    for candidate in (REPO / ".tools" / "bin" / "chromium", shutil.which("chromium")):
        if candidate and os.access(str(candidate), os.X_OK):
            return str(candidate)
    pytest.skip("no chromium: scripts/install-tools.sh installs Debian's package")


def _browse(page: Path, *flags: str) -> str:
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--virtual-time-budget=10000", "--window-size=1400,2400", *flags,
                           page.as_uri()], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _report(probe_run, script, tmp_path: Path):
    result, _ = probe_run([script("tiny_mlp.py"), "--batch", "256", "--hidden", "512"], "fake")
    trace = result.trace
    config = allocator_config(None, trace.meta.get("torch"))
    gpus = estimate_trace(trace, GPUS, config)
    est = Estimate(mode="fake", steps=result.steps, seconds=1.0, gpus=gpus,
                   torch=str(trace.meta.get("torch")))
    peaks = peak.explain(trace, GPUS, config)
    explained = peak.Explained(peaks, peak.alternatives(trace, gpus, config, 0.05, peaks,
                                                        everywhere=False))
    path = tmp_path / "report.html"
    report.write(str(path), trace, est, explained, config, "xmem estimate -- python tiny_mlp.py")
    return path, est, explained


def test_the_report_draws_without_errors_and_shows_the_peak_and_every_request(
        probe_run, script, tmp_path):
    path, est, explained = _report(probe_run, script, tmp_path)
    text = path.read_text()
    assert "<script src" not in text and "<link" not in text and "http" not in text
    dom = _browse(path, "--dump-dom")
    assert re.search(r'<body data-drawn="yes"', dom), dom[:400]
    assert not re.search(r"<html[^>]*data-errors", dom)
    largest = explained.peaks[0].largest
    assert largest is not None
    assert f"<td>{peak.display_module(largest.module)}</td><td>{largest.category}</td>" in dom
    for g in est.gpus:
        assert f"<td>{g.gpu}</td>" in dom
        assert f"{g.recommended_request_bytes / 2**30:.2f} GiB" in dom
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report.png"
    _browse(path, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_a_script_error_in_the_page_is_caught_and_drawing_never_finishes(
        probe_run, script, tmp_path):
    path, _est, _explained = _report(probe_run, script, tmp_path)
    broken = tmp_path / "broken.html"
    broken.write_text(path.read_text().replace("var D=JSON.parse", "var D=JSON.parsf", 1))
    dom = _browse(broken, "--dump-dom")
    assert 'data-drawn="no"' in dom
    assert re.search(r'<html[^>]*data-errors="[^"]*JSON\.parsf is not a function', dom), \
        dom[:600]


def _synthetic(events: int) -> Trace:
    """A trace of ``events`` allocations and frees whose live set saw-tooths, one large block
    alone at the peak."""
    trace = Trace(meta={"torch": "2.14.1"})
    live = []
    ident = 0
    for i in range(events // 2):
        ident += 1
        size = (1 << 20) * (1 + i % 7)
        phase = ("forward", "backward", "optimizer")[(i // 2000) % 3]
        trace.alloc(ident, size, 0, "activation", phase, f"Net.blocks.{i % 12}", "aten.mm")
        live.append(ident)
        if len(live) > 64:
            trace.free(live.pop(0))
        if i == events // 4:
            trace.alloc(10**9, 8 << 30, 0, "temporary", "backward", "Net.head", "aten.bmm")
            trace.free(10**9)
    return trace


def test_the_page_stays_the_same_size_for_ten_times_the_events_and_keeps_the_peak():
    config = allocator_config(None, "2.14.1")
    gpu = catalogue.lookup("H100-80GB")
    sizes = []
    for events in (20_000, 200_000):
        trace = _synthetic(events)
        [est] = estimate_trace(trace, [gpu], config)
        line = report.timeline(trace, gpu, config)
        assert line["reserved"][line["peak"]] == est.peak_reserved_bytes
        assert "8,192.0 MiB temporary in Net.head by aten.bmm" == line["labels"][line["peak"]]
        assert len(line["x"]) <= report.POINTS + 1
        sizes.append(len(str(line)))
    assert sizes[1] < 1.3 * sizes[0]
