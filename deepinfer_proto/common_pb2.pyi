from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NORMAL: _ClassVar[EngineType]
    PROMPT: _ClassVar[EngineType]
    COMPLETION: _ClassVar[EngineType]

class Pool(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_UNSPECIFIED: _ClassVar[Pool]
    POOL_ENCODER: _ClassVar[Pool]
    POOL_PREFILL: _ClassVar[Pool]
    POOL_DECODE: _ClassVar[Pool]
    POOL_COLOCATED: _ClassVar[Pool]
NORMAL: EngineType
PROMPT: EngineType
COMPLETION: EngineType
POOL_UNSPECIFIED: Pool
POOL_ENCODER: Pool
POOL_PREFILL: Pool
POOL_DECODE: Pool
POOL_COLOCATED: Pool

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    class TopEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.ScalarMap[int, float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Mapping[int, float]] = ...) -> None: ...

class SampleDelta(_message.Message):
    __slots__ = ("index", "token_offset", "token_ids", "text_offset", "text", "logprobs", "finish_reason", "stop_token_id", "stop_string", "error", "num_cached_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_offset: int
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    stop_token_id: int
    stop_string: str
    error: str
    num_cached_tokens: int
    def __init__(self, index: _Optional[int] = ..., token_offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_offset: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., error: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "pool", "engine_type", "address", "metrics_address", "agent_name", "agent_metadata", "model", "max_model_len", "block_size", "num_blocks", "max_num_seqs", "pid", "kv_region")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    KV_REGION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: Pool
    engine_type: EngineType
    address: str
    metrics_address: str
    agent_name: str
    agent_metadata: bytes
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    pid: int
    kv_region: KVRegion
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[_Union[Pool, str]] = ..., engine_type: _Optional[_Union[EngineType, str]] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., pid: _Optional[int] = ..., kv_region: _Optional[_Union[KVRegion, _Mapping]] = ...) -> None: ...

