"""OpenAI-compatible request models, the error body, and request -> SamplingParams.

Requests are parsed strictly: unknown fields, wrong JSON types and options this server does not
implement are rejected with an OpenAI-style error naming the field; nothing is silently ignored.
Fields that OpenAI clients may send with their neutral value (n=1, presence_penalty=0, ...) are
accepted only with that value.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..generate import SamplingParams

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------- request models
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""
    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)          # vLLM style: -1 or 0 = off
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False                           # vLLM extension
    return_token_ids: bool = False                     # vLLM extension: the choice carries the ids
    user: Optional[str] = None                         # opaque client tag, never interpreted
    speculation: bool = True                           # false: decoded plainly (no draft, no guesses)
    learn: bool = True                                 # false: a learning server (--learn) does not capture it
    # accepted only with their neutral value (see NEUTRAL)
    n: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Optional[Union[bool, int]] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    top_logprobs: Optional[int] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str]]
    max_tokens: Optional[int] = 16                     # the OpenAI default for completions
    echo: Optional[bool] = None
    best_of: Optional[int] = None


# field -> the values accepted (the neutral ones); anything else is an unsupported option
NEUTRAL: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False),
}


# ---------------------------------------------------------------------------- parsing
def parse_request(model_cls: type[Strict], body: bytes) -> Strict:
    """Validate a JSON body; any problem -> APIError 400 naming the offending field."""
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    check_neutral(req)
    if req.stream and req.return_token_ids:
        raise APIError(400, "return_token_ids is answered on whole responses only; send stream=false "
                            "with it", param="return_token_ids", code="unsupported_value")
    return req


def validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported field {loc!r}: this server does not implement it "
                             "(remove it from the request)", param=loc, code="unsupported_field")
    if kind == "missing":
        return APIError(400, f"missing required field {loc!r}", param=loc, code="missing_field")
    if kind == "model_type":
        return APIError(400, "request body must be a JSON object", code="invalid_type")
    return APIError(400, f"invalid value for {loc or 'body'!r}: {err['msg']} "
                         f"(got {err.get('input')!r})"[:500], param=loc or None, code="invalid_value")


def check_neutral(req: Strict) -> None:
    for name, allowed in NEUTRAL.items():
        value = getattr(req, name, None)
        if value not in allowed:
            raise APIError(400, f"{name}={value!r} is not supported; this server accepts only "
                                f"{allowed[-1]!r} (or leaving it out)", param=name,
                           code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true",
                       param="stream_options", code="invalid_value")


def stop_strings(stop: Optional[Union[str, list[str]]]) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                       param="stop", code="invalid_value")
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
    return stops


def requested_max_tokens(req: Strict) -> Optional[int]:
    """max_tokens (or max_completion_tokens on chat); None = fill the remaining context."""
    value = req.max_tokens
    extra = getattr(req, "max_completion_tokens", None)
    if value is not None and extra is not None and value != extra:
        raise APIError(400, f"max_tokens ({value}) and max_completion_tokens ({extra}) disagree; "
                            "give one of them", param="max_completion_tokens", code="invalid_value")
    value = value if value is not None else extra
    if value is not None and value < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {value}", param="max_tokens",
                       code="invalid_value")
    return value


def sampling_params(req: Strict, max_new_tokens: int) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; top_k off; seed None = random."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=req.seed,
        max_new_tokens=max_new_tokens, stop=stop_strings(req.stop), ignore_eos=req.ignore_eos,
        speculative=req.speculation)
