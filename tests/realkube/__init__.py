"""A real Kubernetes control plane for the tests and the playground, on loopback.

Built by ``make tools`` (``scripts/build-kube.sh``, versions in ``scripts/kube-versions.env``):

- ``tools``: where the built binaries, kwok's Stages and the third-party CRDs are;
- ``pki``: the certificates the project makes for it (CA, serving and client certificates,
  service-account signing keys);
- ``controlplane``: etcd, kube-apiserver (RBAC and the Node authorizer on), kube-controller-manager
  and kube-scheduler as processes, kubeconfigs, stop by PID in the right order; also a command
  line (``python -m tests.realkube.controlplane up|down DIR``) for scripts and the playground;
- ``node``: a node of the project's that registers a Node and runs the pods bound to it as local
  processes (the estimation pods run the real probe there);
- ``kwok``: fake GPU nodes, advertising ``nvidia.com/gpu``, ``nvidia.com/gpumem`` and MIG slices;
- ``faultproxy``: a thin proxy in front of the API server that answers chosen requests with a 429
  or a 500, the answers a healthy server never gives on demand.

Only tests, scripts and the playground import it; the product never does.
"""
