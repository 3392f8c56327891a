"""The OpenAI-shaped embeddings request and response: parsing with errors that name the culprit,
and serialisation. No web framework here; the app passes bytes in and gets bytes out.

Request (``POST /v1/embeddings``), a JSON object:
    input            a string or a non-empty list of non-empty strings (required)
    model            a string, echoed as given by the server's model name (optional, not checked)
    encoding_format  "float" (default) or "base64" (little-endian float32 bytes, as OpenAI)
    input_type       "document" (default: chunked and aggregated) or "query" (one window); Cohere's and
                     Nomic's "search_document" / "search_query" are accepted too
    dimensions       optional, 1 .. the served width: the first ``dimensions`` components of every vector,
                     re-normalised when the server normalises (`dice_fast.matryoshka`; Matryoshka models)
    user             optional string, ignored (OpenAI's end-user id), as are unknown fields
Token ids (a list of integers, or a list of such lists: what LangChain's ``OpenAIEmbeddings`` sends by
default after counting tokens with OpenAI's tokenizer) are refused with a message saying how to send
text instead: they are ids of another tokenizer than the model's, so reading them could only mislead.
Response: {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
           "model": name, "usage": {"prompt_tokens": n, "total_tokens": n}}
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest

ENCODING_FORMATS = ("float", "base64")
INPUT_TYPES = {"document": "document", "query": "query", "search_document": "document", "search_query": "query"}

# the request body's JSON schema, for the OpenAPI page (parsing does not use it)
REQUEST_SCHEMA = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}]},
        "model": {"type": "string"},
        "encoding_format": {"type": "string", "enum": list(ENCODING_FORMATS), "default": "float"},
        "input_type": {"type": "string", "enum": list(INPUT_TYPES), "default": "document"},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
}


@dataclass(frozen=True)
class EmbeddingRequest:
    """A parsed request. input: the texts (a bare string becomes a list of one); input_type: "document"
    or "query"; encoding_format: "float" or "base64"; model: as sent, or None; dimensions: the width
    to truncate to, or None."""

    input: list[str]
    input_type: str = "document"
    encoding_format: str = "float"
    model: str | None = None
    dimensions: int | None = None


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_embedding_request(body: bytes, dim: int) -> EmbeddingRequest:
    """Parse and check a request body; `InvalidRequest` naming the field for anything malformed.

    body: the raw bytes (must be UTF-8 JSON); dim: the model's vector width (for ``dimensions``).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start}); send JSON in UTF-8") from None
    if not text.strip():
        raise InvalidRequest("the request body is empty; send a JSON object with an 'input' field")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} "
                             f"(line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_json_type(obj)}")

    if "input" not in obj:
        raise InvalidRequest("'input' is required: a string or a list of strings", param="input")
    texts = _parse_input(obj["input"])

    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {_json_type(model)}", param="model")
    encoding_format = obj.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(map(repr, ENCODING_FORMATS))}, got "
                             f"{encoding_format!r}", param="encoding_format")
    input_type = obj.get("input_type") or "document"
    if not isinstance(input_type, str) or input_type not in INPUT_TYPES:
        raise InvalidRequest(f"'input_type' must be one of {', '.join(map(repr, INPUT_TYPES))}, got {input_type!r}",
                             param="input_type")
    dimensions = obj.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or not 1 <= dimensions <= dim):
        raise InvalidRequest(f"'dimensions' must be an integer from 1 to {dim} (the served width), got "
                             f"{dimensions!r}", param="dimensions")
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(f"'user' must be a string, got {_json_type(user)}", param="user")
    return EmbeddingRequest(texts, INPUT_TYPES[input_type], encoding_format, model, dimensions)


def _parse_input(value) -> list[str]:
    if isinstance(value, str):
        texts, names = [value], ["input"]
    elif isinstance(value, list):
        if not value:
            raise InvalidRequest("'input' must not be an empty list", param="input")
        texts, names = value, [f"input[{i}]" for i in range(len(value))]
        if all(_is_int(t) for t in value):
            raise InvalidRequest(f"'input' is a list of token ids; {_TOKEN_IDS}", param="input")
        for i, item in enumerate(value):
            if isinstance(item, str):
                continue
            if _is_int(item) or (isinstance(item, list) and item and all(_is_int(t) for t in item)):
                what = "a token id" if _is_int(item) else "a list of token ids"
                raise InvalidRequest(f"input[{i}] is {what}; {_TOKEN_IDS}", param=f"input[{i}]")
            raise InvalidRequest(f"input[{i}] must be a string, got {_json_type(item)}", param=f"input[{i}]")
    else:
        raise InvalidRequest(f"'input' must be a string or a list of strings, got {_json_type(value)}", param="input")
    for name, t in zip(names, texts):
        if not t.strip():
            raise InvalidRequest(f"{name} is empty or only whitespace; every input needs text", param=name)
    return texts


_TOKEN_IDS = (
    "token ids are not accepted: send text, which the server tokenizes with the model's own tokenizer (ids "
    "from another tokenizer would be misread). LangChain's OpenAIEmbeddings sends OpenAI's token ids by default: "
    "pass check_embedding_ctx_length=False, or use dice_fast.integrations.langchain.DiceEmbeddings")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embedding_response(vectors: np.ndarray, tokens: np.ndarray, model: str, encoding_format: str) -> bytes:
    """The JSON response body. vectors: (n, dim) float32; tokens: (n,) tokens per input."""
    if encoding_format == "base64":
        little = np.ascontiguousarray(vectors, dtype="<f4")
        embeddings = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        embeddings = vectors.astype(np.float32, copy=False).tolist()
    total = int(tokens.sum())
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    return json.dumps(body, separators=(",", ":")).encode("utf-8")