class KVRegion(_message.Message):
    __slots__ = ("base_addr", "num_blocks_total", "device_id", "mem_type", "fingerprint", "layout")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    num_blocks_total: int
    device_id: int
    mem_type: str
    fingerprint: str
    layout: str
    def __init__(self, base_addr: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("request_id", "engine_id", "agent_metadata", "base_addr", "num_blocks_total", "device_id", "mem_type", "block_ids", "fingerprint", "num_prompt_tokens", "expires_at", "layout")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_id: str
    agent_metadata: bytes
    base_addr: int
    num_blocks_total: int
    device_id: int
    mem_type: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    num_prompt_tokens: int
    expires_at: float
    layout: str
    def __init__(self, request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., expires_at: _Optional[float] = ..., layout: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "queued_prompt_tokens", "running_requests", "waiting_requests", "total_kv_tokens", "kv_usage", "free_blocks", "num_blocks", "requests", "reservations", "prefix_queries", "prefix_hits", "kv_transfer_bytes", "handoffs", "draining", "open_streams", "computed_prompt_tokens", "kv_store_hit_tokens_l2", "kv_store_hit_tokens_l3", "kv_store_miss_tokens", "kv_store_load_bytes_l2", "kv_store_load_bytes_l3", "kv_store_saved_bytes", "kv_store_load_seconds", "kv_store_load_failures", "kv_store_corrupt_entries", "kv_store_evictions_l2", "kv_store_evictions_l3", "kv_store_l2_bytes", "kv_store_l3_bytes", "kv_store_loads", "kv_store_l2_capacity_bytes", "kv_store_l3_capacity_bytes", "local_prefills", "encoder_images", "encoder_cache_hits", "encoder_queue_images", "embedding_leases", "spec_draft_tokens", "spec_accepted_tokens", "spec_proposed_per_position", "spec_accepted_per_position", "transfer_peers", "ep_rank", "ep_size", "dummy_steps", "eplb_rearrangements", "moe_load_imbalance", "fenced_reservations", "embedding_lease_renewals")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_HIT_TOKENS_L2_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_HIT_TOKENS_L3_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_BYTES_L2_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_BYTES_L3_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CORRUPT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_EVICTIONS_L2_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_EVICTIONS_L3_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_L2_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_L3_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_L2_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_L3_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_QUEUE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_LEASES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PEERS_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DUMMY_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPLB_REARRANGEMENTS_FIELD_NUMBER: _ClassVar[int]
    MOE_LOAD_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    FENCED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_LEASE_RENEWALS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queued_prompt_tokens: int
    running_requests: int
    waiting_requests: int
    total_kv_tokens: int
    kv_usage: float
    free_blocks: int
    num_blocks: int
    requests: int
    reservations: int
    prefix_queries: int
    prefix_hits: int
    kv_transfer_bytes: int
    handoffs: int
    draining: bool
    open_streams: int
    computed_prompt_tokens: int
    kv_store_hit_tokens_l2: int
    kv_store_hit_tokens_l3: int
    kv_store_miss_tokens: int
    kv_store_load_bytes_l2: int
    kv_store_load_bytes_l3: int
    kv_store_saved_bytes: int
    kv_store_load_seconds: float
    kv_store_load_failures: int
    kv_store_corrupt_entries: int
    kv_store_evictions_l2: int
    kv_store_evictions_l3: int
    kv_store_l2_bytes: int
    kv_store_l3_bytes: int
    kv_store_loads: int
    kv_store_l2_capacity_bytes: int
    kv_store_l3_capacity_bytes: int
    local_prefills: int
    encoder_images: int
    encoder_cache_hits: int
    encoder_queue_images: int
    embedding_leases: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    spec_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    transfer_peers: int
    ep_rank: int
    ep_size: int
    dummy_steps: int
    eplb_rearrangements: int
    moe_load_imbalance: float
    fenced_reservations: int
    embedding_lease_renewals: int
    def __init__(self, worker_id: _Optional[str] = ..., queued_prompt_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., total_kv_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., requests: _Optional[int] = ..., reservations: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., handoffs: _Optional[int] = ..., draining: _Optional[bool] = ..., open_streams: _Optional[int] = ..., computed_prompt_tokens: _Optional[int] = ..., kv_store_hit_tokens_l2: _Optional[int] = ..., kv_store_hit_tokens_l3: _Optional[int] = ..., kv_store_miss_tokens: _Optional[int] = ..., kv_store_load_bytes_l2: _Optional[int] = ..., kv_store_load_bytes_l3: _Optional[int] = ..., kv_store_saved_bytes: _Optional[int] = ..., kv_store_load_seconds: _Optional[float] = ..., kv_store_load_failures: _Optional[int] = ..., kv_store_corrupt_entries: _Optional[int] = ..., kv_store_evictions_l2: _Optional[int] = ..., kv_store_evictions_l3: _Optional[int] = ..., kv_store_l2_bytes: _Optional[int] = ..., kv_store_l3_bytes: _Optional[int] = ..., kv_store_loads: _Optional[int] = ..., kv_store_l2_capacity_bytes: _Optional[int] = ..., kv_store_l3_capacity_bytes: _Optional[int] = ..., local_prefills: _Optional[int] = ..., encoder_images: _Optional[int] = ..., encoder_cache_hits: _Optional[int] = ..., encoder_queue_images: _Optional[int] = ..., embedding_leases: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_proposed_per_position: _Optional[_Iterable[int]] = ..., spec_accepted_per_position: _Optional[_Iterable[int]] = ..., transfer_peers: _Optional[int] = ..., ep_rank: _Optional[int] = ..., ep_size: _Optional[int] = ..., dummy_steps: _Optional[int] = ..., eplb_rearrangements: _Optional[int] = ..., moe_load_imbalance: _Optional[float] = ..., fenced_reservations: _Optional[int] = ..., embedding_lease_renewals: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "state", "inflight", "prefix_chunks")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    state: str
    inflight: int
    prefix_chunks: int
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., state: _Optional[str] = ..., inflight: _Optional[int] = ..., prefix_chunks: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "target", "workers", "ranks_per_instance")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    target: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    ranks_per_instance: int
    def __init__(self, pool: _Optional[_Union[Pool, str]] = ..., target: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., ranks_per_instance: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("pools", "model", "ready", "detail", "dead_workers")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DEAD_WORKERS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    model: str
    ready: bool
    detail: str
    dead_workers: _containers.RepeatedCompositeFieldContainer[DeadWorker]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., model: _Optional[str] = ..., ready: _Optional[bool] = ..., detail: _Optional[str] = ..., dead_workers: _Optional[_Iterable[_Union[DeadWorker, _Mapping]]] = ...) -> None: ...

class DeadWorker(_message.Message):
    __slots__ = ("worker_id", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pid: int
    def __init__(self, worker_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
