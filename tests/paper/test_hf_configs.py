"""The Hugging Face configs in bench/yardsticks/paper/hf_configs build their models.

Each config is built on the meta device (no weights are allocated, nothing is downloaded) and
the parameter count must be within 1% of the count the model's publishers state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "bench" / "yardsticks" / "paper" / "hf_configs"

# model id as it appears in our data -> published parameter count.
PUBLISHED = {
    "openai-community/gpt2": 124.4e6,
    "distilbert/distilgpt2": 81.9e6,
    "EleutherAI/gpt-neo-125M": 125.2e6,
    "facebook/opt-125m": 125.2e6,
    "facebook/opt-350m": 331.2e6,
    "cerebras/Cerebras-GPT-111M": 111e6,
    "T5-small": 60.5e6,
    "t5-base": 222.9e6,
    "Qwen/Qwen3-4B": 4.02e9,
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78e9,
    "google/gemma-2-2b-it": 2.61e9,
    "meta-llama/Llama-3.2-3B-Instruct": 3.21e9,
}


def slug(model_id: str) -> str:
    return model_id.replace("/", "__")


def load(model_id: str) -> dict:
    return json.loads((CONFIG_DIR / f"{slug(model_id)}.json").read_text(encoding="utf-8"))


def test_every_model_has_one_config_file():
    names = {p.stem for p in CONFIG_DIR.glob("*.json")}
    assert names == {slug(m) for m in PUBLISHED}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_config_file_is_complete(model_id):
    spec = load(model_id)
    assert spec["model_id"] == model_id
    assert spec["source"].strip()
    assert spec["auto_class"] in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM")
    assert spec["config"]["model_type"]
    assert spec["published_params"] == pytest.approx(PUBLISHED[model_id])


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_builds_on_meta_with_the_published_parameter_count(model_id):
    from transformers import CONFIG_MAPPING, AutoConfig

    spec = load(model_id)
    cfg = CONFIG_MAPPING[spec["config"]["model_type"]](**spec["config"])
    assert type(AutoConfig.for_model(**spec["config"])) is type(cfg)
    auto_class = getattr(transformers, spec["auto_class"])
    with torch.device("meta"):
        model = auto_class.from_config(cfg)
    assert type(model).__name__ == spec["config"]["architectures"][0]
    n = sum(p.numel() for p in model.parameters())  # tied tensors are counted once
    assert n == pytest.approx(PUBLISHED[model_id], rel=0.01)
    assert n == spec["built_params"]
