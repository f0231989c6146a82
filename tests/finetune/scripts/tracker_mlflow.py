"""A fine-tune that records to the MLflow tracking server it names itself, twice: a run of its
own (``mlflow.start_run``, ``log_metric``) and the Trainer's (``report_to=["mlflow"]``)."""

import os

from tracker_common import arguments, train

parser = arguments(__doc__)
parser.add_argument("--tracking-uri", required=True)
options = parser.parse_args()

os.environ["MLFLOW_TRACKING_URI"] = options.tracking_uri  # the Trainer's MLflowCallback reads it
import mlflow  # noqa: E402

mlflow.set_tracking_uri(options.tracking_uri)
mlflow.set_experiment("fine-tune")
with mlflow.start_run(run_name="prepare"):
    mlflow.log_metric("examples", 8)
train(options, ["mlflow"], save_strategy="no")
