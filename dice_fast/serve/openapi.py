"""What the OpenAPI document (``/openapi.json``) says of each route: its request body's JSON schema,
with the core's own limits (`request_schemas`), the response bodies' schemas, and every status code
with its meaning, in OpenAI's error shape. Used by `create_app`; parsing does not use the schemas
(`dice_fast.serve.schemas` checks the same rules and names the culprit), but a schema-driven fuzzer
holds the two to each other (tests/serve/test_serve_openapi.py)."""

from __future__ import annotations

from ..config import STRATEGIES
from ..scoring import DEFAULT_SCORING, SCORINGS
from .schemas import ENCODING_FORMATS, INPUT_TYPES

STRATEGY = {"enum": [*STRATEGIES, None], "description": "how documents are encoded (default: the server's); queries "
            "are one window under every strategy"}

# a text with a character that str.strip() keeps: every character but those str.isspace() calls
# whitespace, spelled out, since ECMA-262's \s (JSON Schema's dialect) is another set (it lacks \x1c-\x1f
# and \x85, and has \ufeff); tests/serve/test_serve_openapi.py checks it against str.strip() for every
# code point
TEXT_PATTERN = ("[^\\x09-\\x0d\\x1c-\\x20\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f"
                "\\u205f\\u3000]")


def request_schemas(core) -> tuple[dict, dict]:
    """(the /v1/embeddings body's schema, the /v1/evidence body's) for the `AsyncDiceEncoder` ``core``:
    its width, inputs per request and characters per input are the schemas' bounds."""
    text = {"type": "string", "minLength": 1, "maxLength": core.max_input_chars, "pattern": TEXT_PATTERN,
            "description": "valid Unicode (no lone surrogate), not only whitespace"}
    texts = {"oneOf": [text, {"type": "array", "minItems": 1, "maxItems": core.max_inputs_per_request,
                              "items": text}]}
    queries = [k for k, v in INPUT_TYPES.items() if v == "query"]
    embeddings = {
        "type": "object", "required": ["input"],
        "properties": {
            "input": texts,
            "model": {"type": ["string", "null"]},
            "encoding_format": {"enum": [*ENCODING_FORMATS, None], "default": "float"},
            "input_type": {"enum": [*INPUT_TYPES, None], "default": "document"},
            "dimensions": {"type": ["integer", "null"], "minimum": 1, "maximum": core.dim},
            "return_chunks": {"type": ["boolean", "null"], "default": False, "description": "documents only"},
            "strategy": STRATEGY,
            "user": {"type": ["string", "null"]},
        },
        # a query is one window: return_chunks true is refused with it
        "if": {"required": ["input_type"], "properties": {"input_type": {"enum": queries}}},
        "then": {"properties": {"return_chunks": {"enum": [False, None]}}},
    }
    evidence = {
        "type": "object", "required": ["query", "documents"],
        "properties": {
            "query": text, "documents": texts,
            "scoring": {"enum": [*SCORINGS, None], "default": DEFAULT_SCORING},
            "alpha": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "strategy": STRATEGY,
        },
    }
    return embeddings, evidence

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}},
}
MEANINGS = {
    400: "a malformed body, param naming the field (code invalid_request), as OpenAI's API answers it; or a Host "
         "header this server does not answer to (code host_not_allowed)",
    401: "no API key, or a wrong one (code invalid_api_key; with WWW-Authenticate: Bearer)",
    404: "no such route (or, for /v1/models/{model}, no such model: code model_not_found)", 405: "method not allowed on this route",
    408: "the request body did not arrive within the read timeout (code request_timeout)",
    413: "over a size limit: body bytes, inputs, characters, tokens or response floats (code request_too_large)",
    415: "the body is not declared as JSON in UTF-8 (code unsupported_media_type)",
    429: "the queue or the concurrency limit is full; retry after Retry-After seconds (code overloaded)",
    500: "the model failed: its output for an input holds NaN or an infinity (code non_finite_output, param "
         "names it), or another failure (code internal_error); never the client's fault",
    503: "shutting down, out of memory for an input (param names it), or unhealthy",
    504: "past the request timeout (code timeout)",
}
_VECTOR = {"oneOf": [{"type": "array", "items": {"type": "number"}},
                     {"type": "string", "description": "base64 of little-endian float32"}]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
                         "truncated_inputs": {"type": "array", "items": {"type": "integer"}}}}
EMBEDDING_RESPONSE = {
    "type": "object", "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"}, "model": {"type": "string"}, "usage": _USAGE,
        "data": {"type": "array", "items": {
            "type": "object", "required": ["object", "index", "embedding"],
            "properties": {"object": {"const": "embedding"}, "index": {"type": "integer"}, "embedding": _VECTOR,
                           "chunks": {"type": "array", "items": {
                               "type": "object", "required": ["embedding", "start_char", "end_char", "tokens"],
                               "properties": {"embedding": _VECTOR, "start_char": {"type": "integer"},
                                              "end_char": {"type": "integer"}, "tokens": {"type": "integer"}}}}}}},
    },
}
EVIDENCE_RESPONSE = {
    "type": "object", "required": ["object", "data", "scoring", "model", "usage"],
    "properties": {
        "object": {"const": "list"}, "scoring": {"type": "string"}, "model": {"type": "string"}, "usage": _USAGE,
        "data": {"type": "array", "items": {
            "type": "object", "required": ["index", "score", "chunk", "start_char", "end_char", "chunk_score", "text"],
            "properties": {"index": {"type": "integer"}, "score": {"type": "number"}, "chunk": {"type": "integer"},
                           "start_char": {"type": "integer"}, "end_char": {"type": "integer"},
                           "chunk_score": {"type": "number"}, "text": {"type": "string"}}}},
    },
}
HEALTH_RESPONSE = {
    "type": "object", "required": ["status", "model", "queue_tokens", "requests_in_flight"],
    "properties": {"status": {"enum": ["ok", "starting", "draining", "unhealthy"]}, "model": {"type": "string"},
                   "queue_tokens": {"type": "integer"}, "requests_in_flight": {"type": "integer"},
                   "detail": {"type": "string"}},
}
MODEL_RESPONSE = {
    "type": "object", "required": ["id", "object", "created", "owned_by", "dimensions"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "dimensions": {"type": "integer"}},
}
MODELS_RESPONSE = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_RESPONSE}},
}
POST_ERRORS = (400, 408, 413, 415, 429, 500, 503, 504)


def responses(ok: dict | None, errors=(), *, keyed: bool, host_checked: bool, ok_type: str = "application/json",
              ok_status: str = "the result") -> dict:
    """FastAPI's ``responses=`` for a route: 200 with ``ok`` (a JSON schema; None: a text body of
    ``ok_type``), each code of ``errors`` in the error shape, plus 401 when ``keyed`` and 400 when
    ``host_checked``."""
    schema = {"type": "string"} if ok is None else ok
    out = {200: {"description": ok_status, "content": {ok_type: {"schema": schema}}}}
    codes = sorted(set(errors) | ({401} if keyed else set()) | ({400} if host_checked else set()))
    for code in codes:
        out[code] = {"description": MEANINGS[code], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return out


def without_unsent_422(schema: dict) -> dict:
    """``schema`` (FastAPI's document) without the 422 "Validation Error" FastAPI adds to a route with a
    path parameter: no route of this server sends it (its errors are OpenAI-shaped, 400)."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
