"""Replaces itself with a launcher found on PATH (os.execvpe), as a tool's own command starts
``accelerate launch``: torchrun, two ranks of examples/train_gpt.py under DDP."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GPT = os.path.join(HERE, "..", "..", "..", "examples", "train_gpt.py")
env = dict(os.environ,
           PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
os.execvpe("torchrun", ["torchrun", "--nproc-per-node", "2", GPT, "--parallel", "ddp",
                        "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
                        "--seq-len", "32", "--batch-size", "2"], env)
