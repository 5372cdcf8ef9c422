"""The openenv task against a real OpenEnv environment server (tests/openenv_server.py: openenv-core's
own server framework serving `SumEnv` with uvicorn on 127.0.0.1).

Rewards and feedback are compared with the environment's own rule (`openenv_server.score`, the
function the server calls), mapped as the task documents: `(r - lo) / (hi - lo)` clipped to
[0, 1], correct from `success_reward`, the observation's feedback for a wrong answer.
"""

from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openenv_server import problem, run_openenv_server, score

from composer_replication.config import ConfigError, load_config
from composer_replication.run import preflight
from composer_replication.tasks import TASKS, get_task
from composer_replication.tasks.openenv import OpenEnvTask, OpenEnvUnavailable

pytest.importorskip("openenv", reason="needs the `openenv` extra (openenv-core)")

SIZES = {"n_train": 12, "n_eval": 4}


def _answers(prompt: str) -> list[str]:
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    s = a + b
    return [str(s), f" {s}\n", str(s + 1), str(s - 2), str(s + 7), "seven", "", f"{s}<|im_end|>9"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_registered_and_named_inline(openenv_server: str) -> None:
    assert TASKS["openenv"] is OpenEnvTask
    task = get_task(f"openenv:{openenv_server}", seed=0, **SIZES)
    assert isinstance(task, OpenEnvTask) and task.env == openenv_server
    with pytest.raises(ValueError, match="conflicts with env="):
        get_task(f"openenv:{openenv_server}", env="http://127.0.0.1:1")


def test_prompts_come_from_reset_and_the_split_is_reproducible(openenv_server: str) -> None:
    a = get_task(f"openenv:{openenv_server}", seed=3, **SIZES)
    b = get_task(f"openenv:{openenv_server}", seed=3, **SIZES)
    train, evals = a.train_examples(), a.eval_examples()
    assert train == b.train_examples() and evals == b.eval_examples()
    assert len(train) == 12 and len(evals) == 4
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    for ex in train + evals:  # the prompt is what the environment's reset showed for that seed
        x, y = problem(ex.meta["reset_seed"])
        assert ex.prompt == f"{x}+{y}=" and ex.answer == ""
    other = get_task(f"openenv:{openenv_server}", seed=4, **SIZES)
    assert [e.prompt for e in other.eval_examples()] != [e.prompt for e in evals]
    for task in (a, b, other):
        task.close()


@pytest.mark.parametrize(
    ("options", "lo", "hi", "success"),
    [
        ({}, 0.0, 1.0, 1.0),  # the default range: the env's negative rewards clip to 0
        ({"reward_range": [-1, 1]}, -1.0, 1.0, 1.0),
        ({"reward_range": [-1.0, 1.0], "success_reward": 0.0}, -1.0, 1.0, 0.0),
    ],
)
def test_rewards_and_feedback_match_the_environment(
    openenv_server: str, options: dict, lo: float, hi: float, success: float
) -> None:
    task = get_task(f"openenv:{openenv_server}", seed=1, **SIZES, **options)
    examples = task.train_examples()[:4] + task.eval_examples()[:2]
    seen_wrong = 0
    for ex in examples:
        for completion in _answers(ex.prompt):
            sent = completion.split("<|im_end|>")[0].strip()  # what the task sends as the action
            raw, env_feedback = score(ex.prompt, sent)
            verdict = task.verify(ex, completion)
            assert verdict.reward == pytest.approx(min(1.0, max(0.0, (raw - lo) / (hi - lo))))
            assert verdict.correct == (raw >= success)
            if verdict.correct:
                assert verdict.feedback is None
            else:
                seen_wrong += 1
                assert verdict.feedback == env_feedback
    assert seen_wrong > 0
    # The TRL reward function: (score, feedback) per completion, by example id
    ex = examples[0]
    completions = _answers(ex.prompt)[:3]
    got = task.reward_func()(
        prompts=[ex.prompt] * 3, completions=completions, example_id=[ex.id] * 3
    )
    assert got == [(v.reward, v.feedback) for v in (task.verify(ex, c) for c in completions)]
    task.close()


def test_threads_sharing_a_task_get_their_own_episodes(openenv_server: str) -> None:
    task = get_task(f"openenv:{openenv_server}", seed=5, **SIZES, reward_range=[-1, 1])
    pairs = [(ex, c) for ex in task.train_examples()[:6] for c in _answers(ex.prompt)[:4]]
    with ThreadPoolExecutor(max_workers=4) as pool:  # one session: each reset+step is atomic
        verdicts = list(pool.map(lambda p: task.verify(*p), pairs))
    for (ex, completion), verdict in zip(pairs, verdicts, strict=True):
        raw, _ = score(ex.prompt, completion)
        assert verdict.reward == pytest.approx((raw + 1) / 2)
    task.close()


def test_rejected_action_and_generic_feedback(openenv_server: str) -> None:
    task = get_task(f"openenv:{openenv_server}", seed=2, **SIZES, feedback_field="hint")
    ex = task.train_examples()[0]
    # the action fails the server's validation (max_length=64): lowest reward, the server's words
    rejected = task.verify(ex, "1" * 80)
    assert (rejected.reward, rejected.correct) == (0.0, False)
    assert rejected.feedback is not None
    assert rejected.feedback.startswith("The environment rejected the answer: Invalid message")
    # the session is still usable; the step observation's "hint" is empty: generic feedback
    verdict = task.verify(ex, "seven")
    assert verdict.feedback == "The environment scored this answer -1 (success needs 1)."
    assert task.verify(ex, _answers(ex.prompt)[0]).correct
    task.close()


def test_action_field_from_the_schema_or_named(openenv_server: str) -> None:
    auto = get_task(f"openenv:{openenv_server}", seed=0, **SIZES)
    auto.check_ready()
    assert auto.action_field == "answer"  # the one required string field of SumAction
    wrong = get_task(f"openenv:{openenv_server}", seed=0, **SIZES, action_field="message")
    verdict = wrong.verify(wrong.train_examples()[0], "3")  # SumAction forbids extra fields
    assert verdict.feedback is not None and "rejected" in verdict.feedback
    bad_prompt = get_task(f"openenv:{openenv_server}", seed=0, **SIZES, prompt_field="nope")
    with pytest.raises(ValueError, match=r"'nope' is None.*prompt \(str\), hint \(str\)"):
        bad_prompt.check_ready()
    for task in (auto, wrong, bad_prompt):
        task.close()


def test_reset_kwargs_reach_the_environment_and_drift_is_caught(openenv_server: str) -> None:
    shifted = get_task(f"openenv:{openenv_server}", seed=0, **SIZES, reset_kwargs={"offset": 100})
    ex = shifted.train_examples()[0]
    x, y = problem(ex.meta["reset_seed"], 100)
    assert ex.prompt == f"{x}+{y}=" and x >= 100
    assert shifted.verify(ex, str(x + y)).correct
    plain = get_task(f"openenv:{openenv_server}", seed=0, **SIZES)
    with pytest.raises(ValueError, match="is not reproducible: reset"):
        plain.verify(ex, str(x + y))  # the same seed now shows another problem
    shifted.close()
    plain.close()


def test_answer_field_gives_the_oracle(openenv_server: str) -> None:
    task = get_task(
        f"openenv:{openenv_server}",
        seed=0,
        **SIZES,
        answer_field="answer",
        reset_kwargs={"reveal": True},
    )
    for ex in task.train_examples() + task.eval_examples():
        x, y = problem(ex.meta["reset_seed"])
        assert ex.answer == task.oracle(ex) == str(x + y)
        assert task.verify(ex, task.oracle(ex)).correct
    traces = list(task.oracle_traces("train"))
    assert traces and all(t["completion"] and t["teacher"] == "oracle" for t in traces)
    blind = get_task(f"openenv:{openenv_server}", seed=0, **SIZES)
    assert all(blind.oracle(ex) == "" for ex in blind.train_examples())  # nothing to replay
    missing = get_task(f"openenv:{openenv_server}", seed=0, **SIZES, answer_field="nope")
    with pytest.raises(ValueError, match="'nope' is None, not a string or number"):
        missing.train_examples()
    for t in (task, blind, missing):
        t.close()


def test_no_free_session_is_a_clear_error_then_recovers(openenv_server: str) -> None:
    holders = [get_task(f"openenv:{openenv_server}", **SIZES) for _ in range(8)]
    for task in holders:  # the server allows 8 sessions
        task.check_ready()
    extra = get_task(f"openenv:{openenv_server}", **SIZES, capacity_wait_s=1.0)
    try:
        with pytest.raises(OpenEnvUnavailable, match="has no free session.*max_concurrent_envs"):
            extra.check_ready()
        holders.pop().close()
        extra.check_ready()  # a session was freed
    finally:
        for task in [*holders, extra]:
            task.close()


def test_unreachable_server_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    task = get_task(f"openenv:{url}", seed=0, **SIZES, timeout_s=5)
    started = time.monotonic()
    with pytest.raises(OpenEnvUnavailable, match=rf"cannot reach the OpenEnv server at {url}"):
        task.check_ready()
    assert time.monotonic() - started < 30


def test_image_without_docker_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `docker` executable
    task = get_task("openenv:echo-env:latest", seed=0, **SIZES)
    assert task.is_image
    with pytest.raises(OpenEnvUnavailable, match="Docker is not available here.*openenv:http"):
        task.check_ready()


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("openenv", "openenv.core", "openenv.core.generic_client"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    task = get_task("openenv:http://127.0.0.1:1", seed=0, **SIZES)  # options need no openenv
    with pytest.raises(ImportError, match=r"pip install composer-replication\[openenv\]"):
        task.check_ready()
    config = load_config(overrides=["task.name=openenv:http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match=r"^task.name: .*needs the openenv-core package"):
        preflight.check_task(config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs the environment: name the task 'openenv:URL_OR_IMAGE'"),
        ({"env": "127.0.0.1:8000"}, "did you mean 'http://127.0.0.1:8000'"),
        ({"env": "http://"}, "has no valid host and port"),
        ({"env": "http://127.0.0.1:"}, "has no valid host and port"),
        ({"env": "ftp://x/y"}, "neither an http"),
        ({"env": "Not An Image"}, "neither an http"),
        ({"env": "http://h:1", "reward_range": [1, 1]}, "lo < hi"),
        ({"env": "http://h:1", "reward_range": [0, "1"]}, r"reward_range\[1\] must be a finite"),
        ({"env": "http://h:1", "reward_range": [0, 1, 2]}, r"must be \[lo, hi\]"),
        ({"env": "http://h:1", "success_reward": 2}, "success_reward must lie in"),
        ({"env": "http://h:1", "reset_kwargs": {"seed": 1}}, "must not set 'seed'"),
        ({"env": "http://h:1", "prompt_field": ""}, "prompt_field must be a non-empty"),
        ({"env": "http://h:1", "timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_bad_options_name_what_is_wrong(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_task("openenv", **options)


@pytest.mark.slow
def test_a_server_that_dies_is_a_clear_error(tmp_path: Path) -> None:
    with run_openenv_server(tmp_path) as url:
        task = get_task(f"openenv:{url}", seed=0, **SIZES)
        ex = task.train_examples()[0]
        assert task.verify(ex, _answers(ex.prompt)[0]).correct
    # the server is gone (SIGTERM, then SIGKILL): one reconnect is tried, then a clear error
    with pytest.raises(OpenEnvUnavailable, match=f"cannot reach the OpenEnv server at {url}"):
        task.verify(ex, "3")
