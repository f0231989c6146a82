# Both `make demo` and `make test` build the same environment: .venv/ with every extra.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean tools cli-tools control-plane kueue training-stack \
	kube-up kube-down playground playground-stop torch-envs torch-tests compat

venv: $(STAMP)

# The last install is DeepSpeed, for the tests that show DeepSpeed jobs are refused
# (tests/distributed): an sdist whose build imports torch, so it is built against the venv's
# torch, into a folder of its own that only those tests put on the path (nothing else sees
# DeepSpeed installed).
$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -c requirements/constraints.txt -e '.[dev]'
	$(PY) -m pip install -qq --upgrade --no-build-isolation --no-deps -c requirements/constraints.txt \
		--target $(VENV)/deepspeed deepspeed einops hjson msgpack ninja py-cpuinfo
	touch $(STAMP)

# The main job on an embedded default: a GPT-2-small-shaped model, batch 8 x 1024, AdamW.
demo: $(STAMP)
	$(VENV)/bin/xmem estimate --gpu A100-40GB,A100-80GB,H100-80GB,L40S -- \
		python examples/train_gpt.py --layers 12 --hidden 768 --heads 12 --vocab 50257 \
		--seq-len 1024 --batch-size 8 --optimizer adamw

# helm, prometheus and promtool for the chart and observability tests, cached in .tools/; the
# real Kubernetes control plane (kube-apiserver, kube-controller-manager, kube-scheduler, etcd,
# kwok) built once from the Go module proxy into ~/.cache/xmem-admission/kube/<versions>/
# (scripts/build-kube.sh, versions in scripts/kube-versions.env; 24 min cold on 2 cores, 0.2 s warm);
# the Kueue controller for the Kueue tests into its own cache, ~/.cache/xmem-admission/kueue/<version>/
# (scripts/build-kueue.sh, version in scripts/kueue-versions.env; 18 min cold on 2 cores); JobSet's
# controller and Kubeflow Trainer's controller manager for the training-stack tests, built together
# into ~/.cache/xmem-admission/trainer/<jobset>_<trainer>/ (scripts/build-trainer.sh, versions in
# scripts/trainer-versions.env; 4.6 min cold on 2 cores). One after the other: the Go builds
# share two cores. Each part is also a target of its own, for the targets that need only some:
# cli-tools (helm, kubectl, prometheus, promtool), control-plane, kueue, training-stack. Each
# script does nothing when its cache is there.
tools:
	bash scripts/install-tools.sh
	bash scripts/build-kube.sh
	bash scripts/build-kueue.sh
	bash scripts/build-trainer.sh

cli-tools:
	bash scripts/install-tools.sh

control-plane:
	bash scripts/build-kube.sh

kueue:
	bash scripts/build-kueue.sh

training-stack:
	bash scripts/build-trainer.sh

# A bare control plane on loopback (etcd, kube-apiserver, controller-manager, scheduler), for
# poking at by hand: `make kube-up` prints the admin kubeconfig; `make kube-down` stops it.
KUBE_DIR ?= /tmp/xmem-kube
kube-up: $(STAMP) control-plane
	bash scripts/kube.sh up $(KUBE_DIR)

kube-down: $(STAMP)
	bash scripts/kube.sh down $(KUBE_DIR)

# The playground (docs/playground.md), as root: control plane, a real node (kubelet, containerd,
# a registry), kwok GPU nodes of two models, the webhook, the controller, the example policy and a
# handful of example jobs in a training image; estimation pods run on the real node. No Docker
# needed. PLAYGROUND_TORCH picks the training image's torch and Python. The cluster renders the
# chart with helm and serves the training stack's CRDs, so it needs cli-tools and training-stack.
PLAYGROUND_DIR ?= /tmp/xmem-playground
PLAYGROUND_TORCH ?= 2.15.0:3.13
playground: $(STAMP) cli-tools control-plane training-stack node-tools image-tools
	$(PY) -m localkube.playground up $(PLAYGROUND_DIR) --torch $(PLAYGROUND_TORCH)

playground-stop: $(STAMP)
	$(PY) -m localkube.playground down $(PLAYGROUND_DIR)

# The users' torch: the probe runs inside the user's image with the user's torch, so its
# tests also run with the oldest supported torch on the oldest Python it supports and the newest
# on the newest (scripts/torch-venv.sh builds each once into ~/.cache/xmem-admission/torch/,
# about 5 GB and 3-4 minutes from PyPI each; scripts/test-torch.sh runs the probe's tests with
# it). The main suite uses the newest too (`xmem estimate` with another interpreter).
TORCH_ENDS := 2.2.2:3.9 2.15.0:3.13

