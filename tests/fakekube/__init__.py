"""Stand-ins for the parts of a Kubernetes cluster that cannot run on a test machine.

No kube-apiserver, kubelet or container runtime runs here, yet the controller and the webhook
must be tested on the real protocol with the unmodified official client. This package serves
that protocol from Python:

- ``apiserver``: an HTTP(S) server on loopback that serves the real REST paths, with resource
  versions, optimistic concurrency, watches, selectors, the three patch types, subresources,
  finalizers, owner references with garbage collection, admission webhooks and injectable faults;
- ``kubelet``: runs the containers of the pods it is given as local subprocesses and reports
  their status (exit codes, OOMKilled, deadlines, image pull failures, termination messages);
- ``jobs``: the part of the Job controller that turns an unsuspended Job into a Pod;
- ``cluster``: starts them together and writes a kubeconfig for them.

Only tests, benchmarks and demos import it; the product never does. It needs the ``test`` extra
(``jsonpatch``, ``jsonschema``, ``kubernetes-validate``, ``trustme``) besides the ``server`` one.
"""
