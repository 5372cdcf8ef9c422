"""Build a run's parts from its configuration: task, model, channel-3 teachers, trainer.

What one replica (run/replica.py), `bake-traces` (run/bake.py), the Monarch recipe
(recipes/monarch) and the channel ablation
(benchmarks/composer_ablation.py) build, written once:

- `build_task(config)`: the built-in task of `[task]`, split by `run.seed`.
- `build_model(config)`: `(model, tokenizer)`: the tiny Qwen2 built locally from `[model]`
  (no download), else `from_pretrained` of a hub id or a local folder, as a Hugging Face user
  loads it: `AutoModelForCausalLM` and `AutoTokenizer` (`load_tokenizer`; a checkpoint of a
  run, `runs/<run>/checkpoints/final`, comes back with the exact tokenizer it trained with).
- `build_teachers(config, task)`: the `[[teachers.endpoints]]` clients, else (with
  `teachers.oracle`) an `OracleTeacher` answering the task's TRAIN prompts with their reference
  solution (held-out prompts get no answer, so none can leak through channel 3).
- `task_verifier(task)`: `(prompt, completion) -> reward or None` for scoring teacher traces.
- `build_trainer(config, ...)`: the `ComposerReplicationTrainer` with the task's reward (with
  feedback) and train split, TRL settings from `[train]` and channel 1 of `[loss]`, the
  composer keywords from the rest of `[loss]`, and channel 3's trace store and teacher pool.

The config -> TRL translation (`trainer_args`, `composer_kwargs`) lives here, in the
composition root: the trainer knows nothing of the run configuration. Heavy libraries (torch,
transformers, TRL) are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.config import ConfigError
from composer_replication.config.schema import GENERATION_ENGINES
from composer_replication.data.turns import align_generation_stops, stop_token_ids
from composer_replication.json_types import JSONDict

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
    from trl import GRPOTrainer

    from composer_replication.config import RunConfig
    from composer_replication.data.hints import HintTemplate
    from composer_replication.data.teachers import TeacherClient, TeacherPool
    from composer_replication.data.traces import Prompt, TraceStore
    from composer_replication.tasks import Example, Task
    from composer_replication.tasks.task import Scored
    from composer_replication.trainer import ComposerConfig, ComposerReplicationTrainer

__all__ = [
    "GENERATION_ARGS",
    "VLLM_ENGINES",
    "build_model",
    "build_task",
    "build_teachers",
    "build_trainer",
    "channel1_args",
    "composer_kwargs",
    "configure_generation",
    "generation_args",
    "hint_template",
    "load_tokenizer",
    "task_index",
    "task_verifier",
    "teacher_pool",
    "train_split",
    "trainer_args",
    "trl_training_args",
]

logger = logging.getLogger(__name__)

# The generic tokenizer classes transformers writes for a tokenizer built from a `tokenizers`
# object; transformers 5 replaces them for some model types (Qwen2 among them).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

# [loss] keys that configure channel 1, which is TRL's own loss: they become TRL arguments
# (key -> GRPOConfig argument), not composer keywords.
CHANNEL1_TRL_ARGS = {
    "loss_type": "loss_type",
    "epsilon_low": "epsilon",
    "epsilon_high": "epsilon_high",
    "delta": "delta",
    "kl_beta": "beta",
}


# `[train] generation` -> the TRL GRPOConfig arguments that select that rollout engine; keyed by
# the schema's choices (config.schema.GENERATION_ENGINES). benchmarks/gpu_step.py measures them.
GENERATION_ARGS: dict[str, JSONDict] = {
    "generate": {},  # TRL's default path: model.generate on the left-padded prompt batch
    # the same generate with a static key/value cache; `configure_generation` turns transformers'
    # compiled decoding back on (TRL builds its GenerationConfig with disable_compile=True)
    "static": {"cache_implementation": "static"},
    "paged": {"use_transformers_continuous_batching": True},
    "paged_eager": {
        "use_transformers_continuous_batching": True,
        "transformers_continuous_batching_config": {"use_cuda_graph": False},
    },
    # TRL's vLLM modes (extra `vllm`: TRL's own, which pins vLLM): in the trainer's process,
    # or a `trl vllm-serve` server (TRL's vllm_server_* arguments: host 0.0.0.0, port 8000)
    "vllm": {"use_vllm": True, "vllm_mode": "colocate"},
    "vllm_server": {"use_vllm": True, "vllm_mode": "server"},
}
VLLM_ENGINES = ("vllm", "vllm_server")
if set(GENERATION_ARGS) != set(GENERATION_ENGINES):  # pragma: no cover - a programming error
    raise RuntimeError(
        f"GENERATION_ARGS {sorted(GENERATION_ARGS)} must cover config.schema.GENERATION_ENGINES "
        f"{sorted(GENERATION_ENGINES)}"
    )


def generation_args(engine: str) -> JSONDict:
    """The TRL arguments of the rollout engine `engine` (`GENERATION_ARGS`), after checking that
    what it needs is installed: the vLLM engines raise `ConfigError` naming the extra when vLLM
    is missing (TRL would fail later, inside its trainer's constructor)."""
    if engine not in GENERATION_ARGS:
        raise ConfigError(
            f"train.generation: unknown engine {engine!r}; choose one of "
            f"{', '.join(GENERATION_ARGS)}"
        )
    if engine in VLLM_ENGINES:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"train.generation = {engine!r} needs vLLM, which is not installed: "
                "pip install 'composer-replication[vllm]' (TRL's vllm extra, which pins the vLLM "
                "versions TRL 1.16 supports); or choose 'generate' or 'static'"
            )
    return dict(GENERATION_ARGS[engine])


