"""What an estimation turns off so that tracing a job does nothing outside the estimation.

A traced training script runs with the job's environment and credentials. Left alone, it would
create a Weights & Biases or MLflow run, send a Comet experiment or push to the Hugging Face
Hub. Each library's own switch turns that off; this module lists them, once, for both places
that apply them:

- the estimation pod's environment (``cluster.controller.podspec``), where ``kubectl describe
  pod`` shows them, replacing the workload's own values;
- the probe's process (``estimator.probe.side_effects``), before the script runs, for ``xmem
  estimate`` and the estimation pod alike. A switch is an environment variable, and a script
  can set its own value or pass an argument that wins over it (``wandb.init(mode="online")``,
  ``mlflow.set_tracking_uri(...)``, ``TrainingArguments(push_to_hub=True)``): the probe
  also patches those entry points when the script imports the library (see there).

Left out on purpose: ``WANDB_DISABLED`` (transformers 5.17 no longer reads it:
``integrations/integration_utils.py`` has no mention); ``DISABLE_MLFLOW_INTEGRATION`` (with it,
transformers 5.17's ``MLflowCallback.__init__`` raises ``RuntimeError`` when the Trainer names
``report_to=["mlflow"]``, so the job would fail instead of being estimated); ``HF_HUB_OFFLINE``
(a model named by its Hub id must still download its configuration; only writes are off).

Standard library only, Python >= 3.9: this module ships in the probe bundle.
"""

from __future__ import annotations

import os
from typing import Dict, NamedTuple, Tuple


class Switch(NamedTuple):
    """One environment variable that turns a side effect off."""

    variable: str
    value: str  # "{scratch}" stands for the probe's scratch folder
    library: str
    effect: str  # what it turns off
    source: str


MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
MLFLOW_STORE = "mlruns"  # the throw-away MLflow file store, in the probe's scratch folder

SWITCHES: Tuple[Switch, ...] = (
    Switch("WANDB_MODE", "disabled", "wandb",
           "W&B runs: wandb.init returns a run whose methods do nothing; nothing is sent or "
           "written (no wandb/ folder)",
           "wandb docs, Environment variables (WANDB_MODE); wandb 0.31.0 "
           "sdk/wandb_init.py init(): a settings mode of 'disabled' returns "
           "make_disabled_run() before any log directory or service; sdk/wandb_login.py "
           "login() returns at once when the settings are _noop"),
    Switch(MLFLOW_TRACKING_URI, "file://{scratch}/" + MLFLOW_STORE, "mlflow",
           "MLflow runs: they go to a throw-away file store in the probe's scratch folder, "
           "not to the team's tracking server (nor to mlflow.db in the working directory, "
           "MLflow 3's default)",
           "mlflow 3.17.2 environment_variables.py MLFLOW_TRACKING_URI, read by "
           "tracking/_tracking_service/utils.py get_tracking_uri(); the default "
           "sqlite:///mlflow.db is store/tracking/__init__.py DEFAULT_TRACKING_URI"),
    Switch("MLFLOW_ALLOW_FILE_STORE", "true", "mlflow",
           "MLflow's refusal of the throw-away store above: newer MLflow refuses a file store "
           "without it (a file store needs no database library, which mlflow-skinny lacks)",
           "mlflow 3.17.2 store/tracking/file_store.py FileStore.__init__ raises unless "
           "environment_variables.py MLFLOW_ALLOW_FILE_STORE is true"),
    Switch("COMET_AUTO_LOG_DISABLE", "true", "comet_ml",
           "Comet experiments: no communication with the Comet backend",
           "comet_ml 3.58.8 config/config_map.py 'comet.auto_log.disable', the default of "
           "Experiment(disabled=...) in _online.py and of ExperimentConfig(disabled=...) in "
           "comet_start/experiment_config.py ('disable all network communication with the "
           "Comet.com backend'); Comet docs, Configure the SDK"),
    Switch("COMET_DISABLE_AUTO_LOGGING", "1", "comet_ml",
           "Comet's automatic logging of the frameworks it patches on import",
           "comet_ml 3.58.8 config/config_map.py 'comet.disable_auto_logging'; Comet docs, "
           "Configure the SDK"),
    Switch("COMET_MODE", "DISABLED", "transformers",
           "the Trainer's CometCallback",
           "transformers 5.17.0 integrations/integration_utils.py CometCallback.setup(): a "
           "COMET_MODE other than get, get_or_create or create turns Comet logging off"),
    Switch("HF_HUB_DISABLE_TELEMETRY", "1", "huggingface_hub",
           "usage telemetry sent to the Hugging Face Hub",
           "huggingface_hub constants.py HF_HUB_DISABLE_TELEMETRY, read by "
           "utils/_telemetry.py send_telemetry()"),
)

VARIABLES: Tuple[str, ...] = tuple(s.variable for s in SWITCHES)


def environment(scratch: str) -> Dict[str, str]:
    """The switches' variables and values, with ``scratch`` as the probe's scratch folder."""
    if not os.path.isabs(scratch):
        raise ValueError(f"the probe's scratch folder must be an absolute path: {scratch!r}")
    folder = scratch.rstrip("/")
    return {s.variable: s.value.replace("{scratch}", folder) for s in SWITCHES}
