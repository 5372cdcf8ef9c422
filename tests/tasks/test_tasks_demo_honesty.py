"""The embedded default's held-out accuracy is honest: held-out prompts never reach training.

Three ways a held-out prompt or its answer could leak, each checked on the default run's task:
the split itself, channel 3's oracle teacher, and the BPE tokenizer's training text.
"""

from __future__ import annotations

import tempfile

import pytest

from composer_replication.assembly.build import build_task, build_teachers
from composer_replication.config import load_config
from composer_replication.data.traces import prompt_key
from composer_replication.tasks.task import chat_prompt


@pytest.fixture(scope="module")
def default_task():  # type: ignore[no-untyped-def]
    return build_task(load_config())


def test_default_held_out_prompts_are_many_distinct_and_never_trained_on(default_task) -> None:  # type: ignore[no-untyped-def]
    config = load_config()
    train = default_task.train_examples()
    held_out = default_task.eval_examples()
    assert len(held_out) == config.task.n_eval >= 200
    # Evaluation uses all of them (the run evaluates at most eval_max_examples).
    assert config.train.eval_max_examples >= config.task.n_eval
    assert len({ex.prompt for ex in held_out}) == len(held_out)
    assert not {ex.prompt for ex in held_out} & {ex.prompt for ex in train}


def test_oracle_teacher_answers_training_prompts_only(default_task) -> None:  # type: ignore[no-untyped-def]
    (oracle,) = build_teachers(load_config(), default_task)
    train = default_task.train_examples()[:50]
    held_out = default_task.eval_examples()
    answers = oracle.complete([chat_prompt(ex.prompt) for ex in train])
    assert [a.text for a in answers] == [default_task.oracle(ex) for ex in train]
    assert all(a.text == "" for a in oracle.complete([chat_prompt(ex.prompt) for ex in held_out]))


def test_tokenizer_text_holds_no_held_out_prompt(default_task) -> None:  # type: ignore[no-untyped-def]
    corpus = default_task.text_corpus("train")
    held_out = {ex.prompt for ex in default_task.eval_examples()}
    # Prompts appear alone and at the start of hinted texts ("12+3=\nCorrect solution: ...").
    firsts = {text.split("\n", 1)[0] for text in corpus}
    assert not held_out & (set(corpus) | firsts)
    assert {ex.prompt for ex in default_task.train_examples()} <= set(corpus)


def test_channel3_traces_of_a_default_run_cover_training_prompts_only(default_task) -> None:  # type: ignore[no-untyped-def]
    """A few real steps of the default run's trainer: every trace the lazy teacher pool recorded
    is for a training prompt, or one of the run's hinted examples (`task.hint_share`: training
    prompts with the hint), never a held-out one."""
    from composer_replication.assembly.build import build_model, build_trainer, hint_template

    config = load_config(
        overrides=["train.max_steps=3", "diloco.sync_every_h=3", "task.hint_share=0.25"]
    )
    model, tok = build_model(config)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(
            config,
            model=model,
            tokenizer=tok,
            task=default_task,
            max_steps=3,
            seed=0,
            output_dir=scratch,
        )
        trainer.train()
    keys = trainer.trace_store.prompt_keys
    hinted = default_task.hinted_examples(
        config.task.hint_share, template=hint_template(config), source=config.task.hint_source
    )
    assert hinted
    train_keys = {
        prompt_key(chat_prompt(ex.prompt)) for ex in (*default_task.train_examples(), *hinted)
    }
    held_out = default_task.eval_examples()
    held_out_keys = {prompt_key(chat_prompt(ex.prompt)) for ex in held_out}
    assert keys and keys <= train_keys and not keys & held_out_keys
    held_out_prompts = {ex.prompt for ex in held_out}
    assert not any(h.prompt.split("\n")[0] in held_out_prompts for h in hinted)


def _built_trainer(config, task, max_steps, settings=None):  # type: ignore[no-untyped-def]
    """The run's trainer as `assembly.build.build_trainer` makes it (not trained)."""
    from composer_replication.assembly.build import build_model, build_trainer

    model, tok = build_model(config)
    with tempfile.TemporaryDirectory() as scratch:
        return build_trainer(
            config,
            model=model,
            tokenizer=tok,
            task=task,
            max_steps=max_steps,
            seed=0,
            output_dir=scratch,
            settings=settings,
        )


def test_settings_the_toml_has_no_key_for_reach_the_trainer(default_task) -> None:  # type: ignore[no-untyped-def]
    """`build_trainer(settings=...)`: a benchmark's composer keywords (here channel 2's hint
    template) go over the config's; the config's own keys are untouched."""
    from composer_replication.data.hints import HintTemplate

    config = load_config(overrides=["train.max_steps=3", "diloco.sync_every_h=3"])
    template = HintTemplate(feedback_with_solution=False)
    settings = {"hint_template": template, "sdpo_gate": False}
    trainer = _built_trainer(config, default_task, 3, settings)
    assert trainer.composer.hint_template is template and not trainer.composer.sdpo_gate
    assert trainer.composer.beta_replay == config.loss.beta_replay


def test_teachers_min_reward_reaches_channel_3(default_task) -> None:  # type: ignore[no-untyped-def]
    """`[teachers] min_reward`: the trainer replays only traces scored at least that."""
    config = load_config(overrides=["teachers.min_reward=0.5", "diloco.sync_every_h=200"])
    assert config.teachers.min_reward == 0.5
    assert load_config().teachers.min_reward is None
    trainer = _built_trainer(config, default_task, 1)
    assert trainer.composer.replay_min_trace_reward == 0.5
