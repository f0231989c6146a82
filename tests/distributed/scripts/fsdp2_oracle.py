"""torch's own FSDP2 memory tracker (torch.distributed._tools.fsdp2_mem_tracker) over the model of
fsdp2_gpt.py, in one process with the same fake process group, on the host: the independent
oracle for the probe's trace of that script. Prints one JSON line: the peak bytes of live
tensors over the training steps, and the last step's peak by the tracker's kinds.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_gpt import build, make_optimizer, parser  # noqa: E402

parser.add_argument("--world-size", type=int, required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
init_device_mesh("cpu", (args.world_size,))
model = build(args, "cpu")
optimizer = make_optimizer(args, model)
tracker = FSDPMemTracker(model, optimizer)
peaks, kinds = [], {}
with tracker:
    for _ in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq))
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, args.vocab), idx.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The tracker follows one iteration at a time (reset_mod_stats between them).
        peaks.append(max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))
        kinds = {k.name if hasattr(k, "name") else str(k): v
                 for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items()}
        tracker.reset_mod_stats()
print(json.dumps({"peak_bytes": max(peaks), "per_step": peaks, "last_peak_by_kind": kinds}))
dist.destroy_process_group()