def configure_generation(trainer: GRPOTrainer, engine: str) -> None:
    """What TRL's arguments cannot say about the engine, set on the built trainer: for
    'static', transformers' automatic compilation of the decoding forward (TRL 1.16's
    GRPOTrainer builds its GenerationConfig with ``disable_compile=True``; transformers compiles
    the forward with a static cache on a GPU). Every other engine: nothing."""
    if engine == "static":
        generation_config = getattr(trainer, "generation_config", None)
        if generation_config is not None:  # the vLLM and paged paths have none
            generation_config.disable_compile = False


def build_task(config: RunConfig) -> Task:
    """The task of `[task]` (its split is fixed by `run.seed`)."""
    from composer_replication.tasks import get_task

    return get_task(
        config.task.name,
        seed=config.run.seed,
        n_train=config.task.n_train,
        n_eval=config.task.n_eval,
        **config.task.options,
    )


def build_model(config: RunConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) for `[model]`: the tiny Qwen2 or a hub/local checkpoint."""
    m = config.model
    if m.is_tiny:
        from composer_replication.models import build_tiny_model, build_tokenizer

        if m.tokenizer == "bpe":
            from composer_replication.models import build_bpe_tokenizer

            # Trained on the TRAIN split's text only (deterministic: every replica gets the same
            # vocabulary), cached on disk.
            corpus = build_task(config).text_corpus("train")
            tok = build_bpe_tokenizer(corpus, vocab_size=m.vocab_size)
        else:
            tok = build_tokenizer()
        model = build_tiny_model(
            tok,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            seed=config.run.seed,
        )
        return model, tok
    import torch
    from transformers import AutoModelForCausalLM

    hub_tok = load_tokenizer(m.name, trust_remote_code=m.trust_remote_code)
    hub_tok.padding_side = "left"
    if hub_tok.pad_token is None:
        hub_tok.pad_token = hub_tok.eos_token
    dtype = "auto" if m.dtype == "auto" else getattr(torch, m.dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        m.name, dtype=dtype, trust_remote_code=m.trust_remote_code
    )
    # Rollouts and evaluation stop at the template's end of turn as well as EOS (data/turns.py).
    align_generation_stops(loaded, hub_tok)
    return loaded, hub_tok


def load_tokenizer(name: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(name)`, as a Hugging Face user loads a hub id or a folder.

    One exception, for local folders only: a folder whose `tokenizer_config.json` records a
    generic fast tokenizer (`TokenizersBackend` / `PreTrainedTokenizerFast`: how checkpoints of
    this project were saved before their tokenizers became `Qwen2Tokenizer`s) is loaded as that
    class, from its `tokenizer.json` as written (never a loss), with a warning: for a Qwen2 model
    `AutoTokenizer` would rebuild it as a `Qwen2Tokenizer`, which drops the spaces and newlines
    of the tiny model's old vocabulary.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    recorded = _recorded_tokenizer_class(Path(name).expanduser())
    if recorded in _GENERIC_TOKENIZER_CLASSES and type(tok).__name__ not in (
        _GENERIC_TOKENIZER_CLASSES
    ):
        from transformers import PreTrainedTokenizerFast

        logger.warning(
            "%s records tokenizer class %s, but AutoTokenizer.from_pretrained builds a %s from "
            "it (transformers overrides the class for this model type), which may encode "
            "differently; loading its tokenizer.json as written instead. Elsewhere, load it with "
            "PreTrainedTokenizerFast.from_pretrained(%r).",
            name,
            recorded,
            type(tok).__name__,
            name,
        )
        tok = PreTrainedTokenizerFast.from_pretrained(name)
    return tok


def _recorded_tokenizer_class(folder: Path) -> str | None:
    """The `tokenizer_class` a local folder's tokenizer_config.json names (None: none, or not
    a folder)."""
    try:
        recorded = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = recorded.get("tokenizer_class") if isinstance(recorded, dict) else None
    return value if isinstance(value, str) else None


def task_reward(
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    *,
    with_feedback: bool = True,
) -> Callable[..., list[Scored] | list[float]]:
    """The task's TRL reward function for rollouts of `model`: it scores the text evaluation
    scores (`tasks.decode_completion` of each completion's token ids, cut at the model's stop
    tokens), not the text TRL decodes without special tokens."""
    stops = stop_token_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))
    return task.reward_func(with_feedback, tokenizer=tokenizer, stop_ids=stops)


def task_index(task: Task) -> dict[str, Example]:
    """prompt_key -> Example over both splits (teachers and verifiers see prompts, not ids)."""
    from composer_replication.data.traces import prompt_key
    from composer_replication.tasks.task import chat_prompt

    examples = list(task.train_examples()) + list(task.eval_examples())
    return {prompt_key(chat_prompt(ex.prompt)): ex for ex in examples}


def task_verifier(task: Task) -> Callable[[Prompt, str], float | None]:
    """`(prompt, completion) -> reward` by the task's verifier; None for an unknown prompt."""
    from composer_replication.data.traces import prompt_key

    index = task_index(task)

    def verifier(prompt: Prompt, completion: str) -> float | None:
        example = index.get(prompt_key(prompt))
        return None if example is None else float(task.verify(example, completion).reward)

    return verifier


