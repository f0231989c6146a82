"""One training script per way of putting a model and its data on the GPU (``--idiom NAME``).

Each idiom is written as scripts in the wild write it; the model, the optimizer and the loop are
the same for all, so the GPU memory of parameters, gradients and optimizer state is the same.
``--host-only`` keeps the model on the host (a script that forgot to move it): the probe must
refuse to call that a GPU job.
"""

import argparse
import os
import tempfile

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--idiom", required=True)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--host-only", action="store_true")
parser.add_argument("--leave-on-host", default="")
args = parser.parse_args()
H = args.hidden


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.norm = nn.LayerNorm(4 * H)
        self.fc2 = nn.Linear(4 * H, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make_example(i):
    return torch.full((H,), float(i)), torch.tensor(i % 10)


class Examples(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return make_example(i)


def batch(device):
    if idiom == "pool":
        return (torch.stack([x for x, _ in prepared]).to(device),
                torch.stack([y for _, y in prepared]).to(device))
    if idiom == "loader_workers":
        x, y = next(iter(loader))
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return torch.randn(16, H, device=device), torch.randint(0, 10, (16,), device=device)


idiom = args.idiom
if idiom == "to_string":
    device = "cuda"
    model = Net().to(device)
elif idiom == "to_device_keyword":  # timm's train.py: model.to(device=device)
    device = torch.device("cuda")
    model = Net()
    model.to(device=device)
elif idiom == "to_device_index":
    device = torch.device("cuda", 0)
    model = Net().to(device)
elif idiom == "to_other_tensor":
    anchor = torch.zeros(1, device="cuda")
    device = anchor.device
    model = Net().to(anchor)
elif idiom == "cuda_index":
    device = "cuda:0"
    model = Net().cuda(0)
elif idiom == "factory_device":
    device = "cuda"

    class FactoryNet(Net):
        def __init__(self):
            nn.Module.__init__(self)
            self.fc1 = nn.Linear(H, 4 * H, device="cuda")
            self.norm = nn.LayerNorm(4 * H, device="cuda")
            self.fc2 = nn.Linear(4 * H, 10, device="cuda")

    model = FactoryNet()
elif idiom == "set_default_device":
    torch.set_default_device("cuda")
    device = None
    model = Net()
elif idiom == "device_context":
    device = "cuda"
    with torch.device("cuda"):
        model = Net()
elif idiom == "to_empty":
    device = "cuda"
    with torch.device("meta"):
        model = Net()
    model = model.to_empty(device="cuda")
elif idiom == "load_state_dict_assign":
    device = "cuda"
    path = os.path.join(tempfile.mkdtemp(), "init.pt")
    torch.save(Net().state_dict(), path)
    with torch.device("meta"):
        model = Net()
    model.load_state_dict(torch.load(path, map_location="cuda"), assign=True)
elif idiom == "load_callable":  # older examples: map_location=lambda s, loc: s.cuda(gpu)
    device = "cuda"
    path = os.path.join(tempfile.mkdtemp(), "init.pt")
    torch.save(Net().state_dict(), path)
    model = Net().cuda()
    model.load_state_dict(torch.load(path, map_location=lambda storage, loc: storage.cuda(0)))
elif idiom == "local_rank":  # torchrun-style: LOCAL_RANK picks the device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}"
    model = Net().to(device)
elif idiom == "legacy_type":  # torchsummary: torch.cuda.FloatTensor as a type
    device = "cuda"
    model = Net().type(torch.cuda.FloatTensor)
elif idiom == "pool":  # data prepared in worker processes, returned through a pickle
    import multiprocessing

    device = "cuda"
    model = Net().to(device)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        prepared = pool.map(make_example, range(16))
elif idiom == "loader_workers":
    device = "cuda"
    model = Net().to(device)
    loader = torch.utils.data.DataLoader(Examples(), batch_size=16, num_workers=2,
                                         pin_memory=True, persistent_workers=True)
else:
    raise SystemExit(f"unknown idiom {idiom}")

if args.host_only:
    model = Net()
if args.leave_on_host:
    getattr(model, args.leave_on_host).to("cpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    if idiom == "legacy_type":
        x = torch.randn(16, H).type(torch.cuda.FloatTensor)
        y = torch.randint(0, 10, (16,)).type(torch.cuda.LongTensor)
    else:
        x, y = batch(device)
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} x on {x.device} weight on {model.fc1.weight.device}")
