"""pytorch/examples' word_language_model in miniature: a ``Corpus`` tokenised word by word from
text files into id tensors, ``batchify``/``get_batch`` over the BPTT axis, an LSTM model, the
default hand-written SGD update (no torch.optim), ``clip_grad_norm_``, the hidden state
repackaged between batches."""

import argparse
import os
import tempfile

import torch
from torch import nn


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="")
    parser.add_argument("--model", default="LSTM")
    parser.add_argument("--emsize", type=int, default=200)
    parser.add_argument("--nhid", type=int, default=200)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=20)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--batch_size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--ntokens", type=int, default=0, help="vocabulary size, for counting")
    return parser.parse_args(argv)


class Dictionary:
    def __init__(self):
        self.word2idx, self.idx2word = {}, []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(path, "train.txt"))

    def tokenize(self, path):
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    self.dictionary.add_word(word)
        with open(path, encoding="utf8") as f:
            idss = [torch.tensor([self.dictionary.word2idx[w] for w in line.split() + ["<eos>"]],
                                 dtype=torch.int64) for line in f]
        return torch.cat(idss)


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def write_text(root, lines=400):
    words = [f"w{i}" for i in range(500)]
    with open(os.path.join(root, "train.txt"), "w", encoding="utf8") as f:
        for n in range(lines):
            f.write(" ".join(words[(n * 7 + k * 13) % len(words)] for k in range(12)) + "\n")


def build_model(args):
    return RNNModel(args.model, args.ntokens or 501, args.emsize, args.nhid, args.nlayers,
                    args.dropout)


def build_optimizer(args, model):
    return None  # the update is written by hand


def main():
    args = parse()
    root = args.data or tempfile.mkdtemp(prefix="wikitext-")
    write_text(root)
    device = torch.device("cuda")
    corpus = Corpus(root)

    def batchify(data, bsz):
        nbatch = data.size(0) // bsz
        return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous().to(device)

    def get_batch(source, i):
        seq_len = min(args.bptt, len(source) - 1 - i)
        return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)

    def repackage_hidden(h):
        return h.detach() if isinstance(h, torch.Tensor) else tuple(map(repackage_hidden, h))

    train_data = batchify(corpus.train, args.batch_size)
    args.ntokens = len(corpus.dictionary)
    model = build_model(args).to(device)
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-args.lr)
        print(f"| {batch:5d} batches | loss {loss.item():5.2f}")
    with open(os.path.join(root, "model.pt"), "wb") as f:
        torch.save(model, f)


if __name__ == "__main__":
    main()