def build_teachers(config: RunConfig, task: Task) -> list[TeacherClient]:
    """Endpoint teachers from [[teachers.endpoints]], else the task oracle (if enabled)."""
    from composer_replication.data.teachers import OpenAICompatibleTeacher, OracleTeacher
    from composer_replication.data.traces import prompt_key

    teachers: list[TeacherClient] = []
    for i, ep in enumerate(config.teachers.endpoints):
        try:
            teachers.append(
                OpenAICompatibleTeacher(
                    base_url=ep.base_url,
                    model=ep.model,
                    name=ep.name,
                    api_key_env=ep.api_key_env or None,
                    max_tokens=ep.max_tokens,
                    temperature=ep.temperature,
                )
            )
        except ValueError as exc:
            raise ConfigError(f"teachers.endpoints[{i}]: {exc}") from None
    if not teachers and config.teachers.oracle:
        from composer_replication.tasks.task import chat_prompt

        # TRAIN prompts only: the oracle never answers a held-out prompt, so no held-out answer
        # can reach training through channel 3.
        examples = [*task.train_examples(), *hinted_examples(config, task)]
        train = {prompt_key(chat_prompt(ex.prompt)): ex for ex in examples}

        def solve(prompt: Prompt) -> str | None:
            example = train.get(prompt_key(prompt))
            return None if example is None else task.oracle(example)

        teachers.append(OracleTeacher(solve, name="oracle"))
    return teachers


def teacher_pool(config: RunConfig, task: Task) -> tuple[TraceStore, TeacherPool | None]:
    """(trace_store, teacher_pool) for channel 3: the baked traces of `teachers.traces_path`
    (if any), and a pool that asks the teachers lazily for prompts without a trace."""
    from composer_replication.data.teachers import TeacherPool
    from composer_replication.data.traces import TraceStore

    trace_store = TraceStore()
    if config.teachers.traces_path:
        trace_store = TraceStore.load([config.teachers.traces_path])
    teachers = build_teachers(config, task)
    if not teachers:
        return trace_store, None
    return trace_store, TeacherPool(teachers, store=trace_store, verifier=task_verifier(task))


def trl_training_args(
    config: RunConfig, output_dir: str, max_steps: int, seed: int
) -> dict[str, Any]:
    """The TRL/transformers training keywords `[train]` fixes (optimizer, batch, generation,
    logging, CPU/GPU precision): what `trainer_args` builds on, and what a stock TRL trainer
    gets to train on the same settings (benchmarks/vs_trl.py)."""
    import torch

    t = config.train
    cuda = torch.cuda.is_available()
    return {
        "output_dir": output_dir,
        "max_steps": max_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler,
        "warmup_steps": t.warmup_steps,
        "max_grad_norm": t.max_grad_norm,
        "per_device_train_batch_size": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "num_generations": t.num_generations,
        "max_completion_length": t.max_completion_length,
        "temperature": t.temperature,
        "logging_steps": config.logging.log_every,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": not cuda,
        "bf16": cuda and config.model.dtype == "bfloat16",
        "seed": seed,
        **generation_args(t.generation),
    }


