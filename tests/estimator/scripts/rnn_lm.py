"""An RNN language model trained with a hand-written SGD update, in the style of pytorch/examples'
word_language_model (``p.data.add_(p.grad, alpha=-lr)``, ``clip_grad_norm_``, hidden state
detached between batches); ``--cell GRU``, ``--packed`` (variable-length sequences through
``pack_padded_sequence``), ``--accumulate N`` (N backward passes per update).
"""

import argparse

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

parser = argparse.ArgumentParser()
parser.add_argument("--cell", default="LSTM")
parser.add_argument("--vocab", type=int, default=1000)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--bptt", type=int, default=20)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--packed", action="store_true")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--updates", type=int, default=6)
args = parser.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(args.vocab, args.hidden)
        self.rnn = getattr(nn, args.cell)(args.hidden, args.hidden, args.layers, dropout=0.2)
        self.decoder = nn.Linear(args.hidden, args.vocab)

    def forward(self, data, hidden, lengths=None):
        emb = self.encoder(data)
        if lengths is not None:
            packed = pack_padded_sequence(emb, lengths, enforce_sorted=False)
            output, hidden = self.rnn(packed, hidden)
            output, _ = pad_packed_sequence(output, total_length=data.size(0))
        else:
            output, hidden = self.rnn(emb, hidden)
        return self.decoder(output).view(-1, args.vocab), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        zeros = weight.new_zeros(args.layers, bsz, args.hidden)
        return (zeros, zeros.clone()) if args.cell == "LSTM" else zeros


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


corpus = torch.randint(0, args.vocab, (args.bptt * args.updates * args.accumulate + 1,
                                      args.batch))
model = RNNModel().to(device)
model.rnn.flatten_parameters()
criterion = nn.CrossEntropyLoss()
lr = 20.0
hidden = model.init_hidden(args.batch)
model.train()
for batch, i in enumerate(range(0, corpus.size(0) - 1, args.bptt)):
    data = corpus[i:i + args.bptt].to(device)
    targets = corpus[i + 1:i + 1 + args.bptt].reshape(-1).to(device)
    lengths = (torch.arange(args.batch) % args.bptt + 1 if args.packed else None)
    if batch % args.accumulate == 0:
        model.zero_grad()
    hidden = repackage_hidden(hidden)
    output, hidden = model(data, hidden, lengths)
    loss = criterion(output, targets)
    loss.backward()
    if (batch + 1) % args.accumulate == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    print(f"batch {batch} loss {loss.item():.2f}")
