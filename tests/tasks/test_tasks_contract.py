"""The task contract shared by every built-in task: registry, split, dataset, reward function,
oracle traces (see /work/notes/task_contract.md and composer_replication/tasks/task.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from composer_replication.tasks import (
    TASK_NAMES,
    TASKS,
    Example,
    TaskName,
    Verdict,
    clean_completion,
    get_task,
    is_task_name,
)
from composer_replication.tasks.task import completion_text, strip_answer_prefix

# Small splits keep the pycode oracle checks (one sandboxed subprocess each) cheap.
BUILTIN = [
    ("arithmetic", {"level": "easy"}),
    ("arithmetic", {"level": "hard"}),
    ("strings", {"level": "easy"}),
    ("strings", {"level": "hard"}),
    ("pycode", {"level": "easy"}),
    ("pycode", {"level": "hard"}),
]
SIZES = {"n_train": 40, "n_eval": 12}


def test_task_names_are_the_registry() -> None:
    # the registry is the one list of names (ARCHITECTURE.md, "Where to add": a task)
    assert TaskName is str and TASK_NAMES == tuple(TASKS)
    assert all(is_task_name(n) for n in TASKS) and not is_task_name("reasoning_gym:chain_sum")


def test_registry_names_and_errors() -> None:
    assert {"arithmetic", "strings", "pycode", "reasoning_gym"} <= set(TASKS)
    for name, cls in TASKS.items():
        assert cls.name == name
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(ValueError, match="does not take option"):
        get_task("arithmetic", colour="red")
    with pytest.raises(ValueError, match="level"):
        get_task("strings", level="impossible")
    with pytest.raises(ValueError, match="n_train"):
        get_task("arithmetic", n_train=0)


@pytest.mark.parametrize(("name", "options"), BUILTIN)
def test_split_is_deterministic_disjoint_and_sized(name: str, options: dict) -> None:
    a = get_task(name, seed=3, **SIZES, **options)
    b = get_task(name, seed=3, **SIZES, **options)
    train, evals = a.train_examples(), a.eval_examples()
    assert len(train) == SIZES["n_train"] and len(evals) == SIZES["n_eval"]
    assert train == b.train_examples() and evals == b.eval_examples()
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert len({e.prompt for e in evals}) == len(evals)
    ids = [e.id for e in train + evals]
    assert len(set(ids)) == len(ids)
    for ex in train + evals:
        json.dumps(ex.meta)  # meta must be JSON-serialisable
        assert a.get_example(ex.id) == ex
    other = get_task(name, seed=4, **SIZES, **options)
    assert [e.prompt for e in other.eval_examples()] != [e.prompt for e in evals]


def test_split_is_identical_across_processes_and_hash_seeds() -> None:
    code = (
        "import json; from composer_replication.tasks import get_task\n"
        "out = {n: [e.prompt for e in get_task(n, seed=1, n_train=30, n_eval=10).train_examples()]"
        " for n in ('arithmetic', 'strings', 'pycode')}\n"
        "print(json.dumps(out))"
    )
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]


def test_small_problem_space_cycles_train_and_rejects_too_large_eval() -> None:
    task = get_task("arithmetic", seed=0, n_train=50, n_eval=90)  # easy: 100 distinct problems
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 50 and len(evals) == 90
    distinct = {e.prompt for e in train}
    assert len(distinct) == 10  # all that is left, repeated
    assert not distinct & {e.prompt for e in evals}
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        get_task("arithmetic", n_eval=101).eval_examples()
    with pytest.raises(ValueError, match="leaving none for training"):
        get_task("arithmetic", n_eval=100).train_examples()


@pytest.mark.parametrize(("name", "options"), BUILTIN)
def test_oracle_is_correct_and_feedback_contract(name: str, options: dict) -> None:
    task = get_task(name, seed=0, **SIZES, **options)
    examples = task.train_examples()[:6] + task.eval_examples()[:6]
    verdicts = task.verify_many(examples, [task.oracle(ex) for ex in examples])
    assert all(v == Verdict(1.0, True, None) for v in verdicts)
    wrong = task.verify_many(examples, ["Answer: definitely not it"] * len(examples))
    for v in wrong:
        assert not v.correct and 0.0 <= v.reward < 1.0 and v.feedback


@pytest.mark.parametrize("name", ["arithmetic", "strings", "pycode"])
def test_to_dataset_and_reward_func(name: str) -> None:
    task = get_task(name, seed=0, n_train=8, n_eval=4)
    ds = task.to_dataset("train")
    assert set(ds.column_names) == {"prompt", "example_id", "answer", "task_meta", "hinted_example"}
    assert not any(ds["hinted_example"])
    assert len(ds) == 8 and len(task.to_dataset("eval")) == 4
    row = ds[0]
    ex = task.get_example(row["example_id"])
    assert row["prompt"] == [{"role": "user", "content": ex.prompt}]
    assert json.loads(row["task_meta"]) == ex.meta
    with pytest.raises(ValueError, match="split"):
        task.to_dataset("test")

    reward = task.reward_func()
    assert reward.__name__ == f"{name}_reward"
    good, bad = task.oracle(ex), "zzz zzz"
    # TRL passes every non-prompt column as a list, one entry per completion.
    cols = {k: [row[k], row[k]] for k in ("example_id", "answer", "task_meta")}
    out = reward(prompts=[row["prompt"]] * 2, completions=[good, bad], completion_ids=None, **cols)
    assert out[0] == (1.0, None)
    assert out[1][0] < 1.0 and isinstance(out[1][1], str) and out[1][1]
    # Conversational completions (a list of messages) work the same way.
    chat = [[{"role": "assistant", "content": good}]]
    assert reward(prompts=[row["prompt"]], completions=chat, **{k: v[:1] for k, v in cols.items()})[
        0
    ] == (1.0, None)
    # Plain floats for a stock TRL trainer.
    assert task.reward_func(with_feedback=False)(completions=[good], example_id=[ex.id]) == [1.0]
    # A row from another seed (id unknown here) is rebuilt from its answer/task_meta columns.
    cols_unknown = {**cols, "example_id": ["elsewhere/0", "elsewhere/1"]}
    out2 = reward(prompts=[row["prompt"]] * 2, completions=[good, bad], **cols_unknown)
    assert out2[0] == (1.0, None)
    with pytest.raises(ValueError, match="example_id"):
        reward(completions=[good])


def test_reward_func_never_verifies_against_another_seeds_example() -> None:
    mine = get_task("arithmetic", seed=0, n_train=20, n_eval=5)
    theirs = get_task("arithmetic", seed=1, n_train=20, n_eval=5).to_dataset("train")
    # An id carries its prompt's digest: one shared by chance names the same prompt (and answer)
    for row in theirs:
        if row["example_id"] in {e.id for e in mine.train_examples()}:
            assert mine.get_example(row["example_id"]).answer == row["answer"]
    reward = mine.reward_func()
    cols = {k: list(theirs[k]) for k in ("example_id", "answer", "task_meta")}
    out = reward(prompts=list(theirs["prompt"]), completions=cols["answer"], **cols)
    assert all(score == 1.0 for score, _ in out)  # rebuilt from their own columns


@pytest.mark.parametrize("name", ["arithmetic", "strings", "pycode"])
def test_oracle_traces_match_the_trace_format(name: str) -> None:
    from composer_replication.data.traces import TraceRecord, prompt_key

    task = get_task(name, seed=0, n_train=30, n_eval=5)
    traces = list(task.oracle_traces())
    prompts = {e.prompt: e for e in task.train_examples()}
    assert len(traces) == len(prompts)  # one per distinct prompt
    keys = {prompt_key([{"role": "user", "content": p}]): e for p, e in prompts.items()}
    for trace in traces:
        assert trace["teacher"] == "oracle" and trace["reward"] == 1.0
        ex = keys[trace["prompt_key"]]
        assert trace["completion"] == task.oracle(ex)
        assert trace["metadata"]["example_id"] == ex.id
        TraceRecord.from_json(trace, where="test")  # accepted by the trainer's reader


def test_completion_cleaning() -> None:
    assert clean_completion("  7 <|im_end|>\nmore") == "7"
    assert clean_completion("7<|endoftext|><|pad|><|pad|>") == "7"
    assert clean_completion("<|im_start|>7\n") == "7"
    assert strip_answer_prefix("Answer: 7") == "7"
    assert strip_answer_prefix("The answer is 7") == "7"
    assert strip_answer_prefix("answer:7") == "7"
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    assert completion_text([]) == ""
    with pytest.raises(ValueError, match="completion"):
        completion_text(42)


def test_verdict_and_example_validation() -> None:
    with pytest.raises(ValueError, match="reward"):
        Verdict(1.5, False, "x")
    with pytest.raises(ValueError, match="no feedback"):
        Verdict(1.0, True, "well done")
    with pytest.raises(ValueError, match="what was wrong"):
        Verdict(0.2, False, None)
    ex = Example(id="a", prompt="p", answer="1")
    assert ex.meta == {}
    with pytest.raises(AttributeError):
        ex.answer = "2"  # type: ignore[misc]
