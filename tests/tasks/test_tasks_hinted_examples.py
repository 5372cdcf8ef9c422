"""`task.hint_share`: training prompts also shown with channel 2's hint in context, so the policy
learns to read the hint its teacher is given; never a held-out prompt, same answers."""

from __future__ import annotations

import math
import re

import pytest

from composer_replication.config import ConfigError, load_config
from composer_replication.data.hints import HINTED_EXAMPLE_COLUMN, HintTemplate
from composer_replication.data.traces import prompt_key
from composer_replication.tasks import get_task
from composer_replication.tasks.task import HINT_KINDS, chat_prompt


def _task():
    return get_task("arithmetic", seed=0, n_train=40, n_eval=16, num_operands=3)


def test_hinted_examples_are_training_prompts_with_the_hint_and_the_same_answer() -> None:
    task = _task()
    distinct = list({ex.prompt: ex for ex in task.train_examples()}.values())
    hinted = task.hinted_examples(0.25)
    assert len(hinted) == math.ceil(0.25 * len(distinct))
    held_out = {ex.prompt for ex in task.eval_examples()}
    template = HintTemplate()
    kinds = []
    for h, ex in zip(hinted, distinct, strict=False):
        assert h.answer == ex.answer and h.id == f"{ex.id}/hinted"
        assert h.prompt.startswith(ex.prompt) and ex.prompt not in held_out
        solution = f"Correct solution:\n\n{task.oracle(ex)}" in h.prompt
        feedback = "feedback from your unsuccessful earlier attempt" in h.prompt
        kinds.append((solution, feedback))
        assert h.prompt.endswith(template.render_text("", None, None))
        assert task.verify(h, task.oracle(ex)).correct
    # the three hints channel 2 shows, in turn: the solution, the solution and the feedback on a
    # wrong attempt, the feedback alone
    assert kinds == [HINT_KINDS[i % 3] for i in range(len(hinted))]
    assert HINT_KINDS == ((True, False), (True, True), (False, True))
    assert task.hinted_examples(0.0) == []


def test_the_feedback_of_a_hinted_example_does_not_give_the_answer_away() -> None:
    """A hint with feedback alone must not spell the answer (a wrong answer of the reference
    with its last digit doubled did: the teacher learned to read the leak, not the question):
    arithmetic's failed attempts are near misses, whose feedback says "too small / too large"."""
    task = _task()
    for i, h in enumerate(task.hinted_examples(1.0)):
        if HINT_KINDS[i % 3] != (False, True):
            continue
        feedback = h.prompt.split("earlier attempt:")[1]
        found = re.search(r"Wrong answer: (-?\d+)", feedback)
        assert found is not None, feedback
        wrong = int(found.group(1))
        assert wrong != int(h.answer) and abs(wrong - int(h.answer)) <= 10
        assert ("too small" in feedback) == (wrong < int(h.answer))


def test_a_template_that_keeps_feedback_for_failures_without_a_solution() -> None:
    """`feedback_with_solution=False` (the SDPO reference runs' setting): the hinted examples
    are written as channel 2 then writes its hints, the solution alone where there is one."""
    task = _task()
    template = HintTemplate(feedback_with_solution=False)
    plain = task.train_examples()[:6]
    hinted = task.hinted_examples(1.0, plain, template)
    assert [h.id for h in hinted] == [f"{ex.id}/hinted" for ex in plain]
    solution = ["Correct solution" in h.prompt for h in hinted]
    feedback = ["earlier attempt" in h.prompt for h in hinted]
    assert solution == [True, True, False] * 2 and feedback == [False, False, True] * 2


