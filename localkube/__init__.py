"""Kubernetes on this machine, from its Go modules: what the tests, the benchmarks, the scripts and
the playground (``make playground``) run the project on. Not part of the product's package
(``src/xmem_admission`` never imports it) and not installed with it.

Built by ``make tools`` (``scripts/build-kube.sh``, versions in ``scripts/kube-versions.env``) and,
for the real node, ``make node-tools`` (``scripts/build-node.sh``, ``scripts/node-versions.env``):

- ``tools``: where the built binaries, kwok's Stages and the third-party CRDs are;
- ``pki``: the certificates the project makes for it (CA, serving and client certificates,
  service-account signing keys);
- ``controlplane``: etcd, kube-apiserver (RBAC and the Node authorizer on), kube-controller-manager
  and kube-scheduler as processes, kubeconfigs, stop by PID in the right order; also a command
  line (``python -m localkube.controlplane up|down DIR``) for ``scripts/kube.sh``;
- ``kubelet``: a real node (root): the kubelet, containerd 2.x, runc, CNI bridge networking,
  kube-proxy and a local image registry, removed again by what it made;
- ``node``: the project's process node, which registers a Node and runs the pods bound to it as
  local processes with the host's Python (no root, no images: what ``make test`` runs on);
- ``kwok``: fake GPU nodes, advertising ``nvidia.com/gpu``, ``nvidia.com/gpumem`` and MIG slices;
- ``cluster``: a control plane with the chart's objects, a node, the webhook and the controller;
- ``images``: the project's image, Debian base images and training images (podman);
- ``kueue``: the Kueue controller of ``make tools``; ``faultproxy``: a thin proxy in front of the
  API server that answers chosen requests with a 429 or a 500;
- ``jobset`` and ``trainer``: JobSet's controller and Kubeflow Trainer v2's controller manager of
  ``make tools`` (``scripts/build-trainer.sh``), with their CRDs, webhooks and Trainer's torch
  runtime; ``hosted``: what they share as host processes (identity, serving certificate,
  readiness, webhook configurations pointed at them);
- ``playground``: ``make playground``, the project on a real node for users to try.
"""
