"""Transformers ``Trainer`` with the options users set most, one flag each, on a causal LM loaded
from its path: the optimizer by name (``--optim``: ``TrainingArguments.optim``, e.g.
``adamw_bnb_8bit``, ``paged_adamw_32bit``, ``adafactor``, ``lion_8bit``, ``sgd``), gradient
accumulation, gradient checkpointing (``use_reentrant=False``), fp16 or float32 instead of bf16,
NEFTune noise, eager attention, ``torch_compile=True``; a LoRA adapter (``--lora``) as DoRA
(``--dora``), rank-stabilised (``--rslora``) or on every linear layer (``--all-linear``); QLoRA
(``--qlora``: nf4 with double quantization, ``prepare_model_for_kbit_training``) with its packed
weights stored as bf16 (``--storage-bf16``, as FSDP-QLoRA recipes set it). Rows of ``--seq-len``
tokens, ``DataCollatorForLanguageModeling(mlm=False)``."""

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--optim", default="adamw_torch_fused")
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--checkpointing", action="store_true")
precision = parser.add_mutually_exclusive_group()
precision.add_argument("--fp16", action="store_true", help="float32 weights, fp16 autocast")
precision.add_argument("--fp32", action="store_true", help="float32 weights, no autocast")
parser.add_argument("--neftune", type=float, default=None, help="neftune_noise_alpha")
parser.add_argument("--attention", default=None, help="attn_implementation (eager, sdpa)")
parser.add_argument("--torch-compile", action="store_true")
parser.add_argument("--lora", action="store_true")
parser.add_argument("--dora", action="store_true")
parser.add_argument("--rslora", action="store_true")
parser.add_argument("--all-linear", action="store_true")
parser.add_argument("--qlora", action="store_true")
parser.add_argument("--storage-bf16", action="store_true")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
options = {}
if args.attention:
    options["attn_implementation"] = args.attention
if args.qlora:
    options["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16 if args.storage_bf16 else torch.uint8)
full_precision = args.fp16 or args.fp32
model = AutoModelForCausalLM.from_pretrained(
    args.model, dtype=torch.float32 if full_precision else torch.bfloat16, **options)
if args.lora or args.dora or args.rslora or args.qlora:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if args.qlora:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.checkpointing)
    adapter = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, use_dora=args.dora,
                         use_rslora=args.rslora,
                         target_modules="all-linear" if args.all_linear else ["q_proj", "v_proj"],
                         task_type="CAUSAL_LM")
    model = get_peft_model(model, adapter)

rng = random.Random(6)
words = "the model reads a long document about memory and learns the next word".split()
texts = [" ".join(rng.choice(words) for _ in range(args.seq_len)) for _ in range(64)]
rows = Dataset.from_dict({"text": texts}).map(
    lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.seq_len),
    batched=True, remove_columns=["text"])

training_args = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="options-"),
    per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.accumulation,
    max_steps=args.max_steps,
    optim=args.optim,
    bf16=not full_precision,
    fp16=args.fp16,
    neftune_noise_alpha=args.neftune,
    gradient_checkpointing=args.checkpointing,
    gradient_checkpointing_kwargs={"use_reentrant": False} if args.checkpointing else None,
    torch_compile=args.torch_compile,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
)
trainer = Trainer(model=model, args=training_args, train_dataset=rows,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
