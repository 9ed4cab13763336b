{{/* What values.schema.json cannot say: rules across fields. Each failure names the value to change. */}}

{{- define "deepinfer.validate" -}}
{{- range $name := splitList "," (include "deepinfer.enabledPools" .) -}}
{{- $p := index $.Values.pools $name -}}
{{- if not (and (le (int $p.minReplicas) (int $p.replicas)) (le (int $p.replicas) (int $p.maxReplicas))) -}}
{{- fail (printf "pools.%s: need minReplicas <= replicas <= maxReplicas, got %v <= %v <= %v" $name $p.minReplicas $p.replicas $p.maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- range $name := list "prefill" "decode" -}}
{{- $p := index $.Values.pools $name -}}
{{- if eq $p.enabled false -}}
{{- fail (printf "pools.%s cannot be disabled: a request needs a %s engine" $name $name) -}}
{{- end -}}
{{- if lt (int $p.replicas) 1 -}}
{{- fail (printf "pools.%s.replicas must be at least 1: deepinfer serve starts with one engine per pool" $name) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value -}}
{{- fail "apiKey: give existingSecret or value, not both" -}}
{{- end -}}
{{- end -}}