def test_without_feedback_alone_every_hinted_example_shows_the_solution() -> None:
    """`feedback_alone=False` (channel 2 gives no hint without a successful sibling): the
    hinted examples cycle through the two kinds that carry the solution."""
    template = HintTemplate(feedback_with_solution=False, feedback_alone=False)
    hinted = _task().hinted_examples(1.0, template=template)
    assert hinted and all("Correct solution" in h.prompt for h in hinted)
    assert not any("earlier attempt" in h.prompt for h in hinted)
    config = load_config(overrides=["task.hint_feedback_alone=false"])
    from composer_replication.assembly.build import hint_template

    assert hint_template(config).feedback_alone is False
    assert hint_template(load_config()).feedback_alone is True
    with pytest.raises(ConfigError, match="task.hint_feedback_alone"):
        load_config(overrides=["task.hint_feedback_alone=maybe"])


def test_datasets_and_oracle_traces_carry_the_hinted_rows() -> None:
    pytest.importorskip("datasets")
    task = _task()
    hinted = task.hinted_examples(0.5)
    plain = task.to_dataset("train")
    data = task.to_dataset("train", hint_share=0.5)
    assert len(data) == len(plain) + len(hinted)
    rows = [data[i] for i in range(len(plain), len(data))]
    assert [r["prompt"] for r in rows] == [chat_prompt(h.prompt) for h in hinted]
    # The column the trainer's hint_grpo reads: true on the hinted rows exactly.
    assert data[HINTED_EXAMPLE_COLUMN] == [False] * len(plain) + [True] * len(hinted)
    assert plain[HINTED_EXAMPLE_COLUMN] == [False] * len(plain)
    reward = task.reward_func()
    scores = reward(
        prompts=[r["prompt"] for r in rows],
        completions=[r["answer"] for r in rows],
        example_id=[r["example_id"] for r in rows],
        answer=[r["answer"] for r in rows],
        task_meta=[r["task_meta"] for r in rows],
    )
    assert all(score == 1.0 for score, _ in scores)
    keys = {t["prompt_key"] for t in task.oracle_traces("train", hint_share=0.5)}
    assert {prompt_key(chat_prompt(h.prompt)) for h in hinted} <= keys
    with pytest.raises(ValueError, match="train split only"):
        task.to_dataset("eval", hint_share=0.5)
    with pytest.raises(ValueError, match=r"hint_share must be in \[0, 1\]"):
        task.hinted_examples(1.5)


def test_the_config_key_is_checked() -> None:
    assert load_config(overrides=["task.hint_share=0.5"]).task.hint_share == 0.5
    with pytest.raises(ConfigError, match="task.hint_share"):
        load_config(overrides=["task.hint_share=1.5"])


def test_hinted_examples_kept_out_of_channel_1_need_channel_3() -> None:
    """`task.hint_grpo = false` leaves the hinted examples to channel 3's replay: a run without a
    channel-3 teacher is refused by name, and either way out is accepted."""
    no_replay = ["task.hint_share=0.25", "loss.beta_replay=0", "task.hint_grpo=false"]
    with pytest.raises(ConfigError, match="task.hint_grpo"):
        load_config(overrides=no_replay)
    with pytest.raises(ConfigError, match="task.hint_grpo"):
        load_config(
            overrides=["task.hint_share=0.25", "teachers.oracle=false", "task.hint_grpo=false"]
        )
    assert load_config(overrides=[*no_replay, "task.hint_grpo=true"]).task.hint_grpo is True
    assert load_config(overrides=["task.hint_share=0.25"]).task.hint_grpo is True
    off = ["task.hint_share=0", *no_replay[1:]]
    assert load_config(overrides=off).loss.beta_replay == 0.0


def test_the_run_passes_hint_grpo_to_its_trainer(tmp_path) -> None:
    pytest.importorskip("trl")
    from composer_replication.assembly.build import build_trainer
    from composer_replication.models import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    for value in (True, False):
        config = load_config(
            overrides=[
                "task.hint_share=0.25",
                f"task.hint_grpo={str(value).lower()}",
                "backend.n_replicas=1",
            ]
        )
        trainer = build_trainer(
            config,
            task=_task(),
            model=build_tiny_model(tok, hidden_size=16, num_layers=1, seed=0),
            tokenizer=tok,
            max_steps=1,
            seed=0,
            output_dir=str(tmp_path / str(value)),
        )
        assert trainer.composer.hint_grpo is value
        assert any(trainer.train_dataset[HINTED_EXAMPLE_COLUMN])


