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
    return_chunks    optional boolean (documents only): each data item also gets "chunks", a list of
                     {"embedding", "start_char", "end_char", "tokens"}: the chunk vectors (in
                     encoding_format, cut to ``dimensions`` too) with the chunk's span
                     ``input[start_char:end_char]`` and its content tokens, equal to
                     ``encode_documents(input, return_chunks=True)``
    user             optional string, ignored (OpenAI's end-user id), as are unknown fields
Token ids (a list of integers, or a list of such lists: what LangChain's ``OpenAIEmbeddings`` sends by
default after counting tokens with OpenAI's tokenizer) are refused with a message saying how to send
text instead: they are ids of another tokenizer than the model's, so reading them could only mislead.
Response: {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
           "model": name, "usage": {"prompt_tokens": n, "total_tokens": n}}, and in usage
           "truncated_inputs": [i, ...] when queries were cut to the window (auto-truncate)

Evidence (``POST /v1/evidence``), a JSON object: ``query`` (a non-empty string), ``documents`` (as
``input``), ``scoring`` ("dice", "maxsim" or "hybrid", default "maxsim") and ``alpha`` (hybrid's weight,
optional). Response: {"object": "list", "data": [{"index": i, "score", "chunk", "start_char",
"end_char", "chunk_score", "text"}] in input order, "scoring", "model", "usage"}.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass

import numpy as np
import orjson

from ..config import STRATEGIES
from ..scoring import DEFAULT_SCORING, SCORINGS
from .errors import QUOTE_CHARS, InvalidRequest, quote

ENCODING_FORMATS = ("float", "base64")
INPUT_TYPES = {"document": "document", "query": "query", "search_document": "document", "search_query": "query"}

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
    return_chunks: bool = False
    strategy: str | None = None  # None: the server's


@dataclass(frozen=True)
class EvidenceRequest:
    """A parsed evidence request: one query, the documents to read, the scoring and its alpha."""

    query: str
    documents: list[str]
    scoring: str = DEFAULT_SCORING
    alpha: float | None = None
    strategy: str | None = None  # None: the server's


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_embedding_request(body: bytes, dim: int) -> EmbeddingRequest:
    """Parse and check a request body; `InvalidRequest` naming the field for anything malformed.

    body: the raw bytes (must be UTF-8 JSON); dim: the model's vector width (for ``dimensions``).
    Strict JSON: no NaN / Infinity, no key twice in an object; nesting deeper than Python's recursion
    limit is refused as malformed, as is an input that is not valid Unicode (a lone surrogate escape).
    """
    obj = _json_object(body, "an 'input' field")

    if "input" not in obj:
        raise InvalidRequest("'input' is required: a string or a list of strings", param="input")
    texts = _parse_input(obj["input"])

    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {_json_type(model)}", param="model")
    encoding_format = _or_default(obj, "encoding_format", "float")
    if encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(map(repr, ENCODING_FORMATS))}, got "
                             f"{_short(encoding_format)}", param="encoding_format")
    input_type = _or_default(obj, "input_type", "document")
    if not isinstance(input_type, str) or input_type not in INPUT_TYPES:
        raise InvalidRequest(f"'input_type' must be one of {', '.join(map(repr, INPUT_TYPES))}, got "
                             f"{_short(input_type)}", param="input_type")
    dimensions = obj.get("dimensions")
    if isinstance(dimensions, float) and dimensions.is_integer():  # 8.0 is an integer in JSON Schema's sense
        dimensions = int(dimensions)
    if dimensions is not None and (not _is_int(dimensions) or not 1 <= dimensions <= dim):
        raise InvalidRequest(f"'dimensions' must be an integer from 1 to {dim} (the served width), got "
                             f"{_short(dimensions)}", param="dimensions")
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(f"'user' must be a string, got {_json_type(user)}", param="user")
    return_chunks = _or_default(obj, "return_chunks", False)
    if not isinstance(return_chunks, bool):
        raise InvalidRequest(f"'return_chunks' must be true or false, got {_json_type(return_chunks)}",
                             param="return_chunks")
    if return_chunks and INPUT_TYPES[input_type] == "query":
        raise InvalidRequest("'return_chunks' is for documents; a query is one window, never chunked",
                             param="return_chunks")
    return EmbeddingRequest(texts, INPUT_TYPES[input_type], encoding_format, model, dimensions, return_chunks,
                            _strategy(obj))


