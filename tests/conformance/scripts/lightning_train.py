"""A Lightning module trained by ``Trainer(accelerator="gpu", devices=1)`` with bf16 mixed
precision, the optimizer from ``configure_optimizers``, a DataLoader with workers."""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=6)
    return parser.parse_args(argv)


class Classifier(L.LightningModule):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build_model(args):
    return Classifier(args.hidden)


def build_optimizer(args, model):
    return model.configure_optimizers()


def main():
    args = parse()
    n = args.batch_size * (args.max_steps + 2)
    data = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=2)
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                        max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(build_model(args), loader)


if __name__ == "__main__":
    main()
