{{/* One worker group. Takes (dict "root" $ "name" <pool>). Its Ray nodes offer `deepinfer_<pool>`,
one unit per engine that fits on a pod: the controller asks for one unit per engine, so the engine
lands here, and Ray's autoscaler adds a pod of this group when an engine waits for one. */}}

{{- define "deepinfer.workerGroup" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $pool := index $v.pools .name -}}
{{- $engines := include "deepinfer.enginesPerPod" $pool -}}
{{- $resource := printf "{\"deepinfer_%s\": %s}" .name $engines -}}
{{- $limits := dict "cpu" $pool.cpu "memory" $pool.memory -}}
{{- if gt (int $pool.gpus) 0 -}}{{- $_ := set $limits $v.gpuResourceName (int $pool.gpus) -}}{{- end -}}
{{- $limits = mergeOverwrite $limits (deepCopy $pool.extraResources) -}}
- groupName: {{ .name }}
  replicas: {{ $pool.replicas }}
  minReplicas: {{ $pool.minReplicas }}
  maxReplicas: {{ $pool.maxReplicas }}
  rayStartParams:
    {{- toYaml (mergeOverwrite (deepCopy $pool.rayStartParams) (dict "resources" (printf "%q" $resource))) | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "deepinfer.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .name }}
      {{- with $pool.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "deepinfer.podCommon" (dict "root" $root "nodeSelector" $pool.nodeSelector "tolerations" $pool.tolerations "affinity" $pool.affinity) | nindent 6 }}
      containers:
        - name: ray-worker
          image: {{ include "deepinfer.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          env:
            - name: RAY_USAGE_STATS_ENABLED
              value: "0"
            {{- with $pool.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            limits:
              {{- toYaml $limits | nindent 14 }}
            requests:
              {{- toYaml $limits | nindent 14 }}
          securityContext:
            allowPrivilegeEscalation: false
          lifecycle:
            preStop:
              exec:
                command: ["/bin/sh", "-c", "ray stop"]
          volumeMounts:
            - {name: dshm, mountPath: /dev/shm}
            {{- with (include "deepinfer.modelMounts" $root | trim) }}{{ . | nindent 12 }}{{ end }}
      volumes:
        {{- include "deepinfer.shmVolume" $pool.shmSize | nindent 8 }}
        {{- with (include "deepinfer.modelVolumes" $root | trim) }}{{ . | nindent 8 }}{{ end }}
{{- end -}}
