"""A fine-tune that pushes to the Hugging Face Hub (``HF_ENDPOINT`` from the environment): the
Trainer with ``push_to_hub=True`` and ``hub_strategy="every_save"`` creates the repository
when it is made and pushes at every save; with ``--direct`` the script first looks the
repository up and creates it itself (``HfApi.model_info``, ``HfApi.create_repo``)."""

from tracker_common import arguments, train

parser = arguments(__doc__)
parser.add_argument("--direct", action="store_true")
options = parser.parse_args()

REPO = "xmem-tests/tiny-llama"
if options.direct:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token="hf_xmemtestsxmemtestsxmemtestsxmemtests")
    try:
        api.model_info(REPO)
    except HfHubHTTPError:
        api.create_repo(REPO, exist_ok=True)
train(options, "none", push_to_hub=True, hub_model_id=REPO, hub_strategy="every_save",
      hub_token="hf_xmemtestsxmemtestsxmemtestsxmemtests", save_strategy="steps", save_steps=1)
