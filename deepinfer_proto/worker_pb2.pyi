from deepinfer_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_target", "images", "image_embeds", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv_target: _common_pb2.KVTarget
    images: _containers.RepeatedScalarFieldContainer[bytes]
    image_embeds: _containers.RepeatedCompositeFieldContainer[EmbeddingHandle]
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_target: _Optional[_Union[_common_pb2.KVTarget, _Mapping]] = ..., images: _Optional[_Iterable[bytes]] = ..., image_embeds: _Optional[_Iterable[_Union[EmbeddingHandle, _Mapping]]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first", "kv_bytes", "kv_seconds", "queue_seconds", "kv_exposed_seconds", "embeds_seconds")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_EXPOSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first: _common_pb2.SampleDelta
    kv_bytes: int
    kv_seconds: float
    queue_seconds: float
    kv_exposed_seconds: float
    embeds_seconds: float
    def __init__(self, first: _Optional[_Union[_common_pb2.SampleDelta, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., kv_exposed_seconds: _Optional[float] = ..., embeds_seconds: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "lease_s", "subscriber_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_s: float
    subscriber_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_s: _Optional[float] = ..., subscriber_id: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("kv_target",)
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    kv_target: _common_pb2.KVTarget
    def __init__(self, kv_target: _Optional[_Union[_common_pb2.KVTarget, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GenerateWork(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "subscriber_id", "images", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    subscriber_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., subscriber_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("works",)
    WORKS_FIELD_NUMBER: _ClassVar[int]
    works: _containers.RepeatedCompositeFieldContainer[GenerateWork]
    def __init__(self, works: _Optional[_Iterable[_Union[GenerateWork, _Mapping]]] = ...) -> None: ...

class SubmitBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SubmitOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SubmitOutcome, _Mapping]]] = ...) -> None: ...

class SubmitOutcome(_message.Message):
    __slots__ = ("status", "message", "retry_after_s")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    status: int
    message: str
    retry_after_s: float
    def __init__(self, status: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber_id",)
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    def __init__(self, subscriber_id: _Optional[str] = ...) -> None: ...

class DeltaBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    def __init__(self, items: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "delta")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: _common_pb2.SampleDelta
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.SampleDelta, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "unused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    unused: bool
    def __init__(self, request_id: _Optional[str] = ..., unused: _Optional[bool] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LeaseRenewal(_message.Message):
    __slots__ = ("request_id", "lease_s", "expires_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_s: float
    expires_at: float
    def __init__(self, request_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., expires_at: _Optional[float] = ...) -> None: ...

class LeaseRenewalReply(_message.Message):
    __slots__ = ("found", "expires_at")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    expires_at: float
    def __init__(self, found: _Optional[bool] = ..., expires_at: _Optional[float] = ...) -> None: ...

class ConnectPeerRequest(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "region")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    region: _common_pb2.KVRegion
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., region: _Optional[_Union[_common_pb2.KVRegion, _Mapping]] = ...) -> None: ...

class ConnectPeerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DisconnectPeerRequest(_message.Message):
    __slots__ = ("agent_name",)
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    def __init__(self, agent_name: _Optional[str] = ...) -> None: ...

class DisconnectPeerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[EmbeddingHandle]
    def __init__(self, handles: _Optional[_Iterable[_Union[EmbeddingHandle, _Mapping]]] = ...) -> None: ...

class EmbeddingHandle(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "addr", "num_bytes", "shape", "dtype", "content_hash", "lease_id", "expires_at", "mem_type", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    addr: int
    num_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    content_hash: int
    lease_id: int
    expires_at: float
    mem_type: str
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., addr: _Optional[int] = ..., num_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., content_hash: _Optional[int] = ..., lease_id: _Optional[int] = ..., expires_at: _Optional[float] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ok", "detail")
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    detail: str
    def __init__(self, ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    def __init__(self, requests: _Optional[int] = ...) -> None: ...
