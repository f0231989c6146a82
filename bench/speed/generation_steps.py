"""What text generation costs the probe in fake mode, token by token: TRL's GRPO job
(``tests/finetune/scripts/trl_grpo.py``, 4 completions a step) traced by the probe with every
traced sampling step of ``model.generate`` timed, at each completion length asked for.

Printed per completion length: the probe's seconds, CPU seconds and peak RSS; per generation
(one per optimizer step), its sampling steps traced and written from the traced ones
(``probe/generation_steps.py``) and the CPU seconds the writing took, CPU and wall seconds, the
CPU of a traced sampling step in each quarter of the traced ones (a cost that grows with the
token index shows as rising quarters) and the trace events a traced step adds.
``--every-step`` traces every sampling step (``XMEM_TRACE_EVERY_GENERATION_STEP=1``).

    .venv/bin/python bench/speed/generation_steps.py [--checkpoint tiny|bench|DIR] [--tokens 16,64]
        [--every-step]

``tiny`` is the tests' checkpoint (2 layers, hidden 64), ``bench`` the fine-tuning matrix's 0.85B
one (16 layers, hidden 2048; ``bench/coverage/finetune_matrix.py``), made once into
``~/.cache/xmem-admission/finetune-bench/``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.finetune import conftest  # noqa: E402
from tests.support.torch_envs import NEWEST  # noqa: E402

CACHE = Path.home() / ".cache" / "xmem-admission" / "finetune-bench"
CHECKPOINTS = {"tiny": CACHE / "llama-tiny", "bench": CACHE / "llama-0.83b"}
H200 = ('{"name": "NVIDIA H200", "total_memory": 150109945856, "compute_capability": [9, 0], '
        '"multi_processor_count": 132}')

# Run in the probe's interpreter: the probe's runner, with generate() and every sampling step
# (transformers' LogitsProcessorList call, patched by the probe's generation module) timed.
DRIVER = """
import json, runpy, sys, time
from xmem_admission.estimator.probe import generation, generation_steps
log = []
write = generation_steps.Loop._write
def timed_write(self, rule, last, jump, plan):
    log.append(("write", time.perf_counter(), time.process_time(), jump))
    write(self, rule, last, jump, plan)
    log.append(("written", time.perf_counter(), time.process_time(), jump))
generation_steps.Loop._write = timed_write
def timed(patch, kind):
    def install(patches, tracker, state, module):
        patch(patches, tracker, state, module)
        cls = getattr(module, "GenerationMixin" if kind == "generate" else "LogitsProcessorList")
        name = "generate" if kind == "generate" else "__call__"
        inner = getattr(cls, name)
        def call(*args, **kwargs):
            log.append((kind, time.perf_counter(), time.process_time(), len(tracker.trace.events)))
            try:
                return inner(*args, **kwargs)
            finally:
                if kind == "generate":
                    log.append(("end", time.perf_counter(), time.process_time(), 0))
        setattr(cls, name, call)
    return install
generation._patch_generation = timed(generation._patch_generation, "generate")
generation._patch_logits = timed(generation._patch_logits, "step")
out = sys.argv.pop(1)
try:
    runpy.run_module("xmem_admission.estimator.probe.runner", run_name="__main__", alter_sys=True)
finally:
    with open(out, "w") as fh:
        json.dump(log, fh)
"""


PARSER = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
PARSER.add_argument("--tokens", default="16,64", help="completion lengths, comma-separated")
PARSER.add_argument("--checkpoint", default="tiny", help="tiny, bench or a folder")
PARSER.add_argument("--every-step", action="store_true", help="trace every sampling step")


def generations(log: List[list]) -> List[List[list]]:
    """The log split per generate() call: its start, its sampling steps and writes, its end."""
    found, current = [], []
    for entry in log:
        if entry[0] == "generate":
            current = [entry]
        elif entry[0] == "end":
            found.append(current + [entry])
        else:
            current.append(entry)
    return found


def report(tokens: int, log: List[list], result: dict, cpu: float) -> None:
    print(f"{tokens} completion tokens: probe {result['seconds']:.1f} s, {cpu:.1f} s CPU, peak RSS "
          f"{result['peak_rss_bytes'] / 2**30:.2f} GiB, status {result['status']}, trace events "
          f"{len(result['trace']['events']) if result.get('trace') else 0:,}")
    for index, gen in enumerate(generations(log)):
        steps = [entry for entry in gen if entry[0] == "step"]
        writes = [entry for entry in gen if entry[0] in ("write", "written")]
        written = sum(entry[3] for entry in writes if entry[0] == "write")
        write_cpu = sum(b[2] - a[2] for a, b in zip(writes[::2], writes[1::2]))
        pairs = [(a, b) for a, b in zip(steps, steps[1:])
                 if not any(a[1] <= w[1] <= b[1] for w in writes)]
        cpu_steps = [b[2] - a[2] for a, b in pairs]
        quarter = max(1, len(cpu_steps) // 4)
        quarters = [cpu_steps[k * quarter:(k + 1) * quarter] for k in range(4)]
        per_step = " ".join(f"{1000 * sum(q) / len(q):.0f}" for q in quarters if q)
        events = sum(b[3] - a[3] for a, b in pairs) / max(1, len(pairs))
        cpu_total, wall_total = gen[-1][2] - gen[0][2], gen[-1][1] - gen[0][1]
        print(f"  generation {index}: {len(steps)} sampling steps traced, {written} written "
              f"({write_cpu:.2f} s CPU), {cpu_total:.1f} s CPU, {wall_total:.1f} s wall; ms CPU "
              f"per traced step by quarter: {per_step}; {events:.0f} trace events per step")


def main(argv: List[str]) -> None:
    """Trace the GRPO job at each completion length asked for and print what it cost."""
    options = PARSER.parse_args(argv)
    folder = CHECKPOINTS.get(options.checkpoint, Path(options.checkpoint))
    if options.checkpoint in CHECKPOINTS and not (folder / "model.safetensors").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        conftest.make(folder, options.checkpoint, NEWEST.interpreter)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {folder}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("XMEM_TRACE_EVERY_GENERATION_STEP", None)
    if options.every_step:
        env["XMEM_TRACE_EVERY_GENERATION_STEP"] = "1"
    for tokens in (int(t) for t in options.tokens.split(",")):
        with tempfile.TemporaryDirectory(prefix="generation-steps-") as tmp:
            log_path, out = os.path.join(tmp, "steps.json"), os.path.join(tmp, "result.json")
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([NEWEST.interpreter, "-c", DRIVER, log_path, "--out", out,
                            "--device-json", H200, "--", "python",
                            str(ROOT / "tests" / "finetune" / "scripts" / "trl_grpo.py"),
                            "--model", str(folder), "--batch-size", "4",
                            "--seq-len", str(2 * tokens)],
                           env=env, cwd=tmp, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            with open(log_path) as fh, open(out) as result:
                report(tokens, json.load(fh), json.load(result), cpu)


if __name__ == "__main__":
    main(sys.argv[1:])
