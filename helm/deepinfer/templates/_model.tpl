{{/* The model's volume, its mount and the `--model` argument, the same in every pod. */}}

{{- define "deepinfer.modelVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    {{- with $m.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "deepinfer.modelMounts" -}}
{{- if has .Values.model.source (list "pvc" "hostPath") }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The directory `deepinfer serve --model` is given; "" for the embedded model. */}}
{{- define "deepinfer.modelDir" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" -}}
{{ $m.path }}
{{- else if has $m.source (list "pvc" "hostPath") -}}
{{ trimSuffix "/" (printf "%s/%s" $m.mountPath (trimPrefix "/" $m.path)) }}
{{- end -}}
{{- end -}}

{{/* /dev/shm of a pod: Ray's object store and torch's shared tensors need more than the runtime's 64 MiB. */}}
{{- define "deepinfer.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end -}}
