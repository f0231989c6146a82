"""A Hugging Face Trainer script as users write one for DeepSpeed, started by the ``deepspeed``
launcher (``deepspeed --num_gpus 4 deepspeed_trainer.py --deepspeed ds_config.json``) or by
``accelerate launch``: ``TrainingArguments`` from the command line (the launcher adds
``--local_rank=N``), a small Llama built from a config (no download), random tokens.

``--report PATH`` writes the model's parameter count and the DeepSpeed engine's ZeRO stage and
data-parallel world size, for the tests to compute what each rank holds."""

import dataclasses
import json

import torch
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)


@dataclasses.dataclass
class ModelArguments:
    layers: int = 4
    width: int = 256
    vocab: int = 8192
    seq: int = 128
    report: str = ""


parser = HfArgumentParser((ModelArguments, TrainingArguments))
shape, training = parser.parse_args_into_dataclasses()
config = LlamaConfig(hidden_size=shape.width, intermediate_size=4 * shape.width,
                     num_hidden_layers=shape.layers, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=shape.vocab,
                     max_position_embeddings=shape.seq, tie_word_embeddings=False)
# from_config: under ZeRO-3 the model is built inside deepspeed.zero.Init (transformers'
# integration, once TrainingArguments has read the DeepSpeed config).
model = AutoModelForCausalLM.from_config(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        ids = torch.randint(0, shape.vocab, (shape.seq,))
        return {"input_ids": ids, "labels": ids}


class Report(Trainer):
    """Writes what the model holds once the engine is made (the first training step's start)."""

    def training_step(self, *args, **kwargs):
        if shape.report and self.state.global_step == 0:
            engine = self.model_wrapped
            with open(shape.report, "w") as out:
                json.dump({
                    # ZeRO-3 partitions each parameter; ds_numel is its full size
                    "parameters": sum(getattr(p, "ds_numel", p.numel())
                                      for p in model.parameters()),
                    "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
                    "stage": engine.zero_optimization_stage(),
                    "world_size": engine.dp_world_size}, out)
        return super().training_step(*args, **kwargs)


Report(model=model, args=training, train_dataset=Tokens()).train()
