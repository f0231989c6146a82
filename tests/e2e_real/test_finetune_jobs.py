"""Fine-tuning jobs as a cluster runs them, on the real control plane: Jobs that fine-tune a
pretrained checkpoint with transformers' Trainer and PEFT, QLoRA through bitsandbytes, and TRL's
SFT, DPO and GRPO (its own generation) trainers are held, estimated by estimation pods on the process node (the torch
environment with the fine-tuning stack stands for the job's image), and released sized. The
checkpoint (a Llama-shaped one, saved with ``save_pretrained``, with its own tokenizer) and the
scripts come from ConfigMaps, as a small team ships them; each estimate is shape-only."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Dict, List

from localkube.controlplane import wait_for
from tests.e2e_real.support import IMAGE, policy, template_annotations
from tests.finetune.conftest import make
from tests.support.torch_envs import NEWEST
from xmem_admission.cluster import labels
from xmem_admission.contract import termination

SCRIPTS = Path(__file__).resolve().parents[1] / "finetune" / "scripts"
SMALL = ["--batch-size", "2", "--seq-len", "64"]
# job name -> the script and its arguments (the checkpoint is mounted at /ckpt)
JOBS: Dict[str, List[str]] = {
    "lora": ["trainer_lora.py", "--model", "/ckpt", *SMALL],
    "qlora": ["bnb_qlora_trainer.py", "/ckpt", "--out", "/tmp/xmem-e2e-qlora"],
    "sft": ["trl_sft.py", "--model", "/ckpt", *SMALL],
    "dpo": ["trl_dpo.py", "--model", "/ckpt", *SMALL],
    # 48-token completions: the generation writes the steps that repeat (probe/generation_steps)
    "grpo": ["trl_grpo.py", "--model", "/ckpt", "--batch-size", "4", "--seq-len", "96"],
}


def config_maps(namespace: str, checkpoint: Path) -> List[Dict[str, Any]]:
    code = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "finetune-code", "namespace": namespace},
            "data": {p.name: p.read_text() for p in SCRIPTS.glob("*.py")}}
    text = {p.name: p.read_text() for p in checkpoint.iterdir() if p.suffix == ".json"}
    binary = {p.name: base64.b64encode(p.read_bytes()).decode()
              for p in checkpoint.iterdir() if p.suffix == ".safetensors"}
    weights = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "checkpoint", "namespace": namespace},
               "data": text, "binaryData": binary}
    return [code, weights]


def finetune_job(name: str, namespace: str, argv: List[str]) -> Dict[str, Any]:
    """A Job on one GPU running ``argv`` with the fine-tuning environment's interpreter."""
    container = {"name": "train", "image": IMAGE,
                 "command": [NEWEST.interpreter, f"/app/{argv[0]}", *argv[1:]],
                 "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}},
                 "volumeMounts": [{"name": "code", "mountPath": "/app"},
                                  {"name": "checkpoint", "mountPath": "/ckpt"}]}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [container],
                "volumes": [{"name": "code", "configMap": {"name": "finetune-code"}},
                            {"name": "checkpoint", "configMap": {"name": "checkpoint"}}]}}}}


def test_fine_tuning_jobs_are_estimated_shape_only_by_estimation_pods_and_released_sized(
        xmem, tmp_path):
    cluster = xmem.cluster
    checkpoint = make(tmp_path / "tiny-llama", "tiny", NEWEST.interpreter)
    for obj in config_maps(xmem.namespace, checkpoint):
        cluster.apply(obj)
    # shape-only tracing of a tiny checkpoint: under 2 GiB of host memory per pod
    cluster.apply(policy(xmem.namespace, estimation={
        "resources": {"cpu": "1", "memory": "3Gi"}, "activeDeadlineSeconds": 600}))
    xmem.serve()
    xmem.controller()
    recorder = xmem.record_estimation_pods()
    try:
        for name, argv in JOBS.items():
            cluster.apply(finetune_job(name, xmem.namespace, argv))
        for name in JOBS:
            released = xmem.wait_released(name, timeout=900)
            sized = template_annotations(released)
            assert labels.REQUEST_BYTES in sized, (
                name, [e["message"] for e in xmem.events(name)],
                [(p["metadata"]["name"], _message(p)) for p in recorder.seen()])
        pods = wait_for(lambda: [p for p in recorder.seen() if _message(p)] if len(
            [p for p in recorder.seen() if _message(p)]) >= len(JOBS) else None, 60,
            "every estimation pod's result")
    finally:
        recorder.stop()

    results = {p["metadata"]["name"]: termination.decode(_message(p)) for p in pods}
    assert len(results) == len(JOBS), sorted(results)
    for name, result in results.items():
        assert result.status == "ok", (name, result.reason, result.traceback)
        assert result.mode == "fake", (name, result.fallback)
    gmes = xmem.gmes()
    assert len(gmes) == len(JOBS)
    assert all(g["status"].get("requestBytes") for g in gmes), gmes


def _message(pod: Dict[str, Any]) -> str:
    """The estimation pod's termination message (its result), or ''."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            return str(terminated["message"])
    return ""
