"""A model whose forward slices its own buffers, as BERT's embeddings do: non-persistent int64
buffers of every position (``arange(n).expand((1, -1))``) and token type (zeros), cut to the
batch's sequence length on every call. A slice is a view: it allocates nothing on a GPU."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--positions", type=int, default=128)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()


class Embeddings(nn.Module):
    def __init__(self, positions: int, hidden: int = 32) -> None:
        super().__init__()
        self.words = nn.Embedding(100, hidden)
        self.places = nn.Embedding(positions, hidden)
        self.kinds = nn.Embedding(2, hidden)
        self.head = nn.Linear(hidden, 3)
        self.register_buffer("position_ids", torch.arange(positions).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(),
                                                           dtype=torch.long), persistent=False)

    def forward(self, ids):
        n = ids.shape[1]
        places = self.position_ids[:, :n]
        kinds = self.token_type_ids[:, :n].expand(ids.shape[0], n)
        x = self.words(ids) + self.places(places) + self.kinds(kinds)
        return self.head(x).mean(dim=1)


model = Embeddings(args.positions).to("cuda")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    ids = torch.randint(0, 100, (8, args.seq_len), device="cuda")
    loss = model(ids).logsumexp(dim=1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
