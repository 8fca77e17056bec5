"""POST /v1/embeddings: inputs in, one pooled and normalized vector per input out (OpenAI's shape).

Owns the embeddings rules: `dimensions` (only the model's own), tokenizing and checking each input
before anything is queued, the response and the base64 encoding (little-endian float32, as
OpenAI's client decodes it). The inputs run as embedding requests through the same async engine as completions, so
they batch with other traffic. Knows nothing of routes or middleware.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from vllmlite.api.openai.serving import Admission, ServingContext, admit, check_model, encode_prompt, final_outputs
from vllmlite.outputs import EmbeddingRequestOutput
from vllmlite.pooling_params import PoolingParams


def prepare_embeddings(ctx: ServingContext, req: EmbeddingRequest) -> list[list[int]]:
    """Validate the request and tokenize every input; raise APIError (400/404) before anything is queued."""
    check_model(ctx, req.model)
    hidden_size = ctx.engine.hidden_size
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise bad_request(f"dimensions {req.dimensions} is not supported: this model's embeddings have "
                          f"{hidden_size} dimensions (it cannot shorten them)", "dimensions")
    token_lists = []
    for i, value in enumerate(req.input):
        param = "input" if len(req.input) == 1 else f"input.{i}"
        token_ids = encode_prompt(ctx, value, param) if isinstance(value, str) else value
        try:
            ctx.engine.check_request(token_ids, PoolingParams())
        except ValueError as error:
            raise bad_request(str(error), param) from error
        token_lists.append(token_ids)
    return token_lists


async def create_embeddings(ctx: ServingContext, req: EmbeddingRequest, token_lists: list[list[int]],
                            admission: Admission) -> EmbeddingResponse:
    """Queue one embedding request per input and answer once all are done."""
    streams = admit(ctx, token_lists, PoolingParams(), admission, param="input")
    outputs: Sequence[EmbeddingRequestOutput] = await final_outputs(streams)
    data = [EmbeddingData(index=i, embedding=_encoded(o.outputs.embedding, req.encoding_format))
            for i, o in enumerate(outputs)]
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EmbeddingResponse(id=admission.request_id, model=ctx.model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON floats, or as base64 of its little-endian float32 bytes.

    >>> _encoded([1.0, -2.0], "base64")
    'AACAPwAAAMA='
    """
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
