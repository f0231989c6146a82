"""A Llama-shaped checkpoint made locally, as the fine-tuning scripts load a pretrained one.

``llama_checkpoint`` (one per test session, in a temporary folder) is a ``LlamaForCausalLM``
made from a ``LlamaConfig``, saved with ``save_pretrained`` (safetensors, bf16 as published Llama
checkpoints are), beside its own tokenizer: a BPE model trained with the ``tokenizers`` library on
a few hundred generated lines and saved with ``PreTrainedTokenizerFast.save_pretrained``. It is
built with the torch environment that has the fine-tuning stack (``NEWEST``; the project's own
``.venv`` has an older transformers), by running this file:

    <NEWEST.interpreter> tests/finetune/conftest.py --shape tiny|bench OUT_DIR

``bench/coverage/finetune_matrix.py`` makes its 0.83B checkpoint the same way.
"""

from __future__ import annotations

import argparse
import random
import subprocess
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The shapes of the checkpoint: the tests' tiny one, and the benchmark's ~0.83B one (a
# TinyLlama-like layout: grouped-query attention with 8 key/value heads, SwiGLU MLP).
SHAPES: Dict[str, Dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 512,
             "max_position_embeddings": 512},
    "bench": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 5632, "vocab_size": 32000,
              "max_position_embeddings": 4096},
}

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3

WORDS = ("the a model learns from data every step loss falls gradient flows through layers "
         "attention looks at tokens memory grows with batch and sequence length answer question "
         "why how what when is are was were good bad right wrong yes no one two three four five "
         "six seven eight nine ten fox dog cat jumps runs sleeps over under quick lazy brown").split()


def lines(count: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."
            for _ in range(count)]


def build(out: Path, shape: str) -> None:
    """Write the checkpoint and its tokenizer into ``out`` (needs transformers and tokenizers)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(lines(400), trainers.BpeTrainer(vocab_size=400,
                                                            special_tokens=SPECIAL))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(out)

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def make(out: Path, shape: str, interpreter: str) -> Path:
    """Build the checkpoint with ``interpreter`` (a torch environment with transformers)."""
    subprocess.run([interpreter, str(Path(__file__).resolve()), "--shape", shape, str(out)],
                   check=True, cwd=ROOT, timeout=900)
    return out


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama checkpoint with its tokenizer, made once per session."""
    from tests.support.torch_envs import NEWEST

    return make(tmp_path_factory.mktemp("llama") / "tiny-llama", "tiny", NEWEST.interpreter)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a Llama-shaped checkpoint")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("out", type=Path)
    options = parser.parse_args()
    build(options.out, options.shape)
