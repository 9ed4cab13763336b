"""The gateway's gRPC API (`deepinfer.v1.Gateway`): a thin layer over GatewayCore.

A streamed `Generate` of one sample takes the fast lane (`grpc_lane.py`): most of its messages come
already serialized, and its method's serializer (`RAW_RESPONSES`) sends bytes as they are."""

from __future__ import annotations

import base64
import uuid

from deepinfer_proto import gateway_pb2, gateway_pb2_grpc
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import handles_errors
from services.common.messages import fill_delta
from services.gateway import validation
from services.gateway.core import GatewayCore, usage
from services.gateway.grpc_lane import GrpcLane


def authorization(context) -> str:
    """The request's `authorization` metadata ("" without one)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return ""


def _chat_message(m) -> dict:
    """A proto chat message as the OpenAI API's: its parts (images as data URLs, which the
    gateway's media checks decode like any other) or its plain content."""
    if not m.parts:
        return {"role": m.role, "content": m.content}
    parts = []
    for p in m.parts:
        if p.WhichOneof("part") == "image":
            url = "data:image;base64," + base64.b64encode(p.image).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": p.text})
    return {"role": m.role, "content": parts}


RAW_RESPONSES = frozenset({"Generate"})
"""Methods whose handler may yield a message's wire bytes instead of the message (`add_lenient`)."""


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    @handles_errors
    async def Generate(self, request, context):
        core = self.core
        core.check_api_key(authorization(context))
        validation.check_model(request.model, core.config.model_name)
        prompt, param, images = await self._prompt(request)
        fields = {
            f.name: v if isinstance(v, (int, float, bool, str)) else list(v) for f, v in request.params.ListFields()
        }
        if fields.get("max_tokens") == 0:  # the proto's "up to the context length"
            fields["max_tokens"] = None
        params = core.prepare([prompt], fields, param)
        request_id = request.request_id or uuid.uuid4().hex
        work = core.admit([prompt], params)
        try:
            choices = {}
            response = gateway_pb2.GenerateResponse
            lane = GrpcLane.for_request(request_id, params, context)
            stream = core.generate([prompt], params, request_id, images, lane=lane)
            if lane is not None:
                stream = lane.messages(stream)
            async for item in stream:
                if item.__class__ is bytes:  # a message the fast lane made, sent as it is
                    yield item
                    continue
                choice, delta = item
                choices[choice.index] = choice
                msg = response(request_id=request_id)
                fill_delta(msg.delta, delta)  # written in place: no submessage built and copied
                yield msg
            u = usage(list(choices.values()))
            yield gateway_pb2.GenerateResponse(
                request_id=request_id,
                usage=gateway_pb2.Usage(
                    prompt_tokens=u["prompt_tokens"],
                    completion_tokens=u["completion_tokens"],
                    cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
                ),
            )
        finally:
            core.release(work)

    async def _prompt(self, request) -> tuple[list[int], str, list[bytes]]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return (await self.core.encode_prompts(request.text))[0], "text", []
        if which == "token_ids":
            return (await self.core.encode_prompts(list(request.token_ids.ids)))[0], "token_ids", []
        if which == "chat":
            prompt, images = await self.core.encode_chat([_chat_message(m) for m in request.chat.messages])
            return prompt, "chat", images
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "set one of text, token_ids or chat", "prompt")

    async def Health(self, request, context):
        ready, detail = await self.core.ready()
        return gateway_pb2.HealthCheckReply(ready=ready, detail=detail)

    @handles_errors
    async def Models(self, request, context):
        self.core.check_api_key(authorization(context))
        info = gateway_pb2.ModelInfo(id=self.core.config.model_name, max_model_len=self.core.config.max_model_len)
        return gateway_pb2.ModelsReply(models=[info])
