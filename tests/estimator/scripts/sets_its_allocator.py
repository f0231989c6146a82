"""Sets its own allocator settings before its first GPU tensor, as Axolotl's CLI does
(``PYTORCH_ALLOC_CONF=expandable_segments:True``), then trains tiny_mlp.py's model. The first
argument names the variable (torch before 2.10 reads only ``PYTORCH_CUDA_ALLOC_CONF``)."""

import os
import runpy
import sys

os.environ.setdefault(sys.argv[1] if len(sys.argv) > 1 else "PYTORCH_ALLOC_CONF",
                      "expandable_segments:True")
sys.argv = [sys.argv[0], "--hidden", "640", "--batch", "96"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_mlp.py"),
               run_name="__main__")
