#!/usr/bin/env bash
# End-to-end on a real cluster: the scenario of tests/e2e/test_job_admission_to_release.py on
# kind (Kubernetes in Docker), for people with Docker. Not run in CI: CI machines have no Docker
# engine, and the stand-in API server covers the same protocol there.
#
#   deploy/e2e/kind.sh            create a kind cluster, build and load the image, install the
#                                 chart, submit a GPU Job, wait for it to be estimated and released
#   KEEP=1 deploy/e2e/kind.sh     leave the cluster running afterwards (kind delete cluster --name xmem-e2e)
#
# Needs: docker, kind, kubectl, helm. The training image must have torch (the probe runs inside
# it, on the CPU): TRAIN_IMAGE defaults to the official PyTorch runtime image (about 3 GB to
# pull once). kind nodes have no GPU, so the released Job's pod stays Pending (Unschedulable):
# the check is that the webhook wrote HAMi's nvidia.com/gpumem into it, from the estimate.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CLUSTER="${CLUSTER:-xmem-e2e}"
IMAGE="${IMAGE:-xmem-admission:e2e}"
TRAIN_IMAGE="${TRAIN_IMAGE:-pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime}"
NAMESPACE=ml
TIMEOUT="${TIMEOUT:-900s}"

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind.sh: $tool is required" >&2; exit 2; }
done

cleanup() {
  if [ "${KEEP:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "kind cluster $CLUSTER"
kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kubectl config use-context "kind-$CLUSTER" >/dev/null

step "image $IMAGE (webhook, controller, probe bundle) and the training image"
docker build -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER"
docker image inspect "$TRAIN_IMAGE" >/dev/null 2>&1 || docker pull "$TRAIN_IMAGE"
kind load docker-image "$TRAIN_IMAGE" --name "$CLUSTER"

step "chart: webhook, controller, CRDs, a HAMi policy for A100-80GB and H100-80GB"
helm upgrade --install xmem "$ROOT/helm/xmem-admission" --namespace xmem-system --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --set controller.replicas=2 --set policy.spec.estimation.resources.memory=3Gi \
  --wait --timeout 5m
kubectl -n xmem-system rollout status deploy --timeout=180s

step "namespace $NAMESPACE opted in, training code in a ConfigMap"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl label namespace "$NAMESPACE" xmem.io/estimate=true --overwrite
kubectl -n "$NAMESPACE" create configmap code --from-file="$ROOT/examples/train_gpt.py" \
  --dry-run=client -o yaml | kubectl apply -f -

step "a Job asking for one GPU: held by the webhook"
kubectl -n "$NAMESPACE" delete job train --ignore-not-found --wait
cat <<EOF | kubectl -n "$NAMESPACE" apply -f -
apiVersion: batch/v1
kind: Job
metadata:
  name: train
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: train
          image: $TRAIN_IMAGE
          imagePullPolicy: IfNotPresent
          command: ["python", "/app/train_gpt.py"]
          args: ["--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1000",
                 "--seq-len", "128", "--batch-size", "4"]
          resources:
            limits: {nvidia.com/gpu: 1}
          volumeMounts: [{name: code, mountPath: /app}]
      volumes:
        - name: code
          configMap: {name: code}
EOF
test "$(kubectl -n "$NAMESPACE" get job train -o jsonpath='{.spec.suspend}')" = true \
  || { echo "kind.sh: the Job was not held" >&2; exit 1; }
kubectl -n "$NAMESPACE" get job train -o jsonpath='{.metadata.annotations}'; echo

step "estimation pod, GPUMemoryEstimate, release (up to $TIMEOUT)"
kubectl -n "$NAMESPACE" wait job/train --for=jsonpath='{.spec.suspend}'=false --timeout="$TIMEOUT"
kubectl -n "$NAMESPACE" get gme -o wide
kubectl -n "$NAMESPACE" get events --field-selector involvedObject.name=train \
  -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message
request="$(kubectl -n "$NAMESPACE" get job train \
  -o jsonpath='{.spec.template.metadata.annotations.xmem\.io/request-bytes}')"
test -n "$request" || { echo "kind.sh: released without an estimate" >&2; exit 1; }

step "the Job's Pod carries HAMi's request, from the estimate"
for _ in $(seq 60); do
  pod="$(kubectl -n "$NAMESPACE" get pods -l job-name=train -o name | head -1)"
  [ -n "$pod" ] && break
  sleep 2
done
gpumem="$(kubectl -n "$NAMESPACE" get "$pod" \
  -o jsonpath='{.spec.containers[0].resources.limits.nvidia\.com/gpumem}')"
want=$(( (request + 1048575) / 1048576 ))
echo "request-bytes $request -> nvidia.com/gpumem $gpumem MiB (expected $want)"
test "$gpumem" = "$want" || { echo "kind.sh: wrong nvidia.com/gpumem on $pod" >&2; exit 1; }
echo "kind.sh: passed"
