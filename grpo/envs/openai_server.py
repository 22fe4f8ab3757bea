"""The collector's engine behind OpenAI's routes, one session per episode.

Routes ``/s/<session>/v1/chat/completions``, ``/s/<session>/v1/completions`` and ``/v1/models``:
the session in the URL ties an episode's calls together, so an unmodified client with that
``base_url`` works. This is the HTTP side only (a malformed body is HTTP 400 with the reason);
the backend renders and samples. Stdlib ``http.server``, bound to 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the endpoint refuses: answered with ``status`` and an OpenAI-style error.

    ``status`` is the HTTP status (400: the request, or the episode's limits).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Sampling:
    """What a request says about sampling and its own limits (the run's settings win)."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False


@dataclass
class ChatRequest:
    """A chat completion request: the conversation, its tools and its sampling."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: Sampling
    model: str = "policy"
    # Whether the answers are read for tool calls: tools given, and ``tool_choice`` not none.
    read_tool_calls: bool = False


@dataclass
class CompletionRequest:
    """A completion request: a text prompt or token ids."""

    prompt: str | list[int]
    sampling: Sampling
    model: str = "policy"


@dataclass
class Choice:
    """One sampled answer, as the backend gives it.

    Args:
        text (str): The decoded tokens (special tokens skipped).
        content (str | None): The message's content (the text without its tool calls).
        tool_calls (list[tuple[str, dict]]): ``(name, arguments)`` of each call parsed.
        finish_reason (str): ``stop``, ``length`` or ``tool_calls``.
    """

    text: str
    content: str | None
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)


class Backend(Protocol):
    """What serves the requests (`grpo.envs.agent_env.AgentEnv`)."""

    def chat(self, session: str, request: ChatRequest) -> tuple[list[int], list[Choice]]:
        """The prompt's token ids and the sampled choices; raises `ApiError`."""
        ...

    def complete(self, session: str, request: CompletionRequest) -> tuple[list[int], list[Choice]]:
        """Likewise for a completion."""
        ...


def _int(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ApiError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling(body: Mapping[str, Any]) -> Sampling:
    """The sampling fields of a request body.

    Raises:
        ApiError: A field of the wrong type.
    """
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ApiError(f"stop must be a string or a list of strings, got {stop!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object")
    max_tokens = _int(body, "max_completion_tokens", 1)
    logprobs = body.get("logprobs")
    return Sampling(
        max_tokens=max_tokens if max_tokens is not None else _int(body, "max_tokens", 1),
        stop=tuple(stop),
        n=_int(body, "n", 1) or 1,
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        seed=_int(body, "seed", -(2**63)),
        logprobs=bool(logprobs) and logprobs is not False,
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def _text(content: Any, where: str) -> str:
    """A message's content as text (a string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(f"{where}: only text content parts are served")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(f"{where}: content must be a string or a list of text parts")


def _message(message: Any, index: int) -> dict[str, Any]:
    """A message as the chat template takes it: role, text content, tool calls by name and
    decoded arguments."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(f"{where} must be an object")
    role = message.get("role")
    if role not in _ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.get("content"), where),
    }
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ApiError(f"{where}.tool_calls must be a list, on an assistant message")
        out["tool_calls"] = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ApiError(f"{where}.tool_calls: each needs function.name")
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError as error:
                    raise ApiError(
                        f"{where}.tool_calls: arguments are not JSON: {error}"
                    ) from error
            out["tool_calls"].append(
                {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
            )
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    if message.get("name") is not None:
        out["name"] = str(message["name"])
    return out


def tool_choice_problem(tool_choice: Any) -> str | None:
    """Why a request's ``tool_choice`` is not served, or None (``auto``, ``none``, absent).

    ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``)
    are refused, not ignored: vLLM's server enforces them by constraining sampling to the
    tools' schemas, and constrained tokens would be trained with logprobs the policy does not
    give them.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required" or isinstance(tool_choice, dict):
        return (
            f"tool_choice {json.dumps(tool_choice)} is not supported: it needs constrained "
            "sampling, and a training run samples the policy as it is (the behaviour logprobs "
            "must be the policy's); use 'auto' (or leave it out) and handle an answer without "
            "a tool call"
        )
    return f"tool_choice must be 'auto', 'none', 'required' or a function, got {tool_choice!r}"


def parse_chat_request(body: Any) -> ChatRequest:
    """A chat completion body as a `ChatRequest`.

    With ``tool_choice: none`` the tools are still rendered (as vLLM's server does by
    default: the prompt, and so the trajectory, stays the same across calls), and the answer
    is not read for calls: it comes back as text.

    Raises:
        ApiError: No messages, a message or tool of the wrong shape, a field of the wrong
            type, or a ``tool_choice`` not served (`tool_choice_problem`; the reason names it).
    """
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
        ):
            raise ApiError("tools must be a list of {type: function, function: {...}}")
    if (problem := tool_choice_problem(body.get("tool_choice"))) is not None:
        raise ApiError(problem)
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools or None,
        sampling=parse_sampling(body),
        model=str(body.get("model") or "policy"),
        read_tool_calls=bool(tools) and body.get("tool_choice") != "none",
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    """A completion body as a `CompletionRequest` (one prompt: a string or token ids).

    Raises:
        ApiError: No prompt, or several.
    """
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            raise ApiError("prompt must be a string or a non-empty list of token ids (one prompt)")
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be a string or a non-empty list of token ids (one prompt)")
    if body.get("echo"):
        raise ApiError("echo is not served")
    return CompletionRequest(
        prompt=prompt, sampling=parse_sampling(body), model=str(body.get("model") or "policy")
    )


def _tool_calls(choice: Choice, call_ids: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        for (name, arguments), call_id in zip(choice.tool_calls, call_ids)
    ]


def _chat_logprobs(choice: Choice) -> dict[str, Any]:
    return {
        "content": [
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            for text, logprob in zip(choice.token_texts, choice.logprobs)
        ]
    }


def _usage(prompt_ids: Sequence[int], choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def chat_response(
    request: ChatRequest, prompt_ids: list[int], choices: Sequence[Choice]
) -> dict[str, Any]:
    """The ``chat.completion`` body."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [],
        "usage": _usage(prompt_ids, choices),
    }
    for index, choice in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.content}
        if choice.tool_calls:
            ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in choice.tool_calls]
            message["tool_calls"] = _tool_calls(choice, ids)
        out: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": choice.finish_reason,
            "logprobs": _chat_logprobs(choice) if request.sampling.logprobs else None,
        }
        if request.sampling.return_token_ids:
            out["token_ids"] = list(choice.token_ids)
        body["choices"].append(out)
    if request.sampling.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def chat_events(
    request: ChatRequest, prompt_ids: list[int], choices: Sequence[Choice]
) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` events of a streamed answer (the whole answer is sampled
    first: a chunk per choice for its role, its content, its calls and its end)."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model,
    }
    for index, choice in enumerate(choices):
        delta: dict[str, Any] = {"role": "assistant", "content": choice.content or ""}
        first: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None}
        if request.sampling.logprobs:
            first["logprobs"] = _chat_logprobs(choice)
        if request.sampling.return_token_ids:
            first["token_ids"] = list(choice.token_ids)
        yield {**head, "choices": [first]}
        if choice.tool_calls:
            ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in choice.tool_calls]
            calls = [{"index": i, **call} for i, call in enumerate(_tool_calls(choice, ids))]
            yield {
                **head,
                "choices": [
                    {"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}
                ],
            }
        yield {
            **head,
            "choices": [{"index": index, "delta": {}, "finish_reason": choice.finish_reason}],
        }
    if request.sampling.include_usage:
        yield {**head, "choices": [], "usage": _usage(prompt_ids, choices)}


def completion_response(
    request: CompletionRequest, prompt_ids: list[int], choices: Sequence[Choice]
) -> dict[str, Any]:
    """The ``text_completion`` body."""
    body: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [_completion_choice(request, index, c) for index, c in enumerate(choices)],
        "usage": _usage(prompt_ids, choices),
    }
    if request.sampling.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def _completion_choice(request: CompletionRequest, index: int, choice: Choice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": index,
        "text": choice.text,
        "finish_reason": choice.finish_reason,
        "logprobs": None,
    }
    if request.sampling.logprobs:
        out["logprobs"] = {
            "tokens": list(choice.token_texts),
            "token_logprobs": list(choice.logprobs),
            "top_logprobs": None,
            "text_offset": [],
        }
    if request.sampling.return_token_ids:
        out["token_ids"] = list(choice.token_ids)
    return out


def completion_events(
    request: CompletionRequest, prompt_ids: list[int], choices: Sequence[Choice]
) -> Iterator[dict[str, Any]]:
    """The streamed ``text_completion`` events: one per choice, then the usage if asked."""
    body = completion_response(request, prompt_ids, choices)
    usage = body.pop("usage")
    for choice in body.pop("choices"):
        yield {**body, "choices": [choice]}
    if request.sampling.include_usage:
        yield {**body, "choices": [], "usage": usage}


# The largest request body read (a long conversation with tools is well under it).
MAX_BODY_BYTES = 64 * 1024 * 1024


def _content_length(value: str | None) -> int:
    """A request's ``Content-Length``, or an `ApiError` (400) for one that is not a size."""
    try:
        length = int(value or 0)
    except ValueError:
        raise ApiError(f"Content-Length: {value!r} is not a number of bytes") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise ApiError(f"Content-Length: {length} is not between 0 and {MAX_BODY_BYTES}")
    return length


class _Server(http.server.ThreadingHTTPServer):
    # A batch's episodes open their connections at once (64 and more); the socket's default
    # backlog of 5 overflows, and the clients that did not fit see their connection reset.
    request_queue_size = 1024
    daemon_threads = True


class OpenAIServer:
    """OpenAI's routes on 127.0.0.1, a free port, served by ``backend``.

    ``model_name`` and ``max_model_len`` are what ``GET /v1/models`` reports.
    """

    def __init__(self, backend: Backend, model_name: str = "policy", max_model_len: int = 0):
        self.backend = backend
        self.model_name = model_name
        self.max_model_len = max_model_len
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                _, route = _split(self.path)
                if route != "/v1/models":
                    self._error(404, f"no route GET {self.path}")
                    return
                model = {
                    "id": server.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "grpo",
                    "max_model_len": server.max_model_len,
                }
                self._json(200, {"object": "list", "data": [model]})

            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                session, route = _split(self.path)
                try:
                    try:
                        length = _content_length(self.headers.get("Content-Length"))
                    except ApiError:
                        self.close_connection = True  # the body's end is unknown
                        raise
                    raw = self.rfile.read(length)
                    if route not in ("/v1/chat/completions", "/v1/completions"):
                        raise ApiError(f"no route POST {self.path}", 404)
                    if session is None:
                        raise ApiError(
                            "no session in the URL: use the episode's base_url "
                            "(http://127.0.0.1:PORT/s/<episode>/v1)"
                        )
                    try:
                        body = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError) as error:
                        raise ApiError(f"the body is not JSON: {error}") from error
                    if route == "/v1/chat/completions":
                        chat = parse_chat_request(body)
                        prompt_ids, choices = server.backend.chat(session, chat)
                        if chat.sampling.stream:
                            self._events(chat_events(chat, prompt_ids, choices))
                        else:
                            self._json(200, chat_response(chat, prompt_ids, choices))
                    else:
                        completion = parse_completion_request(body)
                        prompt_ids, choices = server.backend.complete(session, completion)
                        if completion.sampling.stream:
                            self._events(completion_events(completion, prompt_ids, choices))
                        else:
                            self._json(200, completion_response(completion, prompt_ids, choices))
                except ApiError as error:
                    self._error(error.status, str(error))
                except Exception as error:  # never a hung client: say what broke
                    log.exception("openai endpoint: %s failed", self.path)
                    self._error(500, f"{type(error).__name__}: {error}")

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:  # the client must not send another request on it
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                kind = "invalid_request_error" if status < 500 else "server_error"
                self._json(status, {"error": {"message": message, "type": kind, "code": status}})

            def _events(self, events: Iterator[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("openai endpoint: " + format, *args)

        self._http = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="openai-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def session_url(self, session: str) -> str:
        """The ``base_url`` of an episode's client: ``http://127.0.0.1:PORT/s/<session>/v1``."""
        return f"{self.base_url}/s/{session}/v1"

    def close(self) -> None:
        """Stop serving."""
        self._http.shutdown()
        self._http.server_close()


def _split(path: str) -> tuple[str | None, str]:
    """``(session, route)`` of a request path (``/s/<session>/v1/...`` or ``/v1/...``)."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.startswith("/s/"):
        session, _, rest = path[3:].partition("/")
        return session or None, "/" + rest
    return None, path
