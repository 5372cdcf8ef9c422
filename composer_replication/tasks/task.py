"""The task contract: `Example`, `Verdict` and the `Task` base class every built-in task extends.

A task is a deterministic generator of prompts with reference answers plus a verifier. The base class
owns everything that is the same for every task:

* the **fixed-seed split** (`train_examples` / `eval_examples`): problems are drawn from
  `random.Random(f"{name}:{seed}")` (a string seed is hashed with SHA-512, so the split is identical
  in every process regardless of `PYTHONHASHSEED`). The split is by **equivalence class**: prompts
  that are the same problem in another form (`canonical`: `3+4+5=` and `5+3+4=` share the operand
  multiset, hence the answer) are never on both sides, so a held-out prompt is new to the policy,
  not a reordering of a training prompt. The eval set is drawn first: each draw of a new class
  holds the class out whole (`_equivalents`: every member the task can list, the drawn prompt
  first; the last class is cut at `n_eval`), so the eval set holds `n_eval` distinct prompts and
  every prompt has the same chance of being held out; its order is then shuffled, so that any
  first k of them span many classes. The train set holds prompts of the other classes only.
  When a task's problem space is smaller than `n_train + n_eval` distinct prompts (the "easy"
  levels are deliberately tiny), the train set cycles through the remaining prompts, so train
  may repeat a prompt but never shares a class with eval;
* a **validation view** (`validation_view`): whole classes of the training split carved out as
  the view's eval set, for choosing hyperparameters without touching the held-out prompts;
* an optional **out-of-distribution split** (`ood_examples`): problems outside the training
  distribution (arithmetic: one more operand; strings: longer inputs), reported beside the
  held-out figure to show how far the learning reaches (a figure, not a target);
* the TRL glue: `to_dataset`, `reward_func` (per completion a `(score, feedback)` tuple, see
  `docs/trainer.md`), `oracle_traces` (trace records for channel 3).

Subclasses implement `_sample(rng)` (one random problem) and `verify(example, completion)`.

Completions are matched after `clean_completion`: text after the first `<|im_end|>` /
`<|endoftext|>` is dropped, any remaining `<|...|>` special tokens are removed and surrounding
whitespace is stripped.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypeAlias, get_args, overload

from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    from datasets import Dataset

    from composer_replication.data.hints import HintTemplate
    from composer_replication.data.traces import TraceJson

# Generation may run past the end of turn (no stop string), and decoders that keep special tokens
# leave them in the text; everything after the first end marker is not part of the answer.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>]{1,40}\|>")
_ANSWER_PREFIX = re.compile(r"^\s*(?:the\s+)?answer\s*(?:is|:)\s*", re.IGNORECASE)

# How many consecutive duplicate draws mean "the problem space is exhausted". Draws are cheap, and
# for a space of N problems the chance that a new problem survives this many misses is negligible.
_MAX_MISSES = 2000

# One problem as a task draws it: (prompt, reference answer, JSON-serialisable meta).
Problem = tuple[str, str, JSONDict]
# The hints `Task.hinted_examples` cycles through, as (with the solution, with feedback): what
# channel 2's teacher is shown for a failed rollout (`data.hints.plan_hints`).
HINT_KINDS: tuple[tuple[bool, bool], ...] = ((True, False), (True, True), (False, True))
# Which problems `Task.hinted_examples` writes hints for: "train", copies of training prompts (the
# hint is redundant for any prompt the policy can already solve); "beyond", problems past the
# policy's reach and in no evaluated split (`beyond_examples`), which only the hint solves;
# "both", as many of each.
HintSource = Literal["train", "beyond", "both"]
HINT_SOURCES: tuple[HintSource, ...] = get_args(HintSource)

Scored = tuple[float, str | None]  # one completion's (reward, feedback), as reward_func returns


@dataclass(frozen=True)
class Example:
    """One problem. `prompt` is the user message text; `meta` is JSON-serialisable."""

    id: str
    prompt: str
    answer: str
    meta: JSONDict = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of one completion.

    `reward` is the shaped reward in [0, 1] (partial credit for well-formed or close answers);
    `correct` is exact correctness; `feedback` is None exactly when `correct` is True, otherwise a
    message an environment would give (what was wrong, what form was expected).
    """

    reward: float
    correct: bool
    feedback: str | None

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")
        if self.correct and self.feedback is not None:
            raise ValueError("a correct verdict carries no feedback (feedback must be None)")
        if not self.correct and not self.feedback:
            raise ValueError("an incorrect verdict must say what was wrong (feedback is empty)")


