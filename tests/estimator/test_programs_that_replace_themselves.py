"""A training command that replaces itself (``os.exec*``) with the program that trains, as
``axolotl train cfg.yml`` execs ``accelerate launch -m axolotl.cli.train cfg.yml``: the probe
traces the new program in its own process, with the environment the exec gave it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def environment_kept():
    """The exec replaces this process's environment, as it would the real process's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_launcher_a_program_execs_is_traced_as_its_rank_0(probe_run, script, environment_kept):
    result, _ = probe_run([script("execs_launcher.py")])
    assert result.status == "ok", result.reason
    assert result.steps == 3
    assert result.trace.meta["distributed"]["world_size"] == 2
    assert os.environ["XMEM_TEST_REPLACED"] == "yes" and os.environ["LOCAL_RANK"] == "0"


def test_a_program_that_execs_a_program_not_in_python_is_refused(probe_run, script,
                                                                 environment_kept):
    result, _ = probe_run([script("execs_a_binary.py")])
    assert result.status == "unsupported"
    assert "replaces itself (os.exec) with /bin/true, which is not a Python program" in (
        result.reason)
