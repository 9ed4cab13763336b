{{/* The head pod: `ray start --head` (KubeRay's generated command, without --block), then
`deepinfer serve` joining that Ray, with the pools' start sizes in engines. */}}

{{- define "deepinfer.serveArgs" -}}
{{- $v := .Values -}}
{{- $args := list "--ray-address=auto" "--cluster-host=auto" "--host=0.0.0.0" -}}
{{- $args = append $args (printf "--port=%d" (int $v.gateway.httpPort)) -}}
{{- $args = append $args (printf "--grpc-port=%d" (int $v.gateway.grpcPort)) -}}
{{- range $name := list "prefill" "decode" -}}
{{- $pool := index $v.pools $name -}}
{{- $args = append $args (printf "--%s=%d" $name (mul (int $pool.replicas) (int (include "deepinfer.enginesPerPod" $pool)))) -}}
{{- end -}}
{{- $enc := $v.pools.encoder -}}
{{- $args = append $args (printf "--encoder=%d" (ternary (mul (int $enc.replicas) (int (include "deepinfer.enginesPerPod" $enc))) 0 (eq (toString $enc.enabled) "true"))) -}}
{{- $args = append $args "--pools-config=/etc/deepinfer/pools.json" -}}
{{- if $v.autoscaling.enabled -}}{{- $args = append $args "--autoscale" -}}{{- end -}}
{{- with include "deepinfer.modelDir" . -}}{{- $args = append $args (printf "--model=%s" .) -}}{{- end -}}
{{- with $v.model.servedModelName -}}{{- $args = append $args (printf "--served-model-name=%s" .) -}}{{- end -}}
{{- $e := $v.engine -}}
{{- $args = append $args (printf "--dtype=%s" $e.dtype) -}}
{{- $args = append $args (printf "--max-num-seqs=%d" (int $e.maxNumSeqs)) -}}
{{- with $e.maxModelLen -}}{{- $args = append $args (printf "--max-model-len=%d" (int .)) -}}{{- end -}}
{{- with $e.blockSize -}}{{- $args = append $args (printf "--block-size=%d" (int .)) -}}{{- end -}}
{{- with $e.numBlocks -}}{{- $args = append $args (printf "--num-blocks=%d" (int .)) -}}{{- end -}}
{{- $args = append $args (printf "--max-concurrent-requests=%d" (int $v.gateway.maxConcurrentRequests)) -}}
{{- with $v.gateway.requestTimeout -}}{{- $args = append $args (printf "--request-timeout=%v" .) -}}{{- end -}}
{{- range $v.gateway.extraArgs -}}{{- $args = append $args . -}}{{- end -}}
{{- $quoted := list -}}
{{- range $args }}{{ $quoted = append $quoted (squote .) }}{{ end -}}
{{- join " " $quoted -}}
{{- end -}}

{{- define "deepinfer.headScript" -}}
set -e
ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}"
# KubeRay's `ray start --head` for this group, returning once Ray is up instead of blocking
${KUBERAY_GEN_RAY_START_CMD/--block/}
exec deepinfer --log-level={{ .Values.gateway.logLevel }} serve {{ include "deepinfer.serveArgs" . }}{{ if include "deepinfer.hasApiKey" . }} --api-key="${DEEPINFER_API_KEY}"{{ end }}
{{- end -}}

{{- define "deepinfer.headGroup" -}}
{{- $v := .Values -}}
rayStartParams:
  {{- toYaml (mergeOverwrite (deepCopy $v.head.rayStartParams) (dict "num-cpus" "0" "dashboard-host" "0.0.0.0")) | nindent 2 }}
template:
  metadata:
    labels:
      {{- include "deepinfer.labels" . | nindent 6 }}
      app.kubernetes.io/component: head
      {{- with $v.head.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      # the container runs the script below; KubeRay hands it its `ray start` in KUBERAY_GEN_RAY_START_CMD
      ray.io/overwrite-container-cmd: "true"
      checksum/pools: {{ include "deepinfer.poolsConfig" . | sha256sum }}
      {{- with $v.head.annotations }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  spec:
    {{- include "deepinfer.podCommon" (dict "root" . "nodeSelector" $v.head.nodeSelector "tolerations" $v.head.tolerations "affinity" $v.head.affinity) | nindent 4 }}
    containers:
      - name: ray-head
        image: {{ include "deepinfer.image" . }}
        imagePullPolicy: {{ $v.image.pullPolicy }}
        command: ["/bin/bash", "-c", "--"]
        args:
          - |
            {{- include "deepinfer.headScript" . | nindent 12 }}
        ports:
          - {name: gcs, containerPort: 6379}
          - {name: dashboard, containerPort: 8265}
          - {name: client, containerPort: 10001}
          - {name: http, containerPort: {{ $v.gateway.httpPort }}}
          - {name: grpc, containerPort: {{ $v.gateway.grpcPort }}}
        # ready = the gateway's /health: 503 until every pool has a ready engine
        readinessProbe:
          httpGet: {path: /health, port: http}
          periodSeconds: 5
          failureThreshold: 3
        # alive = the gateway answers at all (/health is 503 while pods are still being added)
        livenessProbe:
          httpGet: {path: /metrics, port: http}
          periodSeconds: 15
          timeoutSeconds: 10
          failureThreshold: 4
        startupProbe:
          httpGet: {path: /metrics, port: http}
          periodSeconds: 5
          failureThreshold: 120
        env:
          - name: RAY_USAGE_STATS_ENABLED
            value: "0"
          {{- if include "deepinfer.hasApiKey" . }}
          - name: DEEPINFER_API_KEY
            valueFrom:
              secretKeyRef:
                name: {{ include "deepinfer.apiKeySecret" . }}
                key: {{ $v.apiKey.secretKey }}
          {{- end }}
          {{- with $v.head.env }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
        resources:
          {{- toYaml $v.head.resources | nindent 10 }}
        securityContext:
          allowPrivilegeEscalation: false
        volumeMounts:
          - {name: dshm, mountPath: /dev/shm}
          - {name: pools, mountPath: /etc/deepinfer, readOnly: true}
          {{- with (include "deepinfer.modelMounts" . | trim) }}{{ . | nindent 10 }}{{ end }}
    volumes:
      {{- include "deepinfer.shmVolume" $v.head.shmSize | nindent 6 }}
      - name: pools
        configMap:
          name: {{ include "deepinfer.fullname" . }}-pools
      {{- with (include "deepinfer.modelVolumes" . | trim) }}{{ . | nindent 6 }}{{ end }}
{{- end -}}

{{/* Pod fields every pod shares. Takes (dict "root" $ "nodeSelector" ... "tolerations" ... "affinity" ...). */}}
{{- define "deepinfer.podCommon" -}}
{{- $v := .root.Values -}}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
