#!/usr/bin/env bash
# Run the probe's own tests with a user's torch: the environment scripts/torch-venv.sh builds
# for TORCH_VERSION and PYTHON_MINOR (built here first if it is not cached), its interpreter
# running pytest over the probe's test folders with this checkout's sources first on the path.
#
#   scripts/test-torch.sh TORCH_VERSION PYTHON_MINOR [PYTEST ARGS...]
#
# Left out: the tests of the cluster side and of the CLI (`xmem estimate` in a subprocess), which
# run with xmem's own environment whatever torch a job brings (the estimation pod's refusal and
# launcher tests, a workload's rank-0 world, `xmem estimate` itself, DeepSpeed, whose jobs are
# traced with the newest torch environment however the tests are run: make test's own pytest
# runs them once). In the
# environments where a corpus framework does not install (tests/support/torch_envs.py), the
# corpus test says so for its script; below the distributed range (contract/torch_version.py)
# tests/distributed says the jobs are refused, and test_old_torch_refused.py checks that they are.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH="${1:?usage: test-torch.sh TORCH_VERSION PYTHON_MINOR [PYTEST ARGS...]}"
PYMINOR="${2:?usage: test-torch.sh TORCH_VERSION PYTHON_MINOR [PYTEST ARGS...]}"
shift 2
ENV_DIR="$(bash "$ROOT/scripts/torch-venv.sh" "$TORCH" "$PYMINOR")"
cd "$ROOT"
echo "== the probe's tests with torch $(cat "$ENV_DIR/torch-version.txt") on Python $PYMINOR ($ENV_DIR)"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" XMEM_TORCH_ENV="$ENV_DIR"
exec "$ENV_DIR/bin/python" -m pytest -q -p no:cacheprovider --durations=20 \
  tests/estimator tests/conformance tests/distributed \
  --ignore tests/estimator/test_pod_refusal.py \
  --ignore tests/estimator/test_estimate_cli.py \
  --ignore tests/estimator/test_user_interpreter.py \
  --ignore tests/distributed/test_pod_launchers.py \
  --ignore tests/distributed/test_cluster_world.py \
  --ignore tests/distributed/test_deepspeed_refused.py \
  --ignore tests/distributed/test_deepspeed_zero.py \
  --deselect tests/distributed/test_ddp_buckets.py::test_xmem_estimate_runs_torchrun_commands_and_adds_nccl \
  --deselect tests/distributed/test_pipeline_refused.py::test_xmem_estimate_reports_a_pipeline_job_as_not_estimated \
  "$@"
