"""A DeepSpeed pipeline-parallel job as DeepSpeed's pipeline tutorial writes one: the model as a
``PipelineModule`` of layers split into two stages, trained by the ``PipelineEngine`` that
``deepspeed.initialize`` makes for it (``deepspeed --num_gpus 2 deepspeed_pipeline.py``)."""

import argparse

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()

deepspeed.init_distributed()
layers = [torch.nn.Linear(256, 256) for _ in range(4)]
model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
batches = iter([(torch.randn(2, 256), torch.randn(2, 256)) for _ in range(100)])
for _ in range(3):
    engine.train_batch(data_iter=batches)