def test_beyond_problems_share_no_class_with_any_split_and_are_out_of_reach() -> None:
    """`hint_source = "beyond"`: problems further out than the out-of-distribution split, so no
    hinted example is a training, held-out or OOD prompt in another form, and a policy that adds
    three digits cannot solve them without the hint (two more operands)."""
    task = get_task("arithmetic", seed=0, n_train=700, n_eval=256, num_operands=3)
    beyond = task.beyond_examples(200)
    assert len({ex.prompt for ex in beyond}) == 200
    classes = {
        task.canonical(ex)
        for ex in (*task.train_examples(), *task.eval_examples(), *task.ood_examples(200))
    }
    assert not {task.canonical(ex) for ex in beyond} & classes
    assert all(ex.prompt.count("+") == 4 for ex in beyond)
    assert all(task.verify(ex, task.oracle(ex)).correct for ex in beyond)
    # the same seed draws the same problems; another seed others
    assert [ex.prompt for ex in task.beyond_examples(200)] == [ex.prompt for ex in beyond]
    other = get_task("arithmetic", seed=1, n_train=700, n_eval=256, num_operands=3)
    assert [ex.prompt for ex in other.beyond_examples(200)] != [ex.prompt for ex in beyond]


def test_beyond_hints_always_show_the_solution() -> None:
    """A hint without the solution cannot be solved on a problem beyond reach (it would teach
    guessing), so `source="beyond"` cycles through the two kinds that carry it; as many hinted
    examples as `share` of the distinct training prompts."""
    task = _task()
    distinct = {ex.prompt for ex in task.train_examples()}
    hinted = task.hinted_examples(0.5, source="beyond")
    assert len(hinted) == math.ceil(0.5 * len(distinct))
    assert not {h.prompt.split("\n")[0] for h in hinted} & distinct
    kinds = [
        (f"Correct solution:\n\n{h.answer}\n" in h.prompt, "earlier attempt" in h.prompt)
        for h in hinted
    ]
    assert kinds == [((True, False), (True, True))[i % 2] for i in range(len(hinted))]
    for h in hinted:
        assert task.verify(h, h.answer).correct and not task.verify(h, "0").correct


def test_a_task_without_beyond_problems_says_so() -> None:
    task = get_task("pycode", seed=0, n_train=8, n_eval=4)
    assert not task.has_beyond()
    with pytest.raises(ValueError, match="hint_source = 'train'"):
        task.hinted_examples(0.5, source="beyond")
    with pytest.raises(ValueError, match="hint source must be one of"):
        _task().hinted_examples(0.5, source="nearby")  # type: ignore[arg-type]


def test_the_run_trains_on_the_beyond_hints_in_both_channels() -> None:
    """`task.hint_source = "beyond"` reaches the replica's dataset (channels 1 and 2) and the
    oracle's traces (channel 3), and the config refuses an unknown source by name."""
    pytest.importorskip("datasets")
    from composer_replication.assembly.build import build_teachers, hint_template, train_split

    config = load_config(
        overrides=["task.hint_share=0.25", "task.hint_source=beyond", "backend.n_replicas=1"]
    )
    task = get_task("arithmetic", seed=0, n_train=700, n_eval=256, num_operands=3)
    hinted = task.hinted_examples(0.25, template=hint_template(config), source="beyond")
    data = train_split(config, task, 0)
    prompts = {chat_prompt(h.prompt)[-1]["content"] for h in hinted}
    assert prompts <= {row[-1]["content"] for row in data["prompt"]}
    (oracle,) = build_teachers(config, task)
    answers = oracle.complete([chat_prompt(h.prompt) for h in hinted[:8]])
    assert [a.text for a in answers] == [h.answer for h in hinted[:8]]
    with pytest.raises(ConfigError, match="task.hint_source"):
        load_config(overrides=["task.hint_source=nearby"])


