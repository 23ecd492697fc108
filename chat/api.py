"""The OpenAI-compatible API's logic, without HTTP: parse requests, match them to stored
conversations (prompt memory across requests and restarts), run them on the chat service.

    api = ChatApi(service, ApiConfig())
    request = api.parse_chat(body)                 # ApiError (400) on a bad request
    for progress in api.run(request, session_hint): # the last Progress has .finish
        ...

Prompt memory. A request is (system, history, last user message). Its history is matched
to a stored API conversation (title "API · ..."), so the spans stored for that
conversation's turns are reused, from RAM or from disk after a restart:
  - exact: the conversation's visible messages equal the history -> `send(last)`;
  - branch: they start with the history, then a user message -> `edit` that message (a new
    branch; the cache is reused up to the history's end);
  - extend: they are a prefix of the history -> the missing turns are appended, then `send`;
  - none: a new conversation with the history appended (the system prompt + documents prefix
    is content-addressed, so even a new conversation reuses a stored prefix).
Matching compares sha256 keys of each prefix of (system prompt, [(role, text), ...]) kept in
RAM and rebuilt from the store on first use. A conversation that is generating is skipped
(a concurrent request with the same history gets a new conversation). `X-Session-Id` (or a
`user` field naming an existing conversation) binds a request to that conversation (also one
made in the UI, with its documents): there a history that diverges is refused (409).

HTTP (routes, auth, streaming, the bounded queue) lives in chat/http_api.py.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

from .errors import ChatError, ConversationNotFound, ConversationTooLong, EngineBusy
from .records import ChatMessage, SessionId, Turn
from spotlight.config import SamplingConfig

API_TITLE = "API · "  # title prefix of the conversations the API made (the ones matched without a binding)
_TITLE_CHARS = 50


@dataclass(frozen=True)
class ApiConfig:
    """The API's settings. `api_key`: required as `Authorization: Bearer` when set (app.py
    defaults it to the UI password); without one, only loopback clients are answered unless
    `allow_remote`. `max_pending`: requests running or waiting for the engine (more get 429)."""

    api_key: str | None = None
    allow_remote: bool = False
    cors_origins: tuple[str, ...] = ()
    model_name: str = "spotlight"
    max_pending: int = 8
    max_tokens: int = 4096  # the most tokens one request may ask for
    max_body_bytes: int = 8 * 1024 * 1024
    retry_after_s: int = 5

    def __post_init__(self):
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 (requests running or queued), got {self.max_pending}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    """A parsed request: `system` None = none given; `history` the turns before `last`."""

    system: str | None
    history: tuple[tuple[str, str], ...]
    last: str
    sampling: SamplingConfig
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


@dataclass(frozen=True)
class Progress:
    """A snapshot of the running reply (the service's Turn is mutable and lives in its thread)."""

    session_id: SessionId
    text: str
    finish: str | None = None  # OpenAI's: "stop" | "length"; None while streaming
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, turn: Turn) -> "Progress":
        finish = None if turn.finish is None else ("length" if turn.finish == "length" else "stop")
        return cls(turn.session_id, turn.text, finish, turn.cached_tokens, turn.cached_tokens + turn.prefill_tokens,
                   turn.decode_tokens)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# ---------------------------------------------------------------------- parsing

def _typed(body: dict, name: str, types, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise invalid(f"'{name}' must be {what}, got a boolean", name, "invalid_type")
    if not isinstance(value, types):
        raise invalid(f"'{name}' must be {what}, got {type(value).__name__}", name, "invalid_type")
    return value


def _content(message: dict, index: int) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused)."""
    content = message.get("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("only text content parts ({'type': 'text', 'text': ...}) are supported", param)
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"'{param}' must be a string or a list of text parts", param, "invalid_type")


def parse_messages(messages) -> tuple[str | None, tuple[tuple[str, str], ...], str]:
    """(system, history, last user text). System messages anywhere are joined into the system
    prompt ("developer" counts as system); the last message must be the user's."""
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {'role', 'content'} objects", "messages",
                      "invalid_type" if not isinstance(messages, list) else None)
    systems, turns = [], []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"'messages[{index}]' must be an object", f"messages[{index}]", "invalid_type")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise invalid(f"'messages[{index}].role' must be 'system', 'user' or 'assistant', got {role!r}",
                          f"messages[{index}].role")
        text = _content(message, index)
        (systems if role in ("system", "developer") else turns).append(text if role in ("system", "developer")
                                                                        else (role, text))
    if not turns or turns[-1][0] != "user" or not turns[-1][1].strip():
        raise invalid("the last message must be a non-empty user message (the one to answer)", "messages")
    return ("\n\n".join(systems) if systems else None), tuple(turns[:-1]), turns[-1][1]