def clean_completion(text: str) -> str:
    """The answer part of a raw completion: cut at the first end marker, drop special tokens."""
    for marker in _END_MARKERS:
        cut = text.find(marker)
        if cut != -1:
            text = text[:cut]
    return _SPECIAL_TOKEN.sub("", text).strip()


class TokenDecoder(Protocol):
    """What `decode_completion` asks of a tokenizer (a `PreTrainedTokenizerBase`)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


# One TRL prompt or completion: a string, or a chat (a list of messages, the reply last).
Completion: TypeAlias = str | Sequence[Mapping[str, JSONValue]]


def decode_completion(
    tokenizer: TokenDecoder, ids: Sequence[int], stop_ids: Collection[int] = ()
) -> str:
    """The text the verifier judges for one completion's token ids, in training and evaluation
    alike: the ids up to and including the first stop token (`stop_ids`: the model's
    `generation_config.eos_token_id`, `data.turns.stop_token_ids`), decoded with special tokens
    KEPT, so that `clean_completion` cuts at the end marker where the model put it (decoding
    without special tokens, as TRL does for its rewards, deletes the marker and joins the text
    after it to the answer)."""
    row = [int(t) for t in ids]
    stops = set(stop_ids)
    for i, token in enumerate(row):
        if token in stops:
            row = row[: i + 1]
            break
    return str(tokenizer.decode(row, skip_special_tokens=False))


def strip_answer_prefix(text: str) -> str:
    """Drop a leading "Answer:" / "The answer is" (case-insensitive); models often add one."""
    return _ANSWER_PREFIX.sub("", text, count=1).strip()


def completion_text(completion: Completion) -> str:
    """The text of one TRL completion: a string, or a chat list whose last message is the reply."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, Sequence) and not completion:
        return ""
    raise ValueError(
        f"completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def chat_prompt(prompt: str) -> list[dict[str, str]]:
    """The conversational prompt TRL expects for one user message."""
    return [{"role": "user", "content": prompt}]


def brevity(text: str, reference: str) -> float:
    """`1 / (1 + extra / 8)`, extra = characters of text beyond the reference's length: the
    factor the tasks' shaped rewards use so that padding a malformed answer never pays."""
    return 1.0 / (1.0 + max(0, len(text) - len(reference)) / 8)


def shorten(text: str, limit: int = 40) -> str:
    """`repr` of text, cut to `limit` characters, for feedback messages."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class Task(ABC):
    """Base class of the built-in tasks (see the module docstring for the split rules).

    Args:
        seed: seeds the split; the same seed gives the same examples in every process.
        n_train: number of training examples (>= 1).
        n_eval: number of distinct evaluation prompts (>= 0), disjoint from the training prompts.
    """

    name: ClassVar[str]

    def __init__(self, *, seed: int = 0, n_train: int = 256, n_eval: int = 64) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(n_train, int) or n_train < 1:
            raise ValueError(f"n_train must be an int >= 1, got {n_train!r}")
        if not isinstance(n_eval, int) or n_eval < 0:
            raise ValueError(f"n_eval must be an int >= 0, got {n_eval!r}")
        self.seed = seed
        self.n_train = n_train
        self.n_eval = n_eval
        self._split: tuple[list[Example], list[Example]] | None = None
        self._index: dict[str, Example] | None = None

    # ---- to implement -------------------------------------------------------------------------

    @abstractmethod
    def _sample(self, rng: random.Random) -> Problem:
        """One random problem as (prompt, reference answer, JSON-serialisable meta)."""

    def _canonical(self, problem: Problem) -> str:
        """The problem's equivalence class: problems with the same key are one problem in
        another form (same answer by construction), and the split never puts two of them on
        different sides. Default: the prompt itself (every prompt its own class)."""
        return problem[0]

    def _equivalents(self, problem: Problem) -> list[Problem]:
        """The members of the problem's class that the held-out set takes with it, the problem
        first. Default: the problem alone (the rest of its class, if any, is still kept out of
        training by `_canonical`)."""
        return [problem]

    def _sample_ood(self, rng: random.Random) -> Problem | None:
        """One out-of-distribution problem (see `ood_examples`), or None when the task has no
        such split (the default)."""
        return None

    def _sample_beyond(self, rng: random.Random) -> Problem | None:
        """One problem further from training than the out-of-distribution split (see
        `beyond_examples`), or None when the task has none (the default)."""
        return None

    @abstractmethod
    def verify(self, example: Example, completion: str) -> Verdict:
        """Judge one raw completion (text) for `example`."""

    def check_ready(self) -> None:
        """Checks that need the outside world (a task served by another process must be
        reachable), run once by the run's preflight before any replica starts. Raises
        ConnectionError (cannot reach it), ValueError (it answers, but not as the options say) or
        ImportError (a missing extra), each naming what to do. The built-in tasks need nothing."""
        return None

    def close(self) -> None:
        """Release what the task holds open (a session, a container); it reopens on next use.
        The built-in tasks hold nothing."""
        return None

    def oracle(self, example: Example) -> str:
        """A reference completion (replayed by channel 3 when there is no teacher endpoint)."""
        return example.answer

    def verify_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[Verdict]:
        """Verify a batch; tasks with expensive verifiers override this to work in parallel."""
        return [self.verify(ex, c) for ex, c in zip(examples, completions, strict=True)]

    def _wrong_answers(self, example: Example) -> list[str]:
        """Typical wrong completions whose feedback goes into `text_corpus`: the empty answer and
        the reference with its last character doubled. Tasks with an expensive verifier override
        this to keep the corpus cheap."""
        answer = self.oracle(example)
        return ["", answer + answer[-1:]]

    def failed_attempt(self, example: Example, k: int = 0) -> str:
        """The `k`-th of a few wrong completions a learning policy might give for `example`,
        none of which carries the answer (the feedback on it goes into a hinted example, and a
        feedback that spells the answer teaches the teacher to read a leak channel 2 never
        shows). By default the typical wrong answers (`_wrong_answers`) that do not contain the
        reference, else the empty answer; tasks with a natural neighbourhood of wrong answers
        override it."""
        answer = self.oracle(example)
        wrong = [w for w in self._wrong_answers(example) if not answer or answer not in w]
        return (wrong or [""])[k % max(len(wrong), 1)]

    def text_corpus(self, split: str = "train") -> list[str]:
        """The task's own text, to train a tokenizer on (`models.build_bpe_tokenizer`).

        For each distinct prompt of `split`, in split order: the prompt, its oracle solution, the
        feedback of typical wrong answers and the channel-2 hinted prompt built from them with
        the default `HintTemplate` (what the teacher reads). A run trains its tokenizer on the
        TRAIN split only, so nothing of the held-out prompts or answers reaches the vocabulary.
        """
        from composer_replication.data.hints import HintTemplate

        template = HintTemplate()
        texts: list[str] = []
        seen: set[str] = set()
        for ex in self.examples(split):
            if ex.prompt in seen:
                continue
            seen.add(ex.prompt)
            solution = self.oracle(ex)
            texts += [ex.prompt, solution]
            for wrong in self._wrong_answers(ex):
                feedback = self.verify(ex, wrong).feedback
                if feedback:
                    texts += [feedback, template.render_text(ex.prompt, solution, feedback)]
        return texts

    # ---- split --------------------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        """The training examples (fixed by `seed`), `n_train` of them."""
        return list(self._build_split()[0])

    def eval_examples(self) -> list[Example]:
        """The evaluation examples (fixed by `seed`): `n_eval` distinct prompts unseen in train."""
        return list(self._build_split()[1])

    def examples(self, split: str) -> list[Example]:
        """`train_examples()` or `eval_examples()` by name."""
        if split == "train":
            return self.train_examples()
        if split == "eval":
            return self.eval_examples()
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

    def canonical(self, example: Example) -> str:
        """The example's equivalence class (see the module docstring): held-out and training
        examples never share one."""
        return self._canonical((example.prompt, example.answer, example.meta))

    def has_ood(self) -> bool:
        """Whether the task has an out-of-distribution split (`ood_examples`)."""
        return self._sample_ood(random.Random(f"{self.name}:{self.seed}:ood")) is not None

    def ood_examples(self, n: int) -> list[Example]:
        """`n` distinct out-of-distribution problems (fixed by `seed`; fewer only when that
        space holds fewer): outside the training distribution by construction (arithmetic: one
        more operand than training; strings: inputs longer than any training input), so none
        shares a class with training. A figure beside the held-out accuracy, not a target.
        ValueError if the task has no such split."""
        return self._distinct_draws(
            "ood", self._sample_ood, n, "out-of-distribution split (has_ood() is False)"
        )

    def has_beyond(self) -> bool:
        """Whether the task can draw problems beyond the policy's reach (`beyond_examples`)."""
        return self._sample_beyond(random.Random(f"{self.name}:{self.seed}:beyond")) is not None

    def beyond_examples(self, n: int) -> list[Example]:
        """`n` distinct problems further from training than the out-of-distribution split
        (fixed by `seed`; arithmetic: two more operands than training; strings: inputs 3-4
        characters longer than any training input), so none shares a class with the training,
        held-out or out-of-distribution prompts. They exist to be shown WITH the hint
        (`hinted_examples(source="beyond")`): a policy that cannot solve them from the question
        earns their reward only by reading the solution in its context, which is the skill
        channel 2's teacher needs. ValueError if the task has none (`has_beyond()` is False)."""
        return self._distinct_draws(
            "beyond", self._sample_beyond, n, "problems beyond training (has_beyond() is False)"
        )

    def _distinct_draws(
        self,
        split: str,
        sample: Callable[[random.Random], Problem | None],
        n: int,
        what: str,
    ) -> list[Example]:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        rng = random.Random(f"{self.name}:{self.seed}:{split}")
        drawn: dict[str, Problem] = {}
        misses = 0
        while len(drawn) < n and misses < _MAX_MISSES:
            problem = sample(rng)
            if problem is None:
                raise ValueError(f"task {self.name!r} has no {what}")
            if problem[0] in drawn:
                misses += 1
                continue
            misses = 0
            drawn[problem[0]] = problem
        return [self._example(split, i, p) for i, p in enumerate(drawn.values())]

    def validation_view(self, n_val: int) -> Task:
        """A copy of this task whose eval split is a **validation split carved from training**:
        whole equivalence classes of the training split (chosen by `seed`), at least `n_val`
        distinct prompts, and whose training split is the rest (in order, repeats kept). For
        choosing hyperparameters without looking at the held-out prompts, which the view never
        contains. ValueError if carving `n_val` prompts would leave no training class."""
        import copy

        if not isinstance(n_val, int) or n_val < 1:
            raise ValueError(f"n_val must be an int >= 1, got {n_val!r}")
        train, _ = self._build_split()
        classes: dict[str, list[Example]] = {}
        for ex in train:
            classes.setdefault(self.canonical(ex), []).append(ex)
        order = list(classes)
        random.Random(f"{self.name}:{self.seed}:validation").shuffle(order)
        held: set[str] = set()
        val_prompts: dict[str, Example] = {}
        for key in order:
            if len(val_prompts) >= n_val:
                break
            held.add(key)
            for ex in classes[key]:
                val_prompts.setdefault(ex.prompt, ex)
        rest = [ex for ex in train if self.canonical(ex) not in held]
        if len(val_prompts) < n_val or not rest:
            raise ValueError(
                f"task {self.name!r}: the training split has {len(classes)} classes "
                f"({len({ex.prompt for ex in train})} distinct prompts); carving {n_val} "
                "validation prompts from it leaves none to train on: lower n_val or raise n_train"
            )
        view = copy.copy(self)
        view._split = (
            [
                Example(ex.id.replace("/train/", "/trainval/", 1), ex.prompt, ex.answer, ex.meta)
                for ex in rest
            ],
            [
                Example(ex.id.replace("/train/", "/val/", 1), ex.prompt, ex.answer, ex.meta)
                for ex in val_prompts.values()
            ],
        )
        view._index = None
        return view

    def get_example(self, example_id: str) -> Example:
        """The example with this id (from either split); KeyError if there is none."""
        if self._index is None:
            train, evals = self._build_split()
            self._index = {ex.id: ex for ex in (*train, *evals)}
        return self._index[example_id]

    def _draw_held_out(self, rng: random.Random) -> tuple[list[Problem], set[str]]:
        """The eval problems, whole classes at a time, and the held-out class keys."""
        drawn: dict[str, Problem] = {}
        held: set[str] = set()
        misses = 0
        while len(drawn) < self.n_eval and misses < _MAX_MISSES:
            problem = self._sample(rng)
            key = self._canonical(problem)
            if key in held:
                misses += 1
                continue
            misses = 0
            held.add(key)
            for member in self._equivalents(problem):
                if len(drawn) >= self.n_eval:
                    break
                drawn.setdefault(member[0], member)
        return list(drawn.values()), held

    def _draw_train(self, rng: random.Random, held: set[str]) -> list[Problem]:
        drawn: dict[str, Problem] = {}
        misses = 0
        while len(drawn) < self.n_train and misses < _MAX_MISSES:
            problem = self._sample(rng)
            if problem[0] in drawn or self._canonical(problem) in held:
                misses += 1
                continue
            misses = 0
            drawn[problem[0]] = problem
        return list(drawn.values())

    def _build_split(self) -> tuple[list[Example], list[Example]]:
        if self._split is not None:
            return self._split
        rng = random.Random(f"{self.name}:{self.seed}")
        evals, held = self._draw_held_out(rng)
        if len(evals) < self.n_eval:
            raise ValueError(
                f"task {self.name!r} with these options has only {len(evals)} distinct problems, "
                f"fewer than n_eval={self.n_eval}; lower n_eval or choose a harder level"
            )
        # Whole classes are drawn together; the eval order is shuffled (by its own stream, so
        # the train draw is unchanged) so that the first k held-out prompts (a run evaluates
        # `eval_max_examples` of them, the loss screen `screen_examples`) span many classes.
        random.Random(f"{self.name}:{self.seed}:eval-order").shuffle(evals)
        pool = self._draw_train(rng, held)
        if not pool:
            raise ValueError(
                f"task {self.name!r}: n_eval={self.n_eval} holds out every class of problems at "
                "these options, leaving none for training; lower n_eval or choose a harder level"
            )
        train = list(pool)
        while len(train) < self.n_train:
            # A small space is cycled in a fresh shuffled order each pass (see module docstring).
            cycle = list(pool)
            rng.shuffle(cycle)
            train.extend(cycle[: self.n_train - len(train)])
        self._split = (
            [self._example("train", i, p) for i, p in enumerate(train)],
            [self._example("eval", i, p) for i, p in enumerate(evals)],
        )
        return self._split

    def _example(self, split: str, i: int, problem: Problem) -> Example:
        prompt, answer, meta = problem
        # The prompt's digest makes ids from another seed or other options never collide with
        # ours, so reward_func cannot silently verify against the wrong example.
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
        return Example(
            id=f"{self.name}/{split}/{i}/{digest}", prompt=prompt, answer=answer, meta=meta
        )

    # ---- TRL glue -----------------------------------------------------------------------------

    def hinted_examples(
        self,
        share: float,
        examples: Sequence[Example] | None = None,
        template: HintTemplate | None = None,
        *,
        source: HintSource = "train",
    ) -> list[Example]:
        """Hinted examples, `ceil(share * n)` of them for the `n` distinct prompts of `examples`
        (default: the training split): each prompt as channel 2's teacher reads it, with the
        same answer. Trained on beside the plain prompts (`to_dataset`, `oracle_traces` with
        `hint_share`, a benchmark's warm start), they teach the policy to read the hint its
        channel-2 teacher is shown; the held-out prompts are never among them.

        `source="train"`: the first distinct prompts of `examples`, the hints cycling through
        the kinds channel 2 shows: the correct solution alone; the solution and the feedback on
        a wrong attempt (`failed_attempt`: a failed rollout whose sibling succeeded); the
        feedback alone (no sibling succeeded). For a prompt the policy can already solve the
        hint is redundant, so these teach little reading.
        `source="beyond"`: problems past the policy's reach (`beyond_examples`, none in any
        evaluated split), with the two kinds that carry the solution: only reading the hint
        earns their reward, so the policy learns to copy a shown solution.
        `source="both"`: both lists (`ceil(share * n)` each), the training prompts' first: under
        supervised training the copying learnt on the problems beyond reach carries over to the
        training prompts' hinted form, which the beyond problems alone do not reach, but in the
        demo's RL run they collapsed its held-out accuracy (docs/benchmarks-notebook.md, "A
        hint teacher better than its student, on the demo").

        `template` writes the hints (default `HintTemplate()`; with
        `feedback_with_solution=False` the second kind shows the solution alone, as channel 2
        then does; with `feedback_alone=False` the feedback-alone kind is left out, as channel 2
        then gives no such hint)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"hint_share must be in [0, 1], got {share!r}")
        if source not in HINT_SOURCES:
            raise ValueError(f"hint source must be one of {list(HINT_SOURCES)}, got {source!r}")
        if share == 0.0:
            return []
        from composer_replication.data.hints import HintTemplate

        template = template or HintTemplate()
        pool = self.train_examples() if examples is None else examples
        distinct = list({ex.prompt: ex for ex in pool}.values())
        count = math.ceil(share * len(distinct))
        jobs: list[tuple[list[Example], list[tuple[bool, bool]]]] = []
        if source in ("train", "both"):
            kinds = [k for k in HINT_KINDS if k[0] or template.feedback_alone]
            jobs.append((distinct[:count], kinds))
        if source in ("beyond", "both"):
            if not self.has_beyond():
                raise ValueError(
                    f"task {self.name!r} has no problems beyond training for "
                    f"task.hint_source = {source!r}; use hint_source = 'train'"
                )
            jobs.append((self.beyond_examples(count), [k for k in HINT_KINDS if k[0]]))
        out = []
        for hinted, kinds in jobs:
            for i, ex in enumerate(hinted):
                with_solution, with_feedback = kinds[i % len(kinds)]
                solution = self.oracle(ex) if with_solution else None
                feedback = None
                if with_feedback:
                    attempt = self.failed_attempt(ex, i // len(kinds))
                    feedback = self.verify(ex, attempt).feedback
                text = template.render_text(ex.prompt, solution, feedback)
                out.append(
                    Example(id=f"{ex.id}/hinted", prompt=text, answer=ex.answer, meta=ex.meta)
                )
        return out

    def to_dataset(
        self,
        split: str = "train",
        *,
        hint_share: float = 0.0,
        hint_source: HintSource = "train",
        hint_template: HintTemplate | None = None,
    ) -> Dataset:
        """A `datasets.Dataset` for TRL with columns `prompt` (chat format), `example_id`,
        `answer`, `task_meta` (the example's meta as a JSON string, so `reward_func` can verify
        rows whose id this task instance does not know) and `hinted_example`
        (`data.HINTED_EXAMPLE_COLUMN`: true on a hinted example, which the trainer's `hint_grpo`
        reads). With `hint_share` > 0 (train split only) the `hinted_examples` (from
        `hint_source`, written by `hint_template`) follow the split's examples."""
        try:
            import datasets
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "Task.to_dataset needs `datasets`; install it with "
                "`pip install composer-replication[train]`."
            ) from exc
        from composer_replication.data.hints import HINTED_EXAMPLE_COLUMN

        examples = self._with_hints(split, hint_share, hint_source, hint_template)
        plain = len(self.examples(split))
        rows = [
            {
                "prompt": chat_prompt(ex.prompt),
                "example_id": ex.id,
                "answer": ex.answer,
                "task_meta": json.dumps(ex.meta, sort_keys=True),
                HINTED_EXAMPLE_COLUMN: i >= plain,
            }
            for i, ex in enumerate(examples)
        ]
        return datasets.Dataset.from_list(rows)

    def _with_hints(
        self,
        split: str,
        hint_share: float,
        hint_source: HintSource = "train",
        template: HintTemplate | None = None,
    ) -> list[Example]:
        if hint_share and split != "train":
            raise ValueError(f"hint_share applies to the train split only, got split {split!r}")
        hinted = self.hinted_examples(hint_share, template=template, source=hint_source)
        return [*self.examples(split), *hinted]

    def _lookup(
        self,
        i: int,
        prompt: Completion | None,
        example_id: Sequence[str] | None,
        answer: Sequence[str] | None,
        task_meta: Sequence[str] | None,
    ) -> Example:
        if example_id is not None:
            try:
                example = self.get_example(example_id[i])
            except KeyError:
                example = None
            if example is not None and (answer is None or answer[i] == example.answer):
                return example
        if answer is None:
            raise ValueError(
                f"{self.name}_reward: cannot find the example for completion {i}: pass the "
                "`example_id` column (from Task.to_dataset) or `answer` (+ `task_meta`) columns"
            )
        meta = json.loads(task_meta[i]) if task_meta is not None else {}
        text = completion_text(prompt) if prompt is not None else ""
        eid = example_id[i] if example_id is not None else f"{self.name}/external/{i}"
        return Example(id=eid, prompt=text, answer=answer[i], meta=meta)

    @overload
    def reward_func(
        self,
        with_feedback: Literal[True] = True,
        *,
        tokenizer: TokenDecoder | None = None,
        stop_ids: Collection[int] = (),
    ) -> Callable[..., list[Scored]]: ...
    @overload
    def reward_func(
        self,
        with_feedback: Literal[False],
        *,
        tokenizer: TokenDecoder | None = None,
        stop_ids: Collection[int] = (),
    ) -> Callable[..., list[float]]: ...
    @overload
    def reward_func(
        self,
        with_feedback: bool,
        *,
        tokenizer: TokenDecoder | None = None,
        stop_ids: Collection[int] = (),
    ) -> Callable[..., list[Scored] | list[float]]: ...
    def reward_func(
        self,
        with_feedback: bool = True,
        *,
        tokenizer: TokenDecoder | None = None,
        stop_ids: Collection[int] = (),
    ) -> Callable[..., list[Scored] | list[float]]:
        """A TRL reward function named `f"{name}_reward"`.

        Called as `f(prompts=..., completions=..., example_id=..., **other_columns)`, it returns
        per completion a `(score, feedback)` tuple (the feedback contract of
        `ComposerReplicationTrainer`), or plain float scores with `with_feedback=False` for a
        stock TRL trainer. The example is looked up by `example_id`; rows with an unknown id are
        rebuilt from the `answer` and `task_meta` columns.

        With `tokenizer` (and the model's `stop_ids`), a completion that comes with its token ids
        (TRL passes `completion_ids`) is judged on `decode_completion(tokenizer, ids, stop_ids)`:
        the same text evaluation judges, end markers kept, instead of TRL's decode without
        special tokens. Every trainer of this package passes it; without it the text given is
        judged as it is.
        """

        def reward(
            prompts: Sequence[Completion] | None = None,
            completions: Sequence[Completion] | None = None,
            example_id: Sequence[str] | None = None,
            answer: Sequence[str] | None = None,
            task_meta: Sequence[str] | None = None,
            completion_ids: Sequence[Sequence[int]] | None = None,
            **_: object,
        ) -> list[Scored] | list[float]:
            if completions is None:
                raise ValueError(f"{self.name}_reward needs the `completions` argument")
            examples = [
                self._lookup(
                    i, prompts[i] if prompts is not None else None, example_id, answer, task_meta
                )
                for i in range(len(completions))
            ]
            if tokenizer is not None and completion_ids is not None:
                if len(completion_ids) != len(completions):
                    raise ValueError(
                        f"{self.name}_reward: {len(completion_ids)} completion_ids for "
                        f"{len(completions)} completions"
                    )
                texts = [decode_completion(tokenizer, ids, stop_ids) for ids in completion_ids]
            else:
                texts = [completion_text(c) for c in completions]
            verdicts = self.verify_many(examples, texts)
            if with_feedback:
                return [(v.reward, v.feedback) for v in verdicts]
            return [v.reward for v in verdicts]

        reward.__name__ = reward.__qualname__ = f"{self.name}_reward"
        return reward

    def oracle_traces(
        self,
        split: str = "train",
        *,
        hint_share: float = 0.0,
        hint_source: HintSource = "train",
        hint_template: HintTemplate | None = None,
    ) -> Iterator[TraceJson]:
        """One trace record per distinct prompt of `split` (and of its `hinted_examples` with
        `hint_share` and `hint_source`), in the trace JSONL format of
        `composer_replication.data.traces` (teacher "oracle", reward 1.0)."""
        from composer_replication.data.traces import prompt_key  # the trainer's data layer

        seen: dict[str, None] = {}
        for ex in self._with_hints(split, hint_share, hint_source, hint_template):
            if ex.prompt in seen:
                continue
            seen[ex.prompt] = None
            yield {
                "prompt": chat_prompt(ex.prompt),
                "prompt_key": prompt_key(chat_prompt(ex.prompt)),
                "teacher": "oracle",
                "completion": self.oracle(ex),
                "reward": 1.0,
                "metadata": {"task": self.name, "example_id": ex.id, "split": split},
            }