def channel1_args(config: RunConfig) -> dict[str, Any]:
    """Channel 1 of `[loss]` as TRL `GRPOConfig` keywords (`CHANNEL1_TRL_ARGS`)."""
    return {arg: getattr(config.loss, key) for key, arg in CHANNEL1_TRL_ARGS.items()}


def trainer_args(config: RunConfig, output_dir: str, max_steps: int, seed: int) -> ComposerConfig:
    """The TRL arguments of a run: `[train]`, channel 1 of `[loss]`, CPU/GPU precision."""
    from composer_replication.trainer import ComposerConfig

    return ComposerConfig(
        **trl_training_args(config, output_dir, max_steps, seed), **channel1_args(config)
    )


def hint_template(config: RunConfig) -> HintTemplate:
    """Channel 2's hint template (`[task] hint_feedback_with_solution`), which also writes the
    run's hinted examples (`task.hint_share`), so the policy trains on the hints its teacher
    reads."""
    from composer_replication.data.hints import HintTemplate

    return HintTemplate(
        feedback_with_solution=config.task.hint_feedback_with_solution,
        feedback_alone=config.task.hint_feedback_alone,
    )


def hinted_examples(config: RunConfig, task: Task) -> list[Example]:
    """The run's hinted examples (`[task] hint_share`, `hint_source`, written by
    `hint_template`): what its replicas train on beside the plain prompts, what the oracle
    answers for channel 3, and what the exchange's token-claim bound must cover."""
    return task.hinted_examples(
        config.task.hint_share, template=hint_template(config), source=config.task.hint_source
    )


def composer_kwargs(config: RunConfig) -> dict[str, Any]:
    """The trainer's composer keywords: `[loss]` minus channel 1 (unset optionals omitted), and
    channel 3's trace filter (`[teachers] min_reward`)."""
    kw = config.loss.compose_kwargs()
    for key in CHANNEL1_TRL_ARGS:
        kw.pop(key, None)
    if config.teachers.min_reward is not None:
        kw["replay_min_trace_reward"] = config.teachers.min_reward
    return kw


def train_split(config: RunConfig, task: Task, rank: int) -> Dataset:
    """The training prompts replica `rank` samples from: with `task.shard = "disjoint"` every
    n-th prompt from `rank` (n = backend.n_replicas, a data island per replica, no prompt in
    two), else all of them."""
    dataset = task.to_dataset(
        "train",
        hint_share=config.task.hint_share,
        hint_source=config.task.hint_source,
        hint_template=hint_template(config),
    )
    n = config.backend.n_replicas
    if config.task.shard == "shared" or n == 1:
        return dataset
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside backend.n_replicas ({n})")
    return dataset.shard(num_shards=n, index=rank, contiguous=False)


def build_trainer(
    config: RunConfig,
    *,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    max_steps: int,
    seed: int,
    output_dir: str,
    callbacks: list[TrainerCallback] | None = None,
    rank: int = 0,
    settings: Mapping[str, object] | None = None,
) -> ComposerReplicationTrainer:
    """The `ComposerReplicationTrainer` of replica `rank` of a run: the task's reward (with
    feedback) and its training prompts (`train_split`), TRL settings from [train]/[loss],
    channel-3 teachers from [teachers]; `settings`: composer keywords the TOML has no key for
    (`trainer.ComposerSettings`: e.g. `hint_template`, `sdpo_gate`), over the config's."""
    from transformers.trainer_callback import PrinterCallback

    from composer_replication.trainer import ComposerReplicationTrainer

    trace_store, pool = teacher_pool(config, task)
    trainer = ComposerReplicationTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[task_reward(task, tokenizer, model)],
        train_dataset=train_split(config, task, rank),
        args=trainer_args(config, output_dir, max_steps, seed),
        callbacks=callbacks,
        trace_store=trace_store,
        teacher_pool=pool,
        **{
            **composer_kwargs(config),
            "hint_template": hint_template(config),
            "hint_grpo": config.task.hint_grpo,
            **(settings or {}),
        },
    )
    configure_generation(trainer, config.train.generation)
    # Every log line already goes to the store as a metric record; printing each one too
    # would only bloat the replica's log file.
    trainer.remove_callback(PrinterCallback)
    return trainer