def parse_sampling(body: dict, defaults: SamplingConfig, config: ApiConfig) -> SamplingConfig:
    """The request's sampling options over the server's defaults (max tokens capped by config)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, name, int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"'{name}' must be at least 1", name)
    temperature = _typed(body, "temperature", (int, float), "a number", defaults.temperature)
    top_p = _typed(body, "top_p", (int, float), "a number", defaults.top_p)
    seed = _typed(body, "seed", int, "an integer")
    stop = body.get("stop")
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise invalid("'stop' must be a string or a list of at most 4 strings", "stop", "invalid_type")
    if not 0 <= temperature <= 2:
        raise invalid(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise invalid(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    n = _typed(body, "n", int, "an integer", 1)
    if n != 1:
        raise invalid("only n=1 is supported: send one request per completion", "n")
    limit = min(max_tokens or defaults.max_new_tokens, config.max_tokens)
    return replace(defaults, temperature=float(temperature), top_p=float(top_p), max_new_tokens=limit,
                   stop_strings=tuple(s for s in stops if s), seed=seed)


def _options(body: dict) -> tuple[bool, bool, str | None]:
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object", {})
    include_usage = _typed(options, "include_usage", bool, "a boolean", False)
    user = _typed(body, "user", str, "a string")
    return stream, include_usage, user


# ---------------------------------------------------------------------- matching

def _key(system: str, turns) -> str:
    return hashlib.sha256(json.dumps([system, [list(t) for t in turns]]).encode()).hexdigest()


def _prefix_keys(system: str, turns) -> list[str]:
    """The key of every prefix of `turns` (index i: the first i turns)."""
    return [_key(system, turns[:i]) for i in range(len(turns) + 1)]


@dataclass(frozen=True)
class _Chain:
    keys: tuple[str, ...]  # _prefix_keys of the visible messages
    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class Plan:
    """How to run a request on a conversation (see the module docstring)."""

    session_id: SessionId
    action: str  # "send" | "edit" | "extend"
    common: int  # history turns already stored


def plan_for(chain: _Chain, request_keys: list[str]) -> Plan | None:
    """The plan for one conversation, or None when its messages diverge from the history."""
    common = 0
    while common < min(len(chain.keys), len(request_keys)) and chain.keys[common] == request_keys[common]:
        common += 1
    common -= 1  # keys[0] (no turns) always equals when the system prompts do
    history, stored = len(request_keys) - 1, len(chain.messages)
    if common < 0:
        return None
    if common == history == stored:
        return Plan("", "send", common)
    if common == history < stored and chain.messages[common].role == "user":
        return Plan("", "edit", common)
    if common == stored < history:
        return Plan("", "extend", common)
    return None


_RANK = {"send": 0, "edit": 1, "extend": 2}


class ChatApi:
    """Parses, matches and runs API requests on one ChatService (thread-safe)."""

    def __init__(self, service, config: ApiConfig):
        self.service = service
        self.config = config
        self._chains: dict[SessionId, _Chain] | None = None  # API conversations, rebuilt on first use
        self._busy: set[SessionId] = set()
        self._lock = threading.Lock()

    # -------------------------------------------------------------- parsing

    def parse_chat(self, body) -> ChatRequest:
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object", None, "invalid_type")
        system, history, last = parse_messages(body.get("messages"))
        stream, include_usage, user = _options(body)
        return ChatRequest(system, history, last, parse_sampling(body, self.service.config.sampling, self.config),
                           stream, include_usage, user)

    def parse_completion(self, body) -> ChatRequest:
        """A plain prompt: sent as one user message (the model is a chat model)."""
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object", None, "invalid_type")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise invalid("'prompt' must be a non-empty string (one prompt per request)", "prompt", "invalid_type")
        stream, include_usage, user = _options(body)
        return ChatRequest(None, (), prompt, parse_sampling(body, self.service.config.sampling, self.config),
                           stream, include_usage, user)

    # -------------------------------------------------------------- running

    def run(self, request: ChatRequest, session_hint: str | None = None) -> Iterator[Progress]:
        """Stream the reply as Progress snapshots; the last one has `finish`. ApiError on a
        request that cannot run (too long for the window, a bound conversation that diverges)."""
        self._check_window(request)
        plan = self._claim(request, session_hint or self._existing(request.user))
        try:
            yield from self._execute(plan, request)
        except ConversationTooLong as error:
            raise self._too_long(str(error)) from error
        except EngineBusy as error:
            raise ApiError(409, f"{error} (conversation {plan.session_id})", code="conversation_busy") from error
        finally:
            self._release(plan.session_id)

    def _execute(self, plan: Plan, request: ChatRequest) -> Iterator[Progress]:
        service, sampling = self.service, request.sampling
        if plan.action == "edit":
            message_id = service.history(plan.session_id)[plan.common].id
            turns = service.edit(plan.session_id, message_id, request.last, sampling=sampling)
        else:
            for role, text in request.history[plan.common:]:
                service.append(plan.session_id, role, text)
            turns = service.send(plan.session_id, request.last, sampling=sampling)
        for turn in turns:
            yield Progress.of(turn)

    def _check_window(self, request: ChatRequest) -> None:
        """Refuse early (before storing anything) a request whose text alone exceeds what a
        conversation holds (`context_window`: Spotlight's cap, or the model's window when dense)."""
        window = self.service.context_window()
        texts = [request.system or "", request.last, *(text for _, text in request.history)]
        n_tokens = sum(self.service.count_tokens(text) for text in texts)
        if n_tokens >= window:
            raise self._too_long(f"the messages have {n_tokens:,} tokens")

    def _too_long(self, detail: str) -> ApiError:
        window = self.service.context_window()
        return invalid(f"This model's maximum context length is {window:,} tokens, and the request does not fit "
                       f"({detail}). Shorten the messages or the documents.", "messages", "context_length_exceeded")

    def _existing(self, user: str | None) -> str | None:
        """`user` binds the request when it names an existing conversation (else it is just a label)."""
        if not user:
            return None
        try:
            self.service.get(user)
        except (ChatError, ValueError):
            return None
        return user

    # -------------------------------------------------------------- matching

    def _claim(self, request: ChatRequest, bound: str | None) -> Plan:
        with self._lock:
            if bound is not None:
                plan = self._bound_plan(request, bound)
            else:
                plan = self._best_plan(request) or self._new_plan(request)
            self._busy.add(plan.session_id)
            return plan

    def _bound_plan(self, request: ChatRequest, session_id: str) -> Plan:
        try:
            session = self.service.get(session_id)
        except ConversationNotFound as error:
            raise ApiError(404, str(error), param="X-Session-Id", code="conversation_not_found") from error
        if request.system is not None and request.system != session.system_prompt:
            raise ApiError(409, f"the request's system message differs from conversation {session_id}'s system "
                                "prompt; send none to use the conversation's, or start a new conversation",
                           param="messages", code="history_mismatch")
        chain = self._chain(session_id, session.system_prompt)
        plan = plan_for(chain, _prefix_keys(session.system_prompt, request.history))
        if plan is None:
            raise ApiError(409, f"the request's earlier messages differ from conversation {session_id}'s; send "
                                "its history as shown, or leave out X-Session-Id to start a new conversation",
                           param="messages", code="history_mismatch")
        return replace(plan, session_id=session_id)

    def _best_plan(self, request: ChatRequest) -> Plan | None:
        system = request.system or ""
        keys = _prefix_keys(system, request.history)
        plans = []
        for session_id, chain in self._api_chains().items():
            if session_id in self._busy:
                continue
            plan = plan_for(chain, keys)
            if plan is not None:
                plans.append(replace(plan, session_id=session_id))
        return min(plans, key=lambda p: (_RANK[p.action], -p.common), default=None)

    def _new_plan(self, request: ChatRequest) -> Plan:
        first = next((text for role, text in request.history if role == "user"), request.last)
        title = API_TITLE + (" ".join(first.split())[:_TITLE_CHARS] or "request")
        session = self.service.create(title, system_prompt=request.system or "")
        self._api_chains()[session.id] = _Chain((_key(session.system_prompt, ()),), ())
        return Plan(session.id, "extend", 0)

    def _api_chains(self) -> dict[SessionId, _Chain]:
        """The API conversations' chains, read from the store on first use (after a restart)."""
        if self._chains is None:
            self._chains = {s.id: self._chain(s.id, s.system_prompt) for s in self.service.list_sessions()
                            if s.title.startswith(API_TITLE)}
        return self._chains

    def _chain(self, session_id: SessionId, system: str) -> _Chain:
        messages = tuple(self.service.history(session_id))
        return _Chain(tuple(_prefix_keys(system, [(m.role, m.content) for m in messages])), messages)

    def _release(self, session_id: SessionId) -> None:
        with self._lock:
            self._busy.discard(session_id)
            chains = self._api_chains()
            try:
                session = self.service.get(session_id)
            except ChatError:
                chains.pop(session_id, None)
                return
            if session.title.startswith(API_TITLE):
                chains[session_id] = self._chain(session_id, session.system_prompt)
