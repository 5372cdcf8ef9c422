"""The held-out split is new to the policy: no held-out prompt is a training prompt in another
form (issue 23).

The equivalence is checked here with a reference of its own, not with the task's `canonical`:
an arithmetic prompt's *signature* is the value of its expression with every literal number v
replaced by a large pseudo-random integer h(v) and every `-` by `+N*` (N another one, so that
no two terms cancel: `6-6` and `9-9` are different problems), evaluated by Python (`*` before
`+`). Two expressions that are reorderings of each other (terms with their signs, factors within
a term) are the same polynomial in the literals, so they have the same signature; two that are
not differ with probability ~2^-60. For a sum the signature is a hash of the operand multiset.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from composer_replication.assembly.build import build_task
from composer_replication.config import load_config
from composer_replication.tasks import get_task
from composer_replication.tasks.arithmetic import LEVELS as ARITH_LEVELS
from composer_replication.tasks.strings import LEVELS as STRING_LEVELS

_H: dict[int, int] = {}


def _h(v: int) -> int:
    if v not in _H:
        _H[v] = random.Random(f"literal:{v}").getrandbits(61) | 1
    return _H[v]


def signature(prompt: str) -> int:
    """The reference class key of an arithmetic prompt (module docstring)."""
    expr = prompt.rstrip("=")
    assert re.fullmatch(r"\d+([-+*]\d+)*", expr), prompt
    hashed = re.sub(r"\d+", lambda m: str(_h(int(m.group()))), expr)
    return eval(hashed.replace("-", f"+{_h(-1)}*"))  # noqa: S307


def test_the_reference_signature_sees_reorderings_and_only_them() -> None:
    assert signature("3+4+5=") == signature("5+3+4=") == signature("4+5+3=")
    assert signature("3*4+5-2=") == signature("5-2+4*3=")
    assert signature("3+4+5=") != signature("3+4+6=")
    assert signature("7-3=") != signature("3-7=")
    assert signature("2*3+4=") != signature("2+3*4=")
    assert signature("1+1+2=") != signature("1+2+2=")
    assert signature("6-6=") != signature("9-9=")
    assert signature("5-2*3=") == signature("5-3*2=") != signature("5+2*3=")


def _assert_disjoint(task, sig) -> None:  # type: ignore[no-untyped-def]
    train, held_out = task.train_examples(), task.eval_examples()
    assert len(held_out) == task.n_eval and len({ex.prompt for ex in held_out}) == task.n_eval
    train_sigs = {sig(ex.prompt) for ex in train}
    shared = [ex.prompt for ex in held_out if sig(ex.prompt) in train_sigs]
    assert not shared, f"held-out prompts with a training prompt of the same class: {shared[:5]}"
    # the task's own key agrees with the reference
    assert not {task.canonical(ex) for ex in held_out} & {task.canonical(ex) for ex in train}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_embedded_default_holds_out_whole_operand_multisets(seed: int) -> None:
    config = load_config(overrides=[f"run.seed={seed}"])
    task = build_task(config)
    _assert_disjoint(task, signature)
    held_out = task.eval_examples()
    assert len(held_out) >= 200
    multiset = lambda ex: tuple(sorted(ex.prompt.rstrip("=").split("+")))  # noqa: E731
    # not vacuous: the training split is full of reorderings of its own prompts, and the held-out
    # classes are whole (apart from the last one drawn, cut at n_eval)
    train_classes = Counter(multiset(ex) for ex in task.train_examples())
    assert sum(n > 1 for n in train_classes.values()) > 100
    held_classes = Counter(multiset(ex) for ex in held_out)
    sizes = {m: len(set(itertools_perms(m))) for m in held_classes}
    assert sum(held_classes[m] < sizes[m] for m in held_classes) <= 1
    assert not set(held_classes) & set(train_classes)


def itertools_perms(m: tuple[str, ...]) -> list[tuple[str, ...]]:
    import itertools

    return list(itertools.permutations(m))


@pytest.mark.parametrize("level", sorted(ARITH_LEVELS))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_arithmetic_level_holds_out_whole_classes(level: str, seed: int) -> None:
    n_eval = 40 if level == "easy" else 128
    n_train = 40 if level == "easy" else 512
    task = get_task("arithmetic", level=level, seed=seed, n_train=n_train, n_eval=n_eval)
    _assert_disjoint(task, signature)


def _strings_sig(prompt: str) -> str:
    op, _, text = prompt.partition(": ")
    return f"Sort:{''.join(sorted(text))}" if op == "Sort" else prompt


@pytest.mark.parametrize("level", sorted(STRING_LEVELS))
def test_every_strings_level_holds_out_whole_classes(level: str) -> None:
    # Sort inputs with the same letters are one problem; nothing else is equivalent
    task = get_task("strings", level=level, seed=0, n_train=600, n_eval=128)
    _assert_disjoint(task, _strings_sig)


def test_a_small_space_holds_out_whole_classes_and_cycles_the_rest() -> None:
    # easy: a+b with digits, 100 prompts in 55 classes
    task = get_task("arithmetic", seed=0, n_train=50, n_eval=90)
    train, held_out = task.train_examples(), task.eval_examples()
    assert len(train) == 50 and len(held_out) == 90
    assert len({ex.prompt for ex in train}) == 10  # all that is left, repeated
    _assert_disjoint(task, signature)
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        get_task("arithmetic", n_eval=101).eval_examples()
    with pytest.raises(ValueError, match="leaving none for training"):
        get_task("arithmetic", n_eval=100).train_examples()


def test_the_validation_view_carves_whole_training_classes() -> None:
    task = build_task(load_config())
    view = task.validation_view(128)
    train, val = view.train_examples(), view.eval_examples()
    assert len({ex.prompt for ex in val}) >= 128
    assert not {signature(ex.prompt) for ex in val} & {signature(ex.prompt) for ex in train}
    # carved from training only: the held-out prompts are in neither part
    held = {signature(ex.prompt) for ex in task.eval_examples()}
    assert not held & {signature(ex.prompt) for ex in train + val}
    assert {ex.prompt for ex in train + val} == {ex.prompt for ex in task.train_examples()}
    assert view.get_example(val[0].id) == val[0] and "/val/" in val[0].id
    assert task.eval_examples() != val  # the task itself is unchanged
    assert task.validation_view(128).eval_examples() == val  # fixed by the seed
    with pytest.raises(ValueError, match="leaves none to train on"):
        task.validation_view(10_000)


def test_the_out_of_distribution_split_is_outside_training() -> None:
    task = build_task(load_config())
    ood = task.ood_examples(256)
    assert task.has_ood() and len({ex.prompt for ex in ood}) == 256
    for ex in ood:
        operands = ex.prompt.rstrip("=").split("+")
        assert len(operands) == 4 and all(0 <= int(x) <= 9 for x in operands)
        assert int(ex.answer) == sum(map(int, operands))
        assert task.verify(ex, ex.answer).correct
    assert ood == task.ood_examples(256)
    strings = get_task("strings", level="medium", n_train=20, n_eval=5)
    assert all(len(ex.meta["input"]) > strings.max_length for ex in strings.ood_examples(20))
    tiny = get_task("arithmetic", n_train=2, n_eval=2, max_operand=1)  # 8 three-operand sums
    assert sorted(ex.prompt for ex in tiny.ood_examples(50)) == sorted(
        f"{a}+{b}+{c}=" for a in (0, 1) for b in (0, 1) for c in (0, 1)
    )  # all there are, not 50
    pycode = get_task("pycode", n_train=5, n_eval=2)
    assert not pycode.has_ood()
    with pytest.raises(ValueError, match="no out-of-distribution split"):
        pycode.ood_examples(3)
