"""`xmem bench gpumemnet`: reading runs files, the fitted floor, leave-one-out scores, sampling,
and two rows of a local generator repository end to end (no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bench.yardsticks import gpumemnet as gmn
from xmem_admission.contract.errors import RunsFileError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20
CAPACITY = 40 * 1024 * MIB


def row(ident, family="mlp", measured_mib=1500, status="ok", arch="pyramid", commit="0" * 40,
        cli="python train.py --width 8", subset=None):
    return {"id": ident, "family": family, "subset": subset or f"{family}_step1",
            "batch_size": 4, "measured_peak_bytes": measured_mib * MIB, "status": status,
            "oom": True if status == "oom" else None,
            "measured_is_lower_bound": status == "oom", "arch": {"architecture": arch},
            "rebuild": {"script": {"commit": commit, "path": "train.py"}, "train_cli": cli}}


def write(tmp_path, lines):
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n", encoding="utf-8")
    return str(path)


def sim(ident, reserved_mib, seconds=2.0, oom=False):
    return {"id": ident, "peak_reserved_bytes": reserved_mib * MIB, "seconds": seconds,
            "simulated_oom": oom, "mode": "fake", "peak_allocated_bytes": reserved_mib * MIB,
            "breakdown": {}}


@pytest.mark.parametrize("bad,message", [
    ("not json", "not valid JSON"),
    ({**row("a"), "measured_peak_bytes": "1"}, "'measured_peak_bytes' must be int"),
    ({k: v for k, v in row("a").items() if k != "status"}, "missing field 'status'"),
    ({**row("a"), "rebuild": {"script": {"path": "x.py"}, "train_cli": "python x.py"}},
     "missing field 'rebuild.script.commit'"),
    ({**row("a"), "rebuild": {"script": {"commit": "0" * 40, "path": "x.py"},
                              "train_cli": "  "}}, "rebuild.train_cli is empty"),
])
def test_malformed_rows_are_rejected_with_line_number_and_reason(tmp_path, bad, message):
    path = write(tmp_path, [row("first"), bad])
    with pytest.raises(RunsFileError, match=rf":2: .*{message}"):
        gmn.load_runs(path)


def test_a_duplicate_id_is_rejected(tmp_path):
    with pytest.raises(RunsFileError, match="duplicate id 'a'"):
        gmn.load_runs(write(tmp_path, [row("a"), row("a")]))


def test_the_floor_is_the_median_residual_of_the_mlp_rows_that_did_not_oom(tmp_path):
    rows = gmn.load_runs(write(tmp_path, [
        row("m1", measured_mib=1500), row("m2", measured_mib=1510), row("m3", measured_mib=1530),
        row("c1", family="cnn", measured_mib=9000),
        row("c2", family="cnn", measured_mib=38000, status="oom")]))
    sims = {"m1": sim("m1", 70), "m2": sim("m2", 70), "m3": sim("m3", 70),
            "c1": sim("c1", 5000), "c2": sim("c2", 30000)}
    # residuals 1430, 1440, 1460 MiB; the CNN and the OOM row do not count
    assert gmn.fit_floor(rows, sims) == 1440 * MIB


def test_each_row_is_scored_with_the_floor_fitted_on_the_other_rows(tmp_path):
    rows = gmn.load_runs(write(tmp_path, [
        row("m1", measured_mib=1500), row("m2", measured_mib=1510),
        row("m3", measured_mib=1530), row("m4", measured_mib=2000)]))
    sims = {r.id: sim(r.id, 70) for r in rows}
    answers = gmn.leave_one_out(rows, sims, CAPACITY)
    # m4's own large residual (1930) does not lift its floor: median of 1430, 1440, 1460
    assert answers["m4"]["floor_bytes"] == 1440 * MIB
    assert answers["m4"]["estimate_bytes"] == (70 + 1440) * MIB
    # m1's floor comes from m2, m3, m4
    assert answers["m1"]["floor_bytes"] == 1460 * MIB


def test_a_row_whose_estimate_exceeds_the_a100_is_predicted_to_oom(tmp_path):
    rows = gmn.load_runs(write(tmp_path, [
        row("m1", measured_mib=1500), row("m2", measured_mib=1500),
        row("c1", family="cnn", measured_mib=39000, status="oom"),
        row("c2", family="cnn", measured_mib=20000)]))
    sims = {"m1": sim("m1", 70), "m2": sim("m2", 70), "c1": sim("c1", 39600),
            "c2": sim("c2", 17000)}
    answers = gmn.leave_one_out(rows, sims, CAPACITY)
    assert answers["c1"]["predicted_oom"] is True
    assert answers["c2"]["predicted_oom"] is False
    assert gmn.leave_one_out(rows, {**sims, "c2": sim("c2", 100, oom=True)},
                             CAPACITY)["c2"]["predicted_oom"] is True


def test_scores_count_errors_on_rows_that_fit_and_oom_agreement_on_oom_rows(tmp_path):
    rows = gmn.load_runs(write(tmp_path, [
        row("a", measured_mib=1000), row("b", measured_mib=2000), row("c", measured_mib=4000),
        row("d", measured_mib=39000, status="oom"), row("e", measured_mib=38000, status="oom")]))
    answers = {
        "a": {"estimate_bytes": 1100 * MIB, "predicted_oom": False, "seconds": 1.0},
        "b": {"estimate_bytes": 1800 * MIB, "predicted_oom": False, "seconds": 3.0},
        "c": {"estimate_bytes": 4000 * MIB, "predicted_oom": True, "seconds": 5.0},
        "d": {"estimate_bytes": 41000 * MIB, "predicted_oom": True, "seconds": 7.0},
        "e": {"estimate_bytes": 30000 * MIB, "predicted_oom": False, "seconds": 9.0},
    }
    s = gmn.score("all", rows, answers)
    assert s.n == 3
    assert s.median == pytest.approx(0.10)
    assert s.under == pytest.approx(1 / 3)
    assert (s.oom_rows, s.oom_predicted_to_fit, s.fit_predicted_oom) == (2, 1, 1)
    assert s.seconds == 5.0


def test_a_sample_covers_every_stratum_and_is_the_same_each_time(tmp_path):
    lines = ([row(f"m{i}", measured_mib=1500 + i) for i in range(20)]
             + [row(f"p{i}", family="cnn", arch="pyramid") for i in range(10)]
             + [row(f"q{i}", family="cnn", arch="pyramid", status="oom") for i in range(10)]
             + [row(f"d{i}", family="cnn", arch="dense") for i in range(10)])
    rows = gmn.load_runs(write(tmp_path, lines))
    first = [r.id for r in gmn.stratified_sample(rows, 8)]
    assert first == [r.id for r in gmn.stratified_sample(rows, 8)]
    assert {i[0] for i in first} == {"m", "p", "q", "d"}
    assert sum(i.startswith("m") for i in first) == 2


# -- end to end: a generator repository of our own, two commits -------------------------------
TRAIN_V1 = textwrap.dedent("""\
    import argparse
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, 10)).to(device)
    opt = torch.optim.Adam(model.parameters())
    for _ in range(5):
        x = torch.randn(32, 64).type(torch.cuda.FloatTensor)
        y = torch.randint(0, 10, (32,)).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    """)


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def generator_repo(tmp_path):
    repo = tmp_path / "generators"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text(TRAIN_V1, encoding="utf-8")
    git(repo, "add", "train.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v1")
    first = git(repo, "rev-parse", "HEAD")
    # the second commit adds a hidden layer: a row of the first commit must not see it
    (repo / "train.py").write_text(TRAIN_V1.replace(
        "torch.nn.Linear(args.width, 10)",
        "torch.nn.Linear(args.width, args.width), torch.nn.Linear(args.width, 10)"),
        encoding="utf-8")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "v2")
    return repo, first, git(repo, "rev-parse", "HEAD")


@pytest.mark.slow
def test_rows_of_two_commits_run_from_their_checkouts_and_write_one_line_each(tmp_path):
    repo, first, second = generator_repo(tmp_path)
    runs = write(tmp_path, [
        row("old", commit=first, cli="python train.py --width 4096", measured_mib=1480),
        row("new", commit=second, cli="python train.py --width 4096", measured_mib=1600)])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "gpumemnet",
                           "--runs", runs, "--repo", str(repo), "--out", str(out),
                           "--explain", "new"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"old", "new"}
    for line in lines.values():
        assert {"id", "estimate_bytes", "predicted_oom", "seconds"} <= set(line)
        assert line["predicted_oom"] is False
    # v2's extra 4096x4096 fp32 layer: weights, gradients and Adam's two states, 256 MiB
    grown = lines["new"]["peak_reserved_bytes"] - lines["old"]["peak_reserved_bytes"]
    assert grown >= 4 * 4096 * 4096 * 4
    assert "family mlp" in proc.stdout
    assert "new (mlp pyramid, batch 4)" in proc.stdout
    assert os.path.isdir(str(repo) + "-worktrees/" + first)


def test_a_folder_that_is_not_a_git_clone_is_a_clear_error(tmp_path):
    runs = write(tmp_path, [row("a"), row("b")])
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "gpumemnet",
                           "--runs", runs, "--repo", str(tmp_path), "--out",
                           str(tmp_path / "o.jsonl")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a git clone" in proc.stderr
    assert "Traceback" not in proc.stderr


def steps_trace(last_step_extra_mib):
    from xmem_admission.estimator.trace import Trace

    t = Trace()
    for step in (1, 2, 3):
        size = 64 + (last_step_extra_mib if step == 3 else 0)
        t.alloc(step, size * MIB, category="activation", phase="forward")
        t.free(step)
        t.mark(f"step {step}")
    return t


def test_a_pool_that_grows_in_the_last_traced_step_is_flagged_and_a_steady_one_is_not():
    assert gmn.growth_in_last_step(steps_trace(0)) == 0
    assert gmn.growth_in_last_step(steps_trace(100)) >= 100 * MIB


def test_the_conv_rule_fit_counts_missed_ooms_and_under_estimates_beyond_15_percent(tmp_path):
    from bench.fits import fit_conv_workspace as fit

    rows = gmn.load_runs(write(tmp_path, [row(f"c{i}", family="cnn", measured_mib=1000)
                                          for i in range(10)]
                               + [row("o", family="cnn", measured_mib=39000, status="oom")]))
    fits = {f"c{i}": {"estimate_bytes": 1100 * MIB, "predicted_oom": False} for i in range(10)}
    fits["o"] = {"estimate_bytes": 41000 * MIB, "predicted_oom": True}
    assert fit.loss(rows, fits) == pytest.approx(0.10)
    # three of ten under (30%): 15 points over the allowance
    under = dict(fits, **{f"c{i}": {"estimate_bytes": 900 * MIB, "predicted_oom": False}
                          for i in range(3)})
    assert fit.loss(rows, under) == pytest.approx(0.10 + 0.15)
    missed = dict(fits, o={"estimate_bytes": 30000 * MIB, "predicted_oom": False})
    assert fit.loss(rows, missed) == pytest.approx(1.10)
