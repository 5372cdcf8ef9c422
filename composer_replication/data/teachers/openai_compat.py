"""`OpenAICompatibleTeacher`: any chat-completions endpoint (OpenAI, OpenRouter, vLLM, TGI, ...).

Standard library only (``urllib``), so baking traces needs no extra dependency. What it does:

* the API key is read from an environment variable (``api_key_env``) and is never written to logs,
  exceptions or ``repr`` (server error bodies are redacted too, in case an endpoint echoes it);
* at most ``concurrency`` requests in flight (a thread pool);
* per-request ``timeout``; retries with exponential backoff (honouring ``Retry-After``) on HTTP
  429, 5xx, timeouts and connection errors; other 4xx and malformed responses fail at once with a
  `TeacherError` saying what came back;
* a persistent on-disk cache keyed by teacher name, model, endpoint, generation parameters and the
  prompt, so re-running a bake never pays twice for the same answer;
* token usage and cost accounting (``price_input_per_mtok`` / ``price_output_per_mtok`` in USD per
  million tokens) in `usage`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from composer_replication.data.teachers.base import (
    Prompt,
    TeacherCompletion,
    TeacherError,
    as_messages,
)
from composer_replication.json_types import JSONDict, JSONValue

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclass
class TeacherUsage:
    """Running totals for one client (thread-safe updates through the client)."""

    requests: int = 0
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OpenAICompatibleTeacher:
    """A chat-completions teacher; see the module docstring for behaviour."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        name: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        concurrency: int = 4,
        timeout: float = 60.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 20.0,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        extra_body: Mapping[str, JSONValue] | None = None,
        cache_dir: str | Path | None = None,
        price_input_per_mtok: float = 0.0,
        price_output_per_mtok: float = 0.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not model:
            raise ValueError("model must be a non-empty model id")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if timeout <= 0:
            raise ValueError("timeout must be > 0 seconds")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self._api_key: str | None = None
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(
                    f"environment variable {api_key_env} is not set; export the API key there, or "
                    "pass api_key_env=None for an endpoint that needs no key"
                )
            self._api_key = key
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = name or model
        self.concurrency = concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.price_input_per_mtok = price_input_per_mtok
        self.price_output_per_mtok = price_output_per_mtok
        self.usage = TeacherUsage()
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never show the key
        return (
            f"OpenAICompatibleTeacher(name={self.name!r}, model={self.model!r}, "
            f"base_url={self.base_url!r})"
        )

    # -- public -----------------------------------------------------------------------------
    def complete(self, prompts: Sequence[Prompt]) -> list[TeacherCompletion]:
        if not prompts:
            return []
        if self.concurrency == 1 or len(prompts) == 1:
            return [self._complete_one(p) for p in prompts]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._complete_one, prompts))

    def usage_dict(self) -> JSONDict:
        with self._lock:
            return asdict(self.usage)

    # -- internals --------------------------------------------------------------------------
    def _redact(self, text: str) -> str:
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "***")
        return text

    def _body(self, prompt: Prompt) -> JSONDict:
        return {
            "model": self.model,
            "messages": as_messages(prompt),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            **self.extra_body,
        }

    def _cache_path(self, body: JSONDict) -> Path | None:
        if self.cache_dir is None:
            return None
        key_src = json.dumps(
            {"teacher": self.name, "endpoint": self.base_url, "body": body},
            sort_keys=True,
            ensure_ascii=False,
        )
        digest = hashlib.sha256(key_src.encode("utf-8")).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def _complete_one(self, prompt: Prompt) -> TeacherCompletion:
        body = self._body(prompt)
        cache_path = self._cache_path(body)
        if cache_path is not None and cache_path.exists():
            try:
                cached = json.loads(cache_path.read_text(encoding="utf-8"))
                with self._lock:
                    self.usage.cache_hits += 1
                return TeacherCompletion(
                    text=cached["text"],
                    prompt_tokens=int(cached.get("prompt_tokens", 0)),
                    completion_tokens=int(cached.get("completion_tokens", 0)),
                    cost_usd=0.0,
                    cached=True,
                )
            except (OSError, ValueError, KeyError):
                logger.warning("ignoring unreadable cache entry %s", cache_path)
        completion = self._request_with_retries(body)
        if cache_path is not None and completion.text:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(
                json.dumps(
                    {
                        "text": completion.text,
                        "prompt_tokens": completion.prompt_tokens,
                        "completion_tokens": completion.completion_tokens,
                    }
                ),
                encoding="utf-8",
            )
            os.replace(tmp, cache_path)  # atomic: concurrent bakes never see half a file
        return completion

    def _request_with_retries(self, body: JSONDict) -> TeacherCompletion:
        last: str = ""
        for attempt in range(self.max_retries + 1):
            try:
                return self._request(body)
            except _Retryable as exc:
                last = str(exc)
                if attempt == self.max_retries:
                    break
                delay = min(self.backoff_max, self.backoff_base * (2**attempt))
                delay *= (
                    0.5 + random.random() / 2
                )  # jitter: concurrent workers do not retry in step
                if exc.retry_after is not None:
                    delay = min(self.backoff_max, max(delay, exc.retry_after))
                with self._lock:
                    self.usage.retries += 1
                logger.info(
                    "teacher %s: %s; retry %d/%d in %.2fs",
                    self.name,
                    last,
                    attempt + 1,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)
        with self._lock:
            self.usage.failures += 1
        raise TeacherError(
            f"teacher {self.name!r} ({self.base_url}): giving up after "
            f"{self.max_retries + 1} attempt(s): {last}"
        )

    def _request(self, body: JSONDict) -> TeacherCompletion:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=json.dumps(body).encode("utf-8"),
            headers=headers,
            method="POST",
        )
        with self._lock:
            self.usage.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = self._redact(exc.read(500).decode("utf-8", "replace")).strip()
            retry_after = _parse_retry_after(
                exc.headers.get("Retry-After") if exc.headers else None
            )
            message = f"HTTP {exc.code} {exc.reason}: {detail[:300]}"
            if exc.code in RETRYABLE_STATUS or 500 <= exc.code < 600:
                raise _Retryable(message, retry_after) from None
            with self._lock:
                self.usage.failures += 1
            raise TeacherError(
                f"teacher {self.name!r} ({self.base_url}): {message}"
                + (" (check the API key variable)" if exc.code in (401, 403) else "")
            ) from None
        except TimeoutError:
            raise _Retryable(f"timed out after {self.timeout:g}s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError | socket.timeout):
                raise _Retryable(f"timed out after {self.timeout:g}s") from None
            raise _Retryable(f"connection error: {self._redact(str(exc.reason))}") from None
        except (ConnectionError, OSError) as exc:
            raise _Retryable(f"connection error: {self._redact(str(exc))}") from None
        return self._parse(raw)

    def _parse(self, raw: bytes) -> TeacherCompletion:
        try:
            payload = json.loads(raw)
            choice = payload["choices"][0]
            text = choice["message"].get("content") or ""
            if not isinstance(text, str):
                raise TypeError("message.content is not a string")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            with self._lock:
                self.usage.failures += 1
            snippet = self._redact(raw[:200].decode("utf-8", "replace"))
            raise TeacherError(
                f"teacher {self.name!r} ({self.base_url}): malformed chat-completions response "
                f"({type(exc).__name__}: {exc}); body starts {snippet!r}"
            ) from None
        usage = payload.get("usage") or {}
        p_tok = int(usage.get("prompt_tokens") or 0)
        c_tok = int(usage.get("completion_tokens") or 0)
        cost = (p_tok * self.price_input_per_mtok + c_tok * self.price_output_per_mtok) / 1e6
        with self._lock:
            self.usage.prompt_tokens += p_tok
            self.usage.completion_tokens += c_tok
            self.usage.cost_usd += cost
        return TeacherCompletion(
            text=text,
            prompt_tokens=p_tok,
            completion_tokens=c_tok,
            cost_usd=cost,
            metadata={"finish_reason": choice.get("finish_reason")},
        )


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