# Both at once: an install is mostly download and unpacking, not CPU.
torch-envs:
	pids=""; for end in $(TORCH_ENDS); do \
		bash scripts/torch-venv.sh $${end%%:*} $${end##*:} >/dev/null & pids="$$pids $$!"; \
	done; for pid in $$pids; do wait $$pid || exit 1; done

# The suite runs in two pytest-xdist workers, each with its own session fixtures (its own real
# control plane): most tests wait on processes, not on the CPU. Measured (bench/speed/README.md):
# 2026-12-03, 974 s with two workers where one took about 38 minutes; 2026-12-07, on a quiet
# 2-core machine, pytest 1,662 and 1,595 s with three workers and 1,773 s with two. CI's machine,
# loaded, took 2,368 s in all with two and 3,655 s with three (its pytest 2,992 s, two MLflow
# tests timing out): a third worker only pays where the cores are free.
TEST_WORKERS ?= 2

# The three parts of the setup are independent and wait on different things (pip and the torch
# environments on downloads and unpacking, the Go builds of `tools` on both cores), so they are
# made at once: on a cold machine the venv and the torch environments are ready long before the
# Go builds end (a cold run here: venv 5.5 min, Go builds 31 min, torch environments 3 min).
test:
	$(MAKE) --no-print-directory -j3 $(STAMP) tools torch-envs
	$(PY) -m ruff check src tests bench examples localkube
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(MAKE) --no-print-directory torch-tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=40

# The probe's tests with each end of the range, both at once (each is one single-threaded
# pytest, mostly tracing; one after the other they took 5 minutes of a warm run): each run's
# output is printed whole when both are done, and either failing fails the target.
torch-tests: $(STAMP)
	pids=""; for end in $(TORCH_ENDS); do \
		bash scripts/test-torch.sh $${end%%:*} $${end##*:} >$(VENV)/torch-tests-$$end.log 2>&1 & \
		pids="$$pids $$!"; \
	done; status=0; for pid in $$pids; do wait $$pid || status=1; done; \
	for end in $(TORCH_ENDS); do cat $(VENV)/torch-tests-$$end.log; done; exit $$status

# Every minor release of the supported range, each with the oldest and the newest Python it
# supports: the probe's fixed jobs and the conformance corpus traced with each, results kept in
# bench/coverage/compat/results.jsonl (a rerun skips what is done) and the table written into
# bench/coverage/README.md ("The user's torch"). Hours on 2 cores; COMPAT_ARGS passes options
# (e.g. COMPAT_ARGS="--only 2.6.0").
compat: $(STAMP)
	$(PY) bench/coverage/compat.py $(COMPAT_ARGS)

# The speed benchmarks (minutes); the accuracy one is `xmem bench paper` (bench/yardsticks/paper.md).
bench: $(STAMP)
	$(PY) bench/speed/allocator_speed.py
	$(PY) bench/speed/webhook_load.py
	$(PY) bench/speed/estimator_speed.py

lint: $(STAMP)
	$(PY) -m ruff check src tests bench examples localkube
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# The project's image: the Dockerfile built with podman (runc) on python:3.11-slim-bookworm
# from its registry, or, where no registry is reachable, on a Debian bookworm base made here by
# mmdebstrap (docs/install.md, "Build the image"). Prints the build time and the image's size.
# XMEM_IMAGE names the tag, XMEM_BASE_IMAGE=local|REF picks the base.
.PHONY: image image-tools training-images image-test
image-tools:
	bash scripts/install-image-tools.sh

image: image-tools
	bash scripts/build-image.sh

# Training images standing for users': Debian's Python and a torch release from PyPI, the
# two ends of the supported range (several GB each, minutes each from a warm pip cache).
training-images: image-tools
	for end in $(TORCH_ENDS); do bash scripts/training-image.sh $${end%%:*} $${end##*:} || exit 1; done

# The image tests (tests/images): the project's image as the chart runs it, and an estimation
# pod's containers run under podman from it and from a training image. Not part of `make test`.
image-test: $(STAMP) image training-images
	XMEM_IMAGE_TESTS=1 $(PY) -m pytest -q tests/images

# The real node: the kubelet, containerd 2.x and a local image registry built from their
# Go modules (scripts/build-node.sh; not in `tools`); `node-test` runs, as root, tests/realnode:
# a pod pulled from the registry runs on the kubelet (localkube/kubelet.py), and Jobs in
# training images are estimated there and released (the project's image and the training images
# are built by the tests' fixtures when podman lacks them: minutes each, several GB), and the
# playground as a user runs it; `node-tools` also builds a DRA kubelet plugin, the Kubernetes
# project's example driver (scripts/build-dra-driver.sh, version in
# scripts/dra-driver-versions.env), which tests/realnode runs beside the kubelet. Not part
# of `make test`. `node-bench`: bench/cluster/realnode_release.py (bench/cluster/README.md). Both also need helm
# (the chart is rendered and installed), the control plane and the training stack's CRDs (every
# cluster serves them): on a clone where only `make demo` ran they build those first.
.PHONY: node-tools node-test node-bench
node-tools:
	bash scripts/build-node.sh
	bash scripts/build-dra-driver.sh

node-test: $(STAMP) cli-tools control-plane training-stack node-tools image-tools
	XMEM_REAL_NODE_TESTS=1 $(PY) -m pytest -q -s tests/realnode

node-bench: $(STAMP) cli-tools control-plane training-stack node-tools image-tools
	$(PY) bench/cluster/realnode_release.py