def test_both_sources_give_the_training_prompts_hints_then_as_many_beyond_reach() -> None:
    task = _task()
    n = math.ceil(0.5 * len({ex.prompt for ex in task.train_examples()}))
    both = task.hinted_examples(0.5, source="both")
    assert [h.id for h in both] == [
        h.id for h in (*task.hinted_examples(0.5), *task.hinted_examples(0.5, source="beyond"))
    ]
    assert len(both) == 2 * n


def test_the_run_writes_channel_2s_hints_and_its_hinted_examples_with_one_template() -> None:
    """`task.hint_feedback_with_solution = false`: the trainer's hint template shows the solution
    alone (the SDPO reference runs' setting), and the hinted examples the run trains on are
    written the same way, so the policy practises exactly what its teacher reads."""
    pytest.importorskip("datasets")
    from composer_replication.assembly.build import hint_template, train_split

    for shown_with_feedback in (True, False):
        config = load_config(
            overrides=[
                "task.hint_share=0.5",
                "task.hint_source=train",
                f"task.hint_feedback_with_solution={str(shown_with_feedback).lower()}",
                "backend.n_replicas=1",
            ]
        )
        template = hint_template(config)
        assert isinstance(template, HintTemplate)
        assert template.feedback_with_solution is shown_with_feedback
        texts = [row[-1]["content"] for row in train_split(config, _task(), 0)["prompt"]]
        with_solution = [t for t in texts if "Correct solution" in t]
        assert with_solution
        assert any("earlier attempt" in t for t in with_solution) is shown_with_feedback
    with pytest.raises(ConfigError, match="task.hint_feedback_with_solution"):
        load_config(overrides=["task.hint_feedback_with_solution=maybe"])


def test_strings_beyond_problems_are_longer_than_the_ood_split_and_in_no_split() -> None:
    task = get_task("strings", seed=0, n_train=50, n_eval=10)
    beyond = task.beyond_examples(50)
    seen = (*task.train_examples(), *task.eval_examples(), *task.ood_examples(50))
    assert not {task.canonical(ex) for ex in beyond} & {task.canonical(ex) for ex in seen}
    assert all(task.verify(ex, task.oracle(ex)).correct for ex in beyond)
    longest_ood = max(len(str(ex.meta["input"])) for ex in task.ood_examples(50))
    assert min(len(str(ex.meta["input"])) for ex in beyond) > longest_ood


def test_the_token_claim_bound_covers_the_hinted_prompts() -> None:
    """The exchange's screening bounds a replica's token claim by the longest prompt it can
    train on: a hinted example is longer than any plain prompt, so the bound must count it (an
    honest replica was screened out when it did not)."""
    pytest.importorskip("transformers")
    from composer_replication.assembly.build import build_model, hint_template
    from composer_replication.assembly.screening import max_tokens_per_step

    config = load_config(overrides=["task.hint_share=0.25", "backend.n_replicas=1"])
    task = _task()
    _, tok = build_model(config)
    hinted = task.hinted_examples(0.25, template=hint_template(config))

    def length(prompt: str) -> int:
        ids = tok.apply_chat_template(
            chat_prompt(prompt), tokenize=True, add_generation_prompt=True
        )
        return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    longest = max(length(h.prompt) for h in hinted)
    assert longest > max(length(ex.prompt) for ex in task.train_examples())
    t = config.train
    bound = max_tokens_per_step(config, task, tok)
    assert bound == t.batch_size * t.gradient_accumulation_steps * (
        longest + t.max_completion_length
    )
    plain = load_config(overrides=["task.hint_share=0", "backend.n_replicas=1"])
    assert max_tokens_per_step(plain, task, tok) < bound
