{{/* Names and labels shared by every manifest. */}}

{{- define "deepinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayCluster's name and the prefix of every resource; short enough for KubeRay's generated
pod and service names (it appends "-head-svc", "-decode-worker-xxxxx"). */}}
{{- define "deepinfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "deepinfer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "deepinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* KubeRay labels every pod of a RayCluster with ray.io/cluster, ray.io/node-type and ray.io/group. */}}
{{- define "deepinfer.headSelector" -}}
ray.io/cluster: {{ include "deepinfer.fullname" . }}
ray.io/node-type: head
{{- end -}}

{{- define "deepinfer.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The pools that have a worker group, in a fixed order. */}}
{{- define "deepinfer.enabledPools" -}}
{{- $out := list -}}
{{- range $name := list "encoder" "prefill" "decode" -}}
{{- $pool := index $.Values.pools $name | default dict -}}
{{- if and $pool (ne $pool.enabled false) -}}
{{- $out = append $out $name -}}
{{- end -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Engines on one pod of a group: its GPUs over the GPUs of one engine (one engine on a pod without GPUs). */}}
{{- define "deepinfer.enginesPerPod" -}}
{{- if gt (int .gpus) 0 -}}{{ div (int .gpus) (int .expertParallelSize) }}{{- else -}}1{{- end -}}
{{- end -}}

{{/* GPUs one engine of the group asks Ray for. */}}
{{- define "deepinfer.gpusPerEngine" -}}
{{- if gt (int .gpus) 0 -}}{{ int .expertParallelSize }}{{- else -}}0{{- end -}}
{{- end -}}

{{- define "deepinfer.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "deepinfer.fullname" .)) -}}
{{- end -}}

{{- define "deepinfer.hasApiKey" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value -}}true{{- end -}}
{{- end -}}
