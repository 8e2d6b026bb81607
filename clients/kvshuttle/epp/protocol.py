"""The endpoint picker protocol v1.0.0 of the Gateway API Inference Extension
(kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol)
over Envoy's ext_proc messages: the names it fixes, what the data plane tells the picker (the
request's headers, the subset hint, the endpoint that served) and the messages the picker
answers with. No gRPC and no planning here: kvshuttle.epp.servicer drives the stream.

- Subset hint (data plane -> picker): `metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`, a list of `ip:port` (or a comma-separated string
  of them; a bare address allows each of its ports). Set, the pick must be one of them.
- Destination (picker -> data plane): the `x-gateway-destination-endpoint` header and the same
  value in `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]`, with
  `clear_route_cache` so that Envoy routes on the new header.
- Served (data plane -> picker, response path): `metadata_context.filter_metadata["envoy.lb"]
  ["x-gateway-destination-endpoint-served"]`; data planes that report it as a response header of
  that name are read too.
- Refusals: an ImmediateResponse, 503 when no endpoint is eligible, 429 when shedding load.

Bodies are FULL_DUPLEX_STREAMED: Envoy streams the request body to the picker and forwards
upstream only what the picker streams back (`streamed_response` body mutations, in chunks of at
most BODY_CHUNK_BYTES, the last one with end_of_stream), and it does not wait for an answer per
chunk; the headers' answer is deferred until the body has ended, since the pick needs the body.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvshuttle.core.endpoints import EndpointSet, parse_host_port
from kvshuttle.core.limits import MAX_DECODE_ENDPOINTS

__all__ = [
    "BODY_CHUNK_BYTES",
    "DESTINATION_ENDPOINT",
    "DESTINATION_NAMESPACE",
    "FULL_DUPLEX_STREAMED",
    "SERVED_ENDPOINT",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "Subset",
    "body_responses",
    "header_values",
    "headers_response",
    "immediate_response",
    "served_endpoint",
    "subset_hint",
]

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
SERVED_ENDPOINT = "x-gateway-destination-endpoint-served"
# The reference picker's bound per streamed chunk: some data planes take at most 64 KiB.
BODY_CHUNK_BYTES = 62_000
# Subset entries read, at most (a pool is a few hundred pods): what the router takes in
# hints.decode_endpoints.
MAX_SUBSET_ENTRIES = MAX_DECODE_ENDPOINTS

FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_values(headers: ext.HttpHeaders) -> dict[str, str]:
    """Lower-cased name -> the first value (Envoy sends `raw_value`; older ones `value`)."""
    found: dict[str, str] = {}
    for header in headers.headers.headers:
        key = header.key.lower()
        if key not in found:
            found[key] = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
    return found


def _namespace(message: ext.ProcessingRequest, namespace: str) -> struct_pb2.Struct | None:
    if not message.HasField("metadata_context"):
        return None
    filters = message.metadata_context.filter_metadata
    found: struct_pb2.Struct | None = filters.get(namespace)
    return found


# The endpoints the data plane allows (the same set the router's hints.decode_endpoints names).
Subset = EndpointSet


def subset_hint(message: ext.ProcessingRequest) -> Subset | None:
    """The subset the message's metadata names; None when it names none (the whole pool). An
    entry that is no endpoint (nor a bare address) is left out: a hint of nothing valid allows
    nothing."""
    struct = _namespace(message, SUBSET_NAMESPACE)
    if struct is None or SUBSET_KEY not in struct.fields:
        return None
    value = struct.fields[SUBSET_KEY]
    raw: list[str] = []
    if value.HasField("string_value"):
        raw = value.string_value.split(",")
    elif value.HasField("list_value"):
        for item in value.list_value.values[:MAX_SUBSET_ENTRIES]:
            if item.HasField("string_value"):
                raw.extend(item.string_value.split(","))
    subset, _ = EndpointSet.parse(e for e in (e.strip() for e in raw[:MAX_SUBSET_ENTRIES]) if e)
    return subset


def served_endpoint(message: ext.ProcessingRequest, headers: Mapping[str, str]) -> str | None:
    """The endpoint the data plane says served the request (canonical when it parses), from the
    response's metadata or, failing that, a response header of the same name."""
    struct = _namespace(message, DESTINATION_NAMESPACE)
    value: str | None = None
    if struct is not None and SERVED_ENDPOINT in struct.fields:
        field = struct.fields[SERVED_ENDPOINT]
        if field.HasField("string_value"):
            value = field.string_value
    if value is None:
        value = headers.get(SERVED_ENDPOINT)
    if not value:
        return None
    first = value.split(",")[0].strip()
    try:
        return parse_host_port(first)
    except ValueError:
        return first[:300]


def headers_response(
    endpoint: str, set_headers: Mapping[str, str], remove_headers: Sequence[str]
) -> ext.ProcessingResponse:
    """The request headers' answer carrying the pick: `endpoint` as the destination header and
    metadata, `set_headers` overwriting any copy the client sent, `remove_headers` dropped."""
    options = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
        )
        for key, value in {DESTINATION_ENDPOINT: endpoint, **set_headers}.items()
    ]
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value = endpoint
    return ext.ProcessingResponse(
        request_headers=ext.HeadersResponse(
            response=ext.CommonResponse(
                header_mutation=ext.HeaderMutation(set_headers=options, remove_headers=list(remove_headers)),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=metadata,
    )


def body_responses(body: bytes, *, request: bool, end_of_stream: bool) -> Iterator[ext.ProcessingResponse]:
    """`body` streamed back unchanged as FULL_DUPLEX_STREAMED mutations, in chunks of at most
    BODY_CHUNK_BYTES; the last one carries `end_of_stream` (an empty body is one empty chunk)."""
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        mutation = ext.BodyMutation(
            streamed_response=ext.StreamedBodyResponse(
                body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1
            )
        )
        answer = ext.BodyResponse(response=ext.CommonResponse(body_mutation=mutation))
        if request:
            yield ext.ProcessingResponse(request_body=answer)
        else:
            yield ext.ProcessingResponse(response_body=answer)


def immediate_response(status: int, body: bytes, details: str) -> ext.ProcessingResponse:
    """Answer the client directly with `status` and a JSON `body`; `details` goes to Envoy's
    access log (%RESPONSE_CODE_DETAILS%)."""
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                        append_action=_OVERWRITE,
                    )
                ]
            ),
            body=body,
            details=details,
        )
    )