def parse_evidence_request(body: bytes) -> EvidenceRequest:
    """Parse and check a ``/v1/evidence`` body; `InvalidRequest` naming the field for anything malformed."""
    obj = _json_object(body, "'query' and 'documents' fields")
    query = obj.get("query")
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest(f"'query' must be a non-empty string, got {_json_type(query)}", param="query")
    if "documents" not in obj:
        raise InvalidRequest("'documents' is required: a string or a list of strings", param="documents")
    documents = _parse_input(obj["documents"], "documents")  # the same checks as 'input'
    scoring = _or_default(obj, "scoring", DEFAULT_SCORING)
    if scoring not in SCORINGS:
        raise InvalidRequest(f"'scoring' must be one of {', '.join(map(repr, SCORINGS))}, got {_short(scoring)}",
                             param="scoring")
    alpha = obj.get("alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
        raise InvalidRequest(f"'alpha' must be a number from 0 to 1, got {_short(alpha)}", param="alpha")
    return EvidenceRequest(query, documents, scoring, None if alpha is None else float(alpha), _strategy(obj))


def _strategy(obj: dict) -> str | None:
    """The request's ``strategy`` (None: absent or null, the server's); `InvalidRequest` for anything else."""
    strategy = obj.get("strategy")
    if strategy is not None and (not isinstance(strategy, str) or strategy not in STRATEGIES):
        raise InvalidRequest(f"'strategy' must be one of {', '.join(map(repr, STRATEGIES))}, got {_short(strategy)}",
                             param="strategy")
    return strategy


def _or_default(obj: dict, key: str, default):
    """``obj[key]``, or ``default`` when it is absent or null."""
    value = obj.get(key)
    return default if value is None else value


def _json_object(body: bytes, needs: str) -> dict:
    """The JSON object of a request body (strict, see `_load_json`); `InvalidRequest` for anything else.
    needs: what the object must hold, for the message about an empty body."""
    obj = _load_json(body, needs)
    if not isinstance(obj, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_json_type(obj)}")
    return obj


def _parse_input(value, field: str = "input") -> list[str]:
    """The texts of ``value``, a string or a list of strings, sent as ``field``; `InvalidRequest` naming
    ``field`` or ``field[i]`` otherwise."""
    if isinstance(value, str):
        texts, names = [value], [field]
    elif isinstance(value, list):
        if not value:
            raise InvalidRequest(f"'{field}' must not be an empty list", param=field)
        texts, names = value, [f"{field}[{i}]" for i in range(len(value))]
        if all(_is_int(t) for t in value):
            raise InvalidRequest(f"'{field}' is a list of token ids; {_TOKEN_IDS}", param=field)
        for i, item in enumerate(value):
            if isinstance(item, str):
                continue
            if _is_int(item) or (isinstance(item, list) and item and all(_is_int(t) for t in item)):
                what = "a token id" if _is_int(item) else "a list of token ids"
                raise InvalidRequest(f"{field}[{i}] is {what}; {_TOKEN_IDS}", param=f"{field}[{i}]")
            raise InvalidRequest(f"{field}[{i}] must be a string, got {_json_type(item)}", param=f"{field}[{i}]")
    else:
        raise InvalidRequest(f"'{field}' must be a string or a list of strings, got {_json_type(value)}", param=field)
    for name, t in zip(names, texts):
        if not t.strip():
            raise InvalidRequest(f"{name} is empty or only whitespace; every input needs text", param=name)
        if bad := _SURROGATE.search(t):
            raise InvalidRequest(f"{name} is not valid Unicode: a lone surrogate (\\u{ord(bad.group()):04x}) at "
                                 f"character {bad.start()}", param=name)
    return texts


_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON can escape them; UTF-8 (and the tokenizer) cannot hold them


def _load_json(body: bytes, needs: str):
    """The JSON value of ``body`` (UTF-8, strict); `InvalidRequest` saying what is wrong and where."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start}); send JSON in UTF-8") from None
    if not text.strip():
        raise InvalidRequest(f"the request body is empty; send a JSON object with {needs}")
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} "
                             f"(line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply; an embeddings request is an object of "
                             "strings and lists of strings") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InvalidRequest(f"the request body has a value that cannot be read: {_short(str(exc), 120)}") from None


def _no_constant(name: str):
    raise InvalidRequest(f"the request body is not valid JSON: {name} is not a JSON value")


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidRequest(f"the key {_short(key)} appears twice in one object; send it once", param=key[:QUOTE_CHARS])
    return obj


def _short(value, most: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to ``most`` characters: an error never echoes a whole huge field."""
    return quote(repr(value), most)


_TOKEN_IDS = (
    "token ids are not accepted: send text, which the server tokenizes with the model's own tokenizer (ids "
    "from another tokenizer would be misread). LangChain's OpenAIEmbeddings sends OpenAI's token ids by default: "
    "pass check_embedding_ctx_length=False, or use dice_fast.integrations.langchain.DiceEmbeddings")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embedding_response(vectors: np.ndarray, tokens: np.ndarray, model: str, encoding_format: str,
                       truncated: tuple[int, ...] = (), chunks=None) -> bytes:
    """The JSON response body. vectors: (n, dim) float32; tokens: (n,) tokens per input; truncated: the
    indices of inputs cut to the window (listed in ``usage.truncated_inputs`` when there are any);
    chunks: a `DiceOutput` of the n inputs to list under each item's "chunks" (None: no chunks)."""
    embeddings = _encode_vectors(vectors, encoding_format)
    total = int(tokens.sum())
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
    if chunks is not None:
        vectors_of_chunks = _encode_vectors(chunks.chunks, encoding_format)
        items = zip(chunks.chunk_document.tolist(), vectors_of_chunks, chunks.chunk_start_char.tolist(),
                    chunks.chunk_end_char.tolist(), (chunks.chunk_end - chunks.chunk_start).tolist())
        for item in data:
            item["chunks"] = []
        for d, e, start, end, n in items:
            data[d]["chunks"].append({"embedding": e, "start_char": start, "end_char": end, "tokens": n})
    body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": total, "total_tokens": total}}
    if truncated:
        body["usage"]["truncated_inputs"] = list(truncated)
    return dumps(body)


def evidence_response(rows: list[dict], scoring: str, tokens: int, model: str) -> bytes:
    """The ``/v1/evidence`` response body: rows (one per document, in input order) as given."""
    body = {"object": "list", "data": rows, "scoring": scoring, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return dumps(body)


def dumps(body) -> bytes:
    """Compact JSON of ``body`` (numpy arrays as lists) by orjson: ~16x json.dumps on 256 x 384 floats."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _encode_vectors(vectors: np.ndarray, encoding_format: str) -> list:
    """Rows of (n, dim) ``vectors`` as float arrays (written as JSON lists), or base64 of little-endian
    float32 bytes. Floats are widened to float64 before writing, so each number is the shortest text of
    the float32 value as a double: what ``json.dumps(vectors.tolist())`` wrote (to the exponent's
    spelling, 1e-5 for 1e-05), and exactly that float32 when read back."""
    if encoding_format == "base64":
        little = np.ascontiguousarray(vectors, dtype="<f4")
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    return list(np.ascontiguousarray(vectors, dtype=np.float32).astype(np.float64))
