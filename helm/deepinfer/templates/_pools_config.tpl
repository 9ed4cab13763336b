{{/* The pools file the controller reads (`deepinfer serve --pools-config`, services/controller/pools_config.py):
per pool its Ray resource, GPUs per engine and ranks per engine instance (expertParallelSize: one
actor and one GPU per rank, experts sharded over them), and with autoscaling on the policy's bounds in engines
(the group's pod bounds x engines per pod; at least one engine) and targets. */}}

{{- define "deepinfer.poolsConfig" -}}
{{- $v := .Values -}}
{{- $pools := dict -}}
{{- range $name := splitList "," (include "deepinfer.enabledPools" .) -}}
{{- $pool := index $v.pools $name -}}
{{- $engines := int (include "deepinfer.enginesPerPod" $pool) -}}
{{- $entry := dict "resource" (printf "deepinfer_%s" $name) "gpusPerEngine" (int (include "deepinfer.gpusPerEngine" $pool)) -}}
{{- if ne $name "encoder" -}}{{- $_ := set $entry "expertParallelSize" (int $pool.expertParallelSize) -}}{{- end -}}
{{- if and $v.autoscaling.enabled (ne $name "encoder") -}}
{{- $rule := dict "minReplicas" (max 1 (mul (int $pool.minReplicas) $engines)) "maxReplicas" (max 1 (mul (int $pool.maxReplicas) $engines)) -}}
{{- range $key := list "tolerance" "scaleInBelow" "scaleOutCooldownSeconds" "scaleInCooldownSeconds" "scaleInStableSeconds" "maxStep" -}}
{{- $_ := set $rule $key (index $v.autoscaling $key) -}}
{{- end -}}
{{- $_ := set $entry "autoscaling" (mergeOverwrite $rule (deepCopy ($pool.autoscaling | default dict))) -}}
{{- end -}}
{{- $_ := set $pools $name $entry -}}
{{- end -}}
{{- $planner := dict "intervalSeconds" $v.autoscaling.intervalSeconds "replaceDeadEngines" $v.planner.replaceDeadEngines "placementGraceSeconds" $v.planner.placementGraceSeconds "startTimeoutSeconds" $v.planner.startTimeoutSeconds -}}
{{- toPrettyJson (dict "pools" $pools "planner" $planner) -}}
{{- end -}}
