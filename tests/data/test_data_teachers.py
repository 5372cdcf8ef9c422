"""Teacher clients: the OpenAI-compatible client against a local stand-in server, the pool."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from composer_replication.data import TraceStore, prompt_key
from composer_replication.data.teachers import (
    OpenAICompatibleTeacher,
    OracleTeacher,
    TeacherError,
    TeacherPool,
    bake_traces,
)
from composer_replication.data.teachers.base import TeacherCompletion

SECRET = "sk-test-SECRET-0123456789"


class StandIn:
    """A scripted chat-completions server on 127.0.0.1 (one scripted reply per request)."""

    def __init__(self) -> None:
        self.script: list[tuple] = []
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                outer.requests.append(json.loads(self.rfile.read(length)))
                outer.auth.append(self.headers.get("Authorization"))
                kind, *args = outer.script.pop(0) if outer.script else ("ok", "default")
                if kind == "sleep":
                    threading.Event().wait(args[0])
                    kind, args = "ok", ["late"]
                if kind == "ok":
                    body = json.dumps(
                        {
                            "choices": [{"message": {"content": args[0]}, "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
                        }
                    ).encode()
                    status, headers = 200, {}
                elif kind == "raw":
                    status, body, headers = 200, args[0].encode(), {}
                else:  # ("status", code, body, headers)
                    status, body, headers = (
                        args[0],
                        args[1].encode(),
                        args[2] if len(args) > 2 else {},
                    )
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = StandIn()
    yield s
    s.close()


@pytest.fixture
def client_factory(server, monkeypatch, tmp_path):
    monkeypatch.setenv("TEST_TEACHER_KEY", SECRET)

    def make(**kw):
        opts = dict(
            base_url=server.url,
            model="stand-in",
            api_key_env="TEST_TEACHER_KEY",
            timeout=2.0,
            max_retries=2,
            backoff_base=0.01,
            backoff_max=0.05,
            price_input_per_mtok=1.0,
            price_output_per_mtok=2.0,
        )
        opts.update(kw)
        return OpenAICompatibleTeacher(**opts)

    return make


def test_success_usage_and_cost(server, client_factory):
    server.script = [("ok", "four")]
    client = client_factory()
    [answer] = client.complete(["What is 2+2?"])
    assert answer.text == "four" and not answer.cached
    assert server.requests[0]["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert server.requests[0]["model"] == "stand-in"
    assert server.auth[0] == f"Bearer {SECRET}"
    usage = client.usage_dict()
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == 5
    assert usage["cost_usd"] == pytest.approx((10 * 1.0 + 5 * 2.0) / 1e6)


def test_429_then_success(server, client_factory):
    server.script = [("status", 429, '{"error": "slow down"}', {"Retry-After": "0"}), ("ok", "yes")]
    client = client_factory()
    assert client.complete(["q"])[0].text == "yes"
    assert len(server.requests) == 2 and client.usage.retries == 1


def test_500_retries_exhausted_is_clear_and_secret_free(server, client_factory, caplog):
    # The server echoes the key in its error body; neither logs nor the exception may show it.
    server.script = [("status", 500, f'{{"error": "boom {SECRET}"}}')] * 3
    client = client_factory()
    with caplog.at_level(logging.DEBUG), pytest.raises(TeacherError) as info:
        client.complete(["q"])
    message = str(info.value)
    assert "giving up after 3 attempt(s)" in message and "HTTP 500" in message
    assert SECRET not in message and SECRET not in repr(client)
    assert SECRET not in caplog.text and "HTTP 500" in caplog.text
    assert len(server.requests) == 3


def test_non_retryable_4xx_fails_at_once(server, client_factory):
    server.script = [("status", 401, '{"error": "bad key"}')]
    with pytest.raises(TeacherError, match="HTTP 401.*API key variable") as info:
        client_factory().complete(["q"])
    assert SECRET not in str(info.value) and len(server.requests) == 1


def test_timeout(server, client_factory):
    server.script = [("sleep", 1.0), ("sleep", 1.0)]
    client = client_factory(timeout=0.2, max_retries=1)
    with pytest.raises(TeacherError, match="timed out after 0.2s"):
        client.complete(["q"])


def test_malformed_json(server, client_factory):
    server.script = [("raw", "<html>not json</html>")]
    with pytest.raises(TeacherError, match="malformed chat-completions response"):
        client_factory().complete(["q"])
    server.script = [("raw", '{"choices": []}')]
    with pytest.raises(TeacherError, match="malformed"):
        client_factory().complete(["q"])


def test_cache_hit_avoids_second_request(server, client_factory, tmp_path):
    server.script = [("ok", "cached answer")]
    client = client_factory(cache_dir=tmp_path / "cache")
    first = client.complete(["q"])[0]
    # A fresh client (new process in real life) reads the persistent cache.
    second = client_factory(cache_dir=tmp_path / "cache").complete(["q"])[0]
    assert first.text == second.text == "cached answer"
    assert second.cached and len(server.requests) == 1
    # A different prompt is a miss.
    client.complete(["other"])
    assert len(server.requests) == 2


def test_missing_key_env_is_clear(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR is not set"):
        OpenAICompatibleTeacher(
            base_url="http://127.0.0.1:1", model="m", api_key_env="NO_SUCH_KEY_VAR"
        )


def test_concurrent_batch_keeps_order(server, client_factory):
    server.script = []  # every request answers "default"
    client = client_factory(concurrency=3)
    answers = client.complete([f"q{i}" for i in range(6)])
    assert [a.text for a in answers] == ["default"] * 6 and len(server.requests) == 6


class EmptyTeacher:
    name = "empty"

    def complete(self, prompts):
        return [TeacherCompletion(text="") for _ in prompts]


class BrokenTeacher:
    name = "broken"

    def complete(self, prompts):
        raise TeacherError("down")


def test_pool_skips_and_counts_empty_and_failed_teachers(tmp_path):
    prompts = [[{"role": "user", "content": f"{i}+1?"}] for i in range(3)]
    oracle = OracleTeacher(lambda p: str(int(p[0]["content"].split("+")[0]) + 1))
    pool = TeacherPool(
        [oracle, EmptyTeacher(), BrokenTeacher()],
        verifier=lambda prompt, completion: 1.0 if completion.isdigit() else 0.0,
    )
    stats = bake_traces(pool, prompts, tmp_path / "traces.jsonl")
    assert stats.recorded["oracle"] == 3 and stats.empty["empty"] == 3
    assert stats.errors["broken"] == 3
    store = TraceStore.load(tmp_path / "traces.jsonl", known_prompt_keys=map(prompt_key, prompts))
    assert len(store) == 3 and store.best(prompt_key(prompts[1])).completion == "2"
    assert store.best(prompt_key(prompts[1])).reward == 1.0
    # Resumable: a second bake asks nobody for prompts already present.
    pool2 = TeacherPool([oracle])
    stats2 = bake_traces(pool2, prompts, tmp_path / "traces.jsonl")
    assert stats2.skipped_existing == 3 and sum(stats2.recorded.values()) == 0


def test_hf_model_teacher_generates_greedily():
    from composer_replication.data.teachers import HFModelTeacher
    from composer_replication.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=0)
    teacher = HFModelTeacher(model, tok, name="tiny", max_new_tokens=4, batch_size=2)
    prompts = ["1+1=", [{"role": "user", "content": "2+2="}], "3+3="]
    first = teacher.complete(prompts)
    again = teacher.complete(prompts)
    assert [a.text for a in first] == [a.text for a in again]  # greedy: reproducible
    assert len(first) == 3 and all(0 < a.completion_tokens <= 4 for a in first)
    assert all(a.prompt_tokens > 4 for a in first) and tok.padding_side == "left"
