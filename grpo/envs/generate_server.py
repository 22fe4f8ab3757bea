"""The collector's engine served on vLLM's token-in, token-out endpoint.

``POST /inference/v1/generate`` takes prompt token ids and answers with sampled ids and their
logprobs, in the schema of vLLM's ``token_in_token_out/protocol.py``. The server only queues
requests: the thread that owns the engine takes every request that arrived together as one
batch and answers them, so the engine stays on one thread. Stdlib ``http.server``, bound to
127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.envs.rollout import Sample

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"


class RequestError(ValueError):
    """A request the server cannot serve: answered with HTTP 400 and this message."""


@dataclass
class GenerateRequest:
    """One queued completion request.

    Args:
        request_id (str): The client's id (or a new one), echoed in the response.
        max_tokens (int | None): The client's limit on new tokens (None: the server's).
        greedy (bool): The client asked for temperature 0.
        session (str | None): The client's ``X-Session-ID`` header (verifiers sends its trace id),
            which ties the requests of one episode together.
    """

    request_id: str
    token_ids: list[int]
    max_tokens: int | None
    stop: tuple[str, ...]
    greedy: bool
    session: str | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _response: tuple[int, dict[str, Any]] | None = field(default=None, repr=False)


def parse_generate_request(body: Any, session: str | None = None) -> GenerateRequest:
    """A request body (decoded JSON) as a `GenerateRequest`.

    Raises:
        RequestError: If ``token_ids`` is missing or not a list of ints, or the sampling
            parameters ask for what the server does not do (``n`` above 1).
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    token_ids = body.get("token_ids")
    if (
        not isinstance(token_ids, list)
        or not token_ids
        or not all(isinstance(t, int) and t >= 0 for t in token_ids)
    ):
        raise RequestError("token_ids must be a non-empty list of non-negative ints")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params must be an object")
    if int(params.get("n", 1)) != 1:
        raise RequestError(f"sampling_params.n must be 1, got {params['n']}")
    max_tokens = params.get("max_tokens", params.get("max_completion_tokens"))
    stop = params.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    temperature = params.get("temperature")
    return GenerateRequest(
        request_id=str(body.get("request_id") or uuid.uuid4().hex),
        token_ids=list(token_ids),
        max_tokens=None if max_tokens is None else int(max_tokens),
        stop=tuple(str(s) for s in stop),
        greedy=temperature is not None and float(temperature) == 0.0,
        session=session,
    )


def generate_response(request: GenerateRequest, sample: Sample) -> dict[str, Any]:
    """The JSON body answering ``request`` with ``sample`` (output mode ``tokens``)."""
    return {
        "request_id": request.request_id,
        "created": int(time.time()),
        "prompt_token_ids": request.token_ids,
        "usage": {
            "prompt_tokens": len(request.token_ids),
            "completion_tokens": len(sample.token_ids),
            "total_tokens": len(request.token_ids) + len(sample.token_ids),
        },
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": sample.finish_reason,
                "token_ids": list(sample.token_ids),
                "logprobs": {
                    "content": [
                        # "token" as well: verifiers' client reads the id from it.
                        {
                            "token": f"token_id:{token}",
                            "token_id": token,
                            "logprob": logprob,
                            "top_logprobs": [],
                        }
                        for token, logprob in zip(sample.token_ids, sample.logprobs)
                    ]
                },
            }
        ],
    }


class GenerateServer:
    """An HTTP endpoint whose requests the engine's thread serves in batches.

    Args:
        model_name (str): The model's name in ``GET /v1/models``.
        max_model_len (int): The engine's context, in ``GET /v1/models`` (clients check that
            a prompt fits before they send it).
        answer_timeout_s (float): How long a connection waits for its answer before it gets
            HTTP 503 (the engine's thread stopped serving).
    """

    def __init__(
        self, model_name: str = "policy", max_model_len: int = 2048, answer_timeout_s: float = 600.0
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._queue: queue.Queue[GenerateRequest] = queue.Queue()
        self.answer_timeout_s = answer_timeout_s
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.rstrip("/") != "/v1/models":
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                model = {
                    "id": server.model_name,
                    "object": "model",
                    "max_model_len": server.max_model_len,
                }
                self._reply(200, {"object": "list", "data": [model]})

            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.rstrip("/") != GENERATE_PATH:
                    self._reply(404, {"error": f"no route {self.path}; use {GENERATE_PATH}"})
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length))
                    request = parse_generate_request(body, self.headers.get("X-Session-ID"))
                except (RequestError, ValueError) as error:
                    self._reply(400, {"error": str(error)})
                    return
                self._reply(*server._submit(request))

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("generate server: " + format, *args)

        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="generate-server", daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (the endpoint is ``base_url + GENERATE_PATH``)."""
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def _submit(self, request: GenerateRequest) -> tuple[int, dict[str, Any]]:
        self._queue.put(request)
        if not request._done.wait(self.answer_timeout_s):
            return 503, {"error": f"no answer within {self.answer_timeout_s:.0f} s"}
        assert request._response is not None
        return request._response

    def take(self, timeout_s: float, gather_s: float = 0.02) -> list[GenerateRequest]:
        """The requests waiting now: blocks up to ``timeout_s`` for one, then ``gather_s``
        for others sent at about the same time (one bigger batch). Empty on timeout."""
        try:
            requests = [self._queue.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + gather_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                requests.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        while True:  # and whatever else is already queued
            try:
                requests.append(self._queue.get_nowait())
            except queue.Empty:
                return requests

    def answer(self, request: GenerateRequest, sample: Sample) -> None:
        """Send ``sample`` as the answer to ``request``."""
        request._response = (200, generate_response(request, sample))
        request._done.set()

    def fail(self, requests: Sequence[GenerateRequest], message: str, status: int = 500) -> None:
        """Answer ``requests`` with an error (the engine failed on them)."""
        for request in requests:
            request._response = (status, {"error": message})
            request._done.set()

    def close(self) -> None:
        """Stop serving; requests still queued get HTTP 503."""
        self._http.shutdown()
        self._http.server_close()
        pending = []
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self.fail(pending, "the server is shutting down", status=503)
