{{/*
Names. The fullname is capped at 52 characters so that "<fullname>-controller-metrics" and the
like stay within the 63-character limit of Service and label values.
*/}}
{{- define "xmem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "xmem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "xmem.webhookName" -}}{{ include "xmem.fullname" . }}-webhook{{- end -}}
{{- define "xmem.controllerName" -}}{{ include "xmem.fullname" . }}-controller{{- end -}}
{{- define "xmem.tlsSecretName" -}}{{ include "xmem.fullname" . }}-webhook-tls{{- end -}}
{{- define "xmem.certgenName" -}}{{ include "xmem.fullname" . }}-certgen{{- end -}}
{{- define "xmem.leaseName" -}}{{ default (printf "%s-controller" (include "xmem.fullname" .)) .Values.controller.leaseName }}{{- end -}}

{{/* The DNS name the API server calls: <service>.<namespace>.svc (the certificate's SAN). */}}
{{- define "xmem.serviceDNS" -}}{{ include "xmem.webhookName" . }}.{{ .Release.Namespace }}.svc{{- end -}}

{{/* The one image of every pod and hook; no default: nobody publishes one (values.yaml). */}}
{{- define "xmem.image" -}}
{{- $repository := required "image.repository is required: no xmem-admission image is published. Build it with `make image` (localhost/xmem-admission:VERSION), push it to a registry your nodes pull from (podman push localhost/xmem-admission:VERSION REGISTRY/xmem-admission:VERSION) and install with --set image.repository=REGISTRY/xmem-admission (docs/install.md)" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{ $repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "xmem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "xmem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: xmem-admission
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component (webhook, controller, certgen). */}}
{{- define "xmem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xmem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "xmem.componentLabels" -}}
{{ include "xmem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The namespaces a webhook entry never sees: the configured ones plus the release namespace, so
the webhook cannot block the creation of its own pods.
*/}}
{{- define "xmem.excludedNamespaces" -}}
{{- $list := list .Release.Namespace -}}
{{- range .Values.webhook.excludedNamespaces -}}
{{- if not (has . $list) -}}{{- $list = append $list . -}}{{- end -}}
{{- end -}}
{{- toJson $list -}}
{{- end -}}

{{/*
CEL for the matchCondition: does the object ask for a GPU, whatever its kind? The pod templates
of the object are gathered first (a Pod is its own template, a Job has one, a PyTorchJob one per
replica type, a JobSet one per replicated Job), then one predicate is applied to each. A TrainJob
is always sent: its pod templates are its runtime's, which CEL cannot read. A template asks for a GPU when a container
limit or request name starts with one of webhook.matchConditions.gpuResourcePrefixes, or when its
metadata carries one of gpuAnnotations (KAI). This mirrors xmem_admission.cluster.kube.resources.gpu_containers:
every kind of container counts (app, init and sidecar, ephemeral), so a GPU asked for only by an
init container is still seen. Other kinds, and objects without a spec, give no templates and are
skipped, which is what the webhook would answer for them anyway.
*/}}
{{- define "xmem.celUsesGPU" -}}
{{- $mc := .Values.webhook.matchConditions -}}
{{- $prefixes := list -}}
{{- range $mc.gpuResourcePrefixes -}}{{- $prefixes = append $prefixes (printf "r.startsWith('%s')" .) -}}{{- end -}}
{{- $isGPU := join " || " $prefixes | default "false" -}}
{{- $annotations := list -}}
{{- range $mc.gpuAnnotations -}}{{- $annotations = append $annotations (printf "'%s' in t.metadata.annotations" .) -}}{{- end -}}
{{- $hasAnnotation := join " || " $annotations | default "false" -}}
has(object.spec) && (object.kind == 'TrainJob' || (
  object.kind == 'Pod' ? [object] :
  object.kind == 'Job' && has(object.spec.template) ? [object.spec.template] :
  object.kind == 'PyTorchJob' && has(object.spec.pytorchReplicaSpecs)
    ? object.spec.pytorchReplicaSpecs.filter(k, has(object.spec.pytorchReplicaSpecs[k].template)).map(k, object.spec.pytorchReplicaSpecs[k].template) :
  object.kind == 'JobSet' && has(object.spec.replicatedJobs)
    ? object.spec.replicatedJobs.filter(j, has(j.template) && has(j.template.spec) && has(j.template.spec.template)).map(j, j.template.spec.template)
    : []
).exists(t,
  (has(t.spec) && (
    (has(t.spec.containers) ? t.spec.containers : []) +
    (has(t.spec.initContainers) ? t.spec.initContainers : []) +
    (has(t.spec.ephemeralContainers) ? t.spec.ephemeralContainers : [])
  ).exists(c, has(c.resources) && (
    (has(c.resources.limits) && c.resources.limits.exists(r, {{ $isGPU }})) ||
    (has(c.resources.requests) && c.resources.requests.exists(r, {{ $isGPU }})))))
  || (has(t.metadata) && has(t.metadata.annotations) && ({{ $hasAnnotation }}))
))
{{- end -}}
