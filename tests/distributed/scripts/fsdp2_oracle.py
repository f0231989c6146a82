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

# torch 2.6's host stream (torch.cpu.Stream) has only wait_stream, where FSDP2 records and waits
# on events between its all-gather streams (_fsdp_collectives.foreach_all_gather): the host runs
# each op when it is called, so an event there is already complete. Stream order decides
# nothing the tracker counts (it counts live tensors).
if not hasattr(torch.cpu.Stream, "record_event"):
    class _HostEvent:
        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    torch.cpu.Stream.record_event = lambda self, event=None: event or _HostEvent()
    torch.cpu.Stream.wait_event = lambda self, event: None

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
