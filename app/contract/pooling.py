"""The pooling request bodies (docs/design.md §17), declared field by field as vLLM 0.32's
own models take them (``vllm/entrypoints/pooling/``): embeddings (OpenAI's
``/v1/embeddings`` and Cohere's ``/v2/embed``), pooling, classify, score and rerank.

Each route has one model (:data:`ROUTES`), from which both the gateway's checks
(app/api/pooling/request.py) and ``/openapi.json`` come. vLLM takes a body in one of several
forms (text or token ids in ``input``, or chat ``messages``; a score's pair of inputs under
four names); each model declares every form's fields, and what no type says (exactly one
form given) is checked by a validator raising :class:`~app.contract.declared.BadInput`, as
vLLM's own union of models refuses a body that fits none. Any field a model does not
declare is allowed, as vLLM's models allow it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from app.contract.declared import BadInput, Declared, says
from app.contract.engine_inputs import Message

INPUT_FORMS = "a string, an array of strings, an array of token ids, or an array of those"
TokenIds = list[Annotated[int, Field(ge=0)]]
Input = Annotated[str | list[str] | TokenIds | list[TokenIds], says(f"must be {INPUT_FORMS}", wrong_type_too=True)]
Messages = Annotated[list[Message], Field(min_length=1)]
EmbeddingInput = Annotated[
    str | list[str] | TokenIds | list[TokenIds] | Messages | list[Messages],
    says(f"must be {INPUT_FORMS}, a chat's messages, or an array of chats", wrong_type_too=True),
]
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"]


class ScoreParts(Declared):
    """A multimodal score input: its content parts (passed on as given)."""

    content: list[dict[str, Any]]


ScoreInput = Annotated[str | ScoreParts, says("must be a string or an object with 'content'", wrong_type_too=True)]
ScoreInputs = ScoreInput | list[ScoreInput]


class _Pooling(Declared):
    """What every pooling request declares (vLLM's ``PoolingBasicRequestMixin``)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: Priority = 0
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "normalize" in data:
            raise BadInput("normalize", "was removed: use 'use_activation' instead")
        return data


class _Prompted(_Pooling):
    """A prompt as text or token ids (``input``) or as a chat (``messages``), and their options."""

    input: Input | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    use_activation: bool | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> _Prompted:
        if (self.input is None) == (self.messages is None):
            raise BadInput("input", "is required (or 'messages', a chat), and not both")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadInput("continue_final_message", "cannot be set with 'add_generation_prompt'")
        return self


class _Encoded(Declared):
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    dimensions: Annotated[int, Field(ge=1)] | None = None


class CreateEmbeddingRequest(_Prompted, _Encoded):
    """``POST /v1/embeddings``: ``input`` may also be a chat, or a batch of chats (vLLM
    reads a chat given as ``input`` as ``messages``)."""

    input: EmbeddingInput | None = None  # type: ignore[assignment]
    messages: Messages | list[Messages] | None = None  # type: ignore[assignment]


class CohereEmbedRequest(Declared):
    """``POST /v2/embed``: Cohere's embed request, as vLLM serves it."""

    model: str | None = None
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[dict[str, Any]] | None = None
    output_dimension: Annotated[int, Field(ge=1)] | None = None
    embedding_types: list[Literal["float", "binary", "ubinary", "base64"]] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    priority: Priority = 0

    @model_validator(mode="after")
    def _one_input(self) -> CohereEmbedRequest:
        given = [value for value in (self.texts, self.images, self.inputs) if value is not None]
        if len(given) != 1 or not given[0]:
            raise BadInput("texts", "is required (or 'images', or 'inputs'), non-empty, and only one of them")
        return self


class CreatePoolingRequest(_Prompted, _Encoded):
    """``POST /pooling``: the pooler's raw output (``task`` picks it)."""

    task: PoolingTask | None = None


class CreateClassificationRequest(_Prompted):
    """``POST /classify``."""


class _Scoring(_Pooling):
    """What score and rerank declare (vLLM's ``ScoringRequestMixin``)."""

    use_activation: bool | None = None
    max_tokens_per_query: Annotated[int, Field(ge=0)] = 0
    max_tokens_per_doc: Annotated[int, Field(ge=0)] = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# a score's two sides, under each of the names vLLM takes them by
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class CreateScoreRequest(_Scoring):
    """``POST /score`` and ``/v1/score``: every pair of one side with the other."""

    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> CreateScoreRequest:
        given = [
            pair for pair in SCORE_PAIRS if getattr(self, pair[0]) is not None and getattr(self, pair[1]) is not None
        ]
        if not given:
            raise BadInput("queries", "and 'documents' are required (or 'items', 'data_1'/'data_2', 'text_1'/'text_2')")
        return self


class CreateRerankRequest(_Scoring):
    """``POST /rerank``, ``/v1/rerank`` and ``/v2/rerank``."""

    query: ScoreInput
    documents: ScoreInputs
    top_n: Annotated[int, Field(ge=0)] = 0


# each route, the name the log records it by (RequestAccepted.endpoint: its path), and its model
ROUTES: dict[str, type[Declared]] = {
    "/v1/embeddings": CreateEmbeddingRequest,
    "/v2/embed": CohereEmbedRequest,
    "/pooling": CreatePoolingRequest,
    "/classify": CreateClassificationRequest,
    "/score": CreateScoreRequest,
    "/v1/score": CreateScoreRequest,
    "/rerank": CreateRerankRequest,
    "/v1/rerank": CreateRerankRequest,
    "/v2/rerank": CreateRerankRequest,
}
MODELS = tuple(dict.fromkeys(ROUTES.values()))
