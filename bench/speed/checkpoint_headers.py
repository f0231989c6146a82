"""Probe time and memory against checkpoint size: LoRA fine-tunes of 0.83B to 8B Llamas.

The checkpoints (0.83B; Llama-3-8B's widths at 16 layers, 4.5B; Llama-3-8B) are sparse
safetensors files (headers written, data holes), sharded as ``save_pretrained`` shards them, with
a tiny tokenizer; ``tests/finetune/scripts/checkpoint_lora.py`` loads each with
``from_pretrained`` and ``xmem estimate`` traces it in fake mode with the fine-tuning stack's
torch environment (``NEWEST``). Printed per checkpoint: its parameters and logical size, the
script's own timing of ``from_pretrained`` under the probe, the probe's seconds and peak RSS (from
the estimate's JSON), the parameters the estimate put on the GPU, and how many of the
checkpoint's data pages were in the page cache afterwards (dropped before; 0 when only the
headers were read).

Usage: ``.venv/bin/python bench/speed/checkpoint_headers.py [--repeat N] [--seq-len L]``
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.finetune import conftest  # noqa: E402
from tests.finetune.test_checkpoints_are_never_read import (  # noqa: E402
    LLAMA3_8B,
    data_pages_read,
    drop_from_page_cache,
    estimate_and_log,
    parameter_bytes,
    shards,
    sparse_llama,
)
from tests.support.torch_envs import NEWEST  # noqa: E402

# The 0.83B shape the fine-tuning benchmark uses (tests/finetune/conftest.py, SHAPES["bench"]).
LLAMA_083B = {**LLAMA3_8B, **conftest.SHAPES["bench"], "rope_theta": 10000.0}
# Llama-3-8B's widths at the 0.83B's depth (16 layers, 4.54B parameters): the probe's time
# follows the ops it traces (layers), its memory neither.
LLAMA3_16_LAYERS = {**LLAMA3_8B, "num_hidden_layers": 16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xmem-ckpt-bench-") as tmp:
        work = Path(tmp)
        tokenizer = conftest.make(work / "tiny", "tiny", NEWEST.interpreter)
        cases = [("Llama 0.83B", sparse_llama(work / "0.83b", LLAMA_083B, tokenizer, 1),
                  work / "0.83b"),
                 ("Llama-3 widths, 16 layers",
                  sparse_llama(work / "16l", LLAMA3_16_LAYERS, tokenizer, 2), work / "16l"),
                 ("Llama-3 8B", sparse_llama(work / "8b", LLAMA3_8B, tokenizer, 4), work / "8b")]
        print("| checkpoint | parameters | logical size | from_pretrained s | probe s | "
              "probe RSS GiB | parameters on the GPU | data pages read |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, weights, folder in cases:
            seconds, loading, rss, pages, on_gpu = [], [], [], 0, 0
            for _ in range(options.repeat):
                for shard in shards(folder):
                    drop_from_page_cache(shard)
                result, log = estimate_and_log(
                    "checkpoint_lora.py", "--model", str(folder), "--steps", "2",
                    "--batch-size", "1", "--seq-len", str(options.seq_len))
                assert result["mode"] == "fake", result
                seconds.append(result["probe_seconds"])
                loading.append(float(re.findall(r"from_pretrained: ([0-9.]+) s", log)[-1]))
                rss.append(result["probe_peak_rss_bytes"] / 2**30)
                on_gpu = parameter_bytes(result)
                pages += sum(len(data_pages_read(s)) for s in shards(folder))
            size = sum(s.stat().st_size for s in shards(folder))
            print(f"| {label} | {weights // 2:,} | {size / 1e9:.2f} GB | "
                  f"{statistics.median(loading):.2f} | {statistics.median(seconds):.1f} | "
                  f"{statistics.median(rss):.2f} | "
                  f"{on_gpu / 1e9:.2f} GB | {pages} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
