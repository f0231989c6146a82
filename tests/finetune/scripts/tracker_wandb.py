"""A fine-tune that records to Weights & Biases online, twice: a run of its own
(``wandb.init(mode="online")``, ``log``) and the Trainer's (``report_to=["wandb"]``). The server
is ``WANDB_BASE_URL``, the key ``WANDB_API_KEY``, from the environment."""

import wandb
from tracker_common import arguments, train

options = arguments(__doc__).parse_args()
run = wandb.init(project="xmem-tests", mode="online")
run.log({"examples": 8})
train(options, ["wandb"], save_strategy="no")
