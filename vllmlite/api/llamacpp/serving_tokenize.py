"""POST /tokenize in llama-server's shape: `{"content", "add_special", "parse_special", "with_pieces"}`
in, `{"tokens": [...]}` out (ids, or `{"id", "piece"}` objects). vLLM's shape (`prompt` or `messages`)
shares the route; the app sends a request here when it carries llama-server's fields.

Knows nothing of routes or middleware.
"""

from __future__ import annotations

from vllmlite.api.errors import bad_request
from vllmlite.api.llamacpp.protocol import LlamaTokenizeResponse, TokenPiece
from vllmlite.api.openai.protocol import TokenizeRequest
from vllmlite.api.openai.serving import MAX_CHARS_PER_TOKEN, ServingContext, token_bytes

LLAMA_TOKENIZE_FIELDS = ("content", "add_special", "parse_special", "with_pieces")


def is_llama_tokenize(req: TokenizeRequest) -> bool:
    """Whether the request uses llama-server's fields (then it is answered in llama-server's shape)."""
    return any(getattr(req, name) is not None for name in LLAMA_TOKENIZE_FIELDS)


def llama_tokenize(ctx: ServingContext, req: TokenizeRequest) -> LlamaTokenizeResponse:
    """The ids of `content`: with BOS only when add_special (llama-server's default is without),
    special-token text read as special tokens unless parse_special is false."""
    if req.content is None:
        name = next(n for n in LLAMA_TOKENIZE_FIELDS if getattr(req, n) is not None)
        raise bad_request(f"{name} is llama-server's field: send the text as content", name)
    for name in ("prompt", "messages"):
        if getattr(req, name) is not None:
            raise bad_request("send one of prompt, messages (vLLM's fields) or content (llama-server's)", name)
    tokenizer = ctx.engine.tokenizer
    max_chars = ctx.engine.max_model_len * MAX_CHARS_PER_TOKEN
    if len(req.content) > max_chars:
        raise bad_request(f"content has {len(req.content)} characters, more than this model's context of "
                          f"{ctx.engine.max_model_len} tokens can hold", "content")
    add_special = bool(req.add_special)
    if req.parse_special is False:
        token_ids = tokenizer.encode_with_plain_spans(req.content, [(0, len(req.content))], add_special)
    else:
        token_ids = tokenizer.encode(req.content, add_special_tokens=add_special)
    if not req.with_pieces:
        return LlamaTokenizeResponse(tokens=token_ids)
    return LlamaTokenizeResponse(tokens=[TokenPiece(id=i, piece=_piece(token_bytes(tokenizer.token_text(i))))
                                         for i in token_ids])


def _piece(raw: list[int]) -> str | list[int]:
    """A token's text, or its bytes when they are not valid UTF-8 on their own (half a character).

    >>> _piece([104, 105]), _piece([195])
    ('hi', [195])
    """
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return raw
