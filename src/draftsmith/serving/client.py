"""A client for OpenAI-compatible chat servers (vLLM, SGLang, or any other).

Requests are spread round-robin over one or several base URLs, at most `concurrency` in
flight, each with a timeout and retries with exponential backoff (a retry goes to the next
URL, so one dead server does not stall the run). Results come back as they complete, in any
order: the caller keys them by sample id. The API key is read from the environment and only
ever sent as a header, never logged or stored.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import httpx

from draftsmith.chat_format import ChatFormat
from draftsmith.config import ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.inprocess import Completion
from draftsmith.serving.engines import REASONING_FIELDS

# Retried: the server is busy, restarting or unreachable. Anything else (400: prompt too long,
# 404: wrong model name) will fail the same way again.
_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
_DOWN_S = 30.0  # a server that refused a connection gets no first attempts for this long


@dataclass
class ChatRequest:
    id: str
    messages: list[dict]
    body: dict  # sampling fields: max_tokens, temperature, top_p, seed, chat_template_kwargs


@dataclass
class ServedCompletion(Completion):
    token_ids: list[int] | None = None  # the emitted ids, when the request asked for them
    # the response choice's other fields (SGLang: `meta_info`, its speculative counts)
    extras: dict | None = None


class RequestFailed(DraftsmithError):
    pass


def raw_completion(message: dict, finish_reason: str, fmt: ChatFormat) -> str:
    """The text the model emitted, rebuilt from a chat response.

    Servers with a reasoning parser return the thinking apart, in one of REASONING_FIELDS
    (each engine's, engines.py), and drop the tags; without one it stays inline in `content`. Either way the result is what the in-process backend records, so the stage's
    output does not depend on the backend. The end-of-turn token is special (servers strip
    it); a `stop` finish means the model emitted it."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    content = message.get("content") or ""
    if reasoning is not None and fmt.supports_reasoning:
        # Parsers strip the tags and keep the whitespace around them in the two fields.
        head = "" if fmt.prompt_opens_reasoning else fmt.open_tag
        # A parser that finds no closing tag (cut off while thinking) puts everything in
        # reasoning and leaves content null.
        closed = message.get("content") is not None
        text = head + reasoning + (fmt.close_tag + content if closed else "")
    else:
        text = fmt.answer_open + content
    return text + fmt.end_of_turn if finish_reason == "stop" else text


def emitted_ids(choice: dict) -> list[int] | None:
    """The ids of the emitted tokens, when the request asked for them (each engine's
    `token_id_fields`): SGLang lists them in `token_ids`; vLLM names each logprobs token
    "token_id:<id>"."""
    if isinstance(choice.get("token_ids"), list):
        return [int(t) for t in choice["token_ids"]]
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None
    try:
        return [int(t["token"].removeprefix("token_id:")) for t in content]
    except (KeyError, ValueError):
        return None


class ChatClient:
    def __init__(self, cfg: ServerConfig, urls: list[str], fmt: ChatFormat | None = None):
        if not urls:
            raise DraftsmithError("no server to send requests to",
                                  "set server.urls, or server.launch: true")
        self.cfg, self.urls, self.fmt = cfg, [u.rstrip("/") for u in urls], fmt
        headers = {}
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(headers=headers, timeout=cfg.request_timeout_s,
                                 limits=httpx.Limits(max_connections=cfg.concurrency * 2))
        self.model = cfg.model or self._served_model()
        self._next = 0
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}  # url -> when to try it again

    def close(self) -> None:
        self.http.close()

    def _served_model(self) -> str:
        """The one model the servers serve (asked once, so params need not repeat it)."""
        errors = []
        for url in self.urls:  # the first that answers: one may be down
            try:
                r = self.http.get(f"{url}/models", timeout=30)
                r.raise_for_status()
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {exc}")
                continue
            try:
                names = [m["id"] for m in r.json().get("data", [])]
            except (ValueError, AttributeError, KeyError, TypeError):
                raise DraftsmithError(
                    f"{url}/models did not answer an OpenAI model list: {r.text[:200]!r}",
                    "check server.urls: each must be an OpenAI-compatible API base, e.g. "
                    "http://127.0.0.1:8000/v1") from None
            if len(names) != 1:
                raise DraftsmithError(f"{url} serves {len(names)} models: {names}",
                                      "set server.model to the one to use")
            return names[0]
        raise DraftsmithError("cannot list models at any server: " + "; ".join(errors),
                              "check server.urls and that the servers are up")

    def _pick_urls(self) -> list[str]:
        """This request's servers in the order to try: the next in round-robin first, then
        the others, skipping (while others remain) any that refused a connection lately."""
        with self._lock:
            self._next += 1
            start = self._next
        now = time.monotonic()
        order = [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]
        up = [u for u in order if self._down_until.get(u, 0) <= now]
        return up + [u for u in order if u not in up]

    def post(self, path: str, body: dict, what: str) -> dict:
        """POST body to `path` under a server's base URL, retried as the module says; -> the
        JSON of the first 200 response. what: the request, for the error."""
        last, urls = "", self._pick_urls()
        for attempt in range(self.cfg.max_retries + 1):
            url = urls[attempt % len(urls)]
            try:
                r = self.http.post(f"{url}{path}", json=body)
                if r.status_code == 200:
                    return r.json()
                last = f"HTTP {r.status_code} from {url}: {r.text[:300]}"
                if r.status_code not in _RETRY_STATUS:
                    break
            except (httpx.TransportError, ValueError) as exc:
                last = f"{type(exc).__name__} talking to {url}: {exc}"
                if isinstance(exc, httpx.ConnectError):  # down: others get its requests a while
                    self._down_until[url] = time.monotonic() + _DOWN_S
            if attempt < self.cfg.max_retries:
                delay = min(self.cfg.backoff_s * 2 ** attempt, 30.0)
                time.sleep(delay * (0.5 + random.random()))  # jitter: no thundering herd
        raise RequestFailed(f"{what} failed after {attempt + 1} attempt(s): {last}",
                            "check the server (its log, server.urls); rerunning the stage "
                            "resumes from the samples already done")

    def complete(self, req: ChatRequest) -> Completion:
        data = self.post("/chat/completions",
                         {"model": self.model, "messages": req.messages, **req.body},
                         f"sample {req.id}")
        try:
            choice = data["choices"][0]
            reason = "stop" if (choice.get("finish_reason") or "stop") == "stop" else "length"
            text = raw_completion(choice["message"], reason, self.fmt)
            tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise RequestFailed(f"sample {req.id}: the answer of {', '.join(self.urls)} is not "
                                f"an OpenAI chat completion ({type(exc).__name__}: {exc}): "
                                f"{str(data)[:300]}", "check that server.urls are "
                                "OpenAI-compatible chat servers (their /v1 base)") from None
        extras = {k: v for k, v in choice.items() if k not in ("message", "logprobs")}
        return ServedCompletion(text, tokens, reason, emitted_ids(choice), extras)

    def stream(self, requests: list, call=None) -> Iterator[tuple]:
        """Yield (request, call(request)) as they finish, at most `concurrency` in flight; call:
        `complete` unless given. The first failure stops new submissions, lets running requests
        finish (and be yielded), then raises."""
        call = call or self.complete
        todo = iter(requests)
        failure: BaseException | None = None
        pool = ThreadPoolExecutor(self.cfg.concurrency)
        running = {}

        def submit() -> None:
            req = next(todo, None)
            if req is not None:
                running[pool.submit(call, req)] = req

        for _ in range(self.cfg.concurrency):
            submit()
        finished = False
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    req = running.pop(fut)
                    try:
                        result = fut.result()
                    except Exception as exc:
                        failure = failure or exc
                        continue
                    if failure is None:
                        submit()
                    yield req, result
            finished = True
        finally:
            # Interrupted (Ctrl-C, SIGTERM, the consumer stopped): do not wait for requests in
            # flight; the caller goes on to stop the server, which ends them.
            pool.shutdown(wait=finished, cancel_futures=True)
        if failure is not None:
            raise failure
