"""`[train] generation`: the rollout engines TRL is asked for (assembly.build.GENERATION_ARGS).

- ``static``: transformers' static key/value cache (TRL's ``cache_implementation="static"``) and,
  on a GPU, the decoding forward compiled (``configure_generation`` lifts TRL's
  ``disable_compile=True``). On the CPU (no compilation there) the static cache alone is checked:
  greedy decoding gives the same tokens as the default dynamic cache, through ``generate`` and
  through the trainer's own rollouts.
- ``vllm`` / ``vllm_server``: TRL's ``use_vllm`` with ``vllm_mode``; without vLLM installed the
  run fails before any model is built, naming the extra.
- A misspelt engine or key is a `ConfigError` with a did-you-mean.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _trainer_helpers import config, generation_batch, make_trainer

from composer_replication.assembly.build import (
    GENERATION_ARGS,
    VLLM_ENGINES,
    configure_generation,
    generation_args,
    trl_training_args,
)
from composer_replication.config import ConfigError, load_config
from composer_replication.config.schema import GENERATION_ENGINES
from composer_replication.models import build_tiny_model, build_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_every_engine_of_the_schema_has_its_trl_arguments():
    assert set(GENERATION_ARGS) == set(GENERATION_ENGINES)
    assert GENERATION_ARGS["static"] == {"cache_implementation": "static"}
    assert GENERATION_ARGS["vllm"] == {"use_vllm": True, "vllm_mode": "colocate"}
    assert GENERATION_ARGS["vllm_server"] == {"use_vllm": True, "vllm_mode": "server"}
    assert set(VLLM_ENGINES) == {"vllm", "vllm_server"}


def test_static_cache_greedy_tokens_equal_the_dynamic_caches():
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as TRL batches prompts
    mask[2, :4] = 0
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    dynamic = model.generate(input_ids=ids, attention_mask=mask, **kw)
    static = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **kw)
    assert static.shape == dynamic.shape == (3, 7 + 12)
    assert torch.equal(static, dynamic)


def test_static_engine_through_the_trainer_gives_the_same_greedy_rollouts(tmp_path, monkeypatch):
    """Two trainers on the same model weights, greedy decoding: the default engine and
    'static' (its TRL arguments and `configure_generation`) roll out the same completions, and
    only the static one builds a `StaticCache`."""
    from transformers.cache_utils import StaticCache

    built: list[int] = []
    original = StaticCache.__init__

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(StaticCache, "__init__", counting)
    greedy = {"do_sample": False}
    plain = make_trainer(
        tmp_path, args=config(tmp_path, generation_kwargs=greedy), alpha_sdpo=0, beta_replay=0
    )
    args = config(tmp_path, generation_kwargs=greedy, **generation_args("static"))
    static = make_trainer(tmp_path, args=args, alpha_sdpo=0, beta_replay=0)
    configure_generation(static, "static")
    assert static.generation_config.cache_implementation == "static"
    assert static.generation_config.disable_compile is False  # compiled decoding on a GPU
    assert plain.generation_config.disable_compile is True  # TRL's own setting, untouched
    assert plain.generation_config.cache_implementation is None
    a = generation_batch(plain)
    assert built == []  # the default engine: transformers' dynamic cache
    b = generation_batch(static)
    assert built  # the static engine's rollouts ran on a static cache
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    assert torch.equal(a["completion_mask"], b["completion_mask"])
    assert int(a["completion_mask"].sum()) > 0


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the error path cannot be reached")
@pytest.mark.parametrize("engine", VLLM_ENGINES)
def test_vllm_without_vllm_is_a_clear_error_naming_the_extra(tmp_path, engine):
    with pytest.raises(ConfigError, match=r"needs vLLM.*composer-replication\[vllm\]"):
        generation_args(engine)
    run = load_config(overrides=[f"train.generation={engine}"])  # the schema accepts it
    with pytest.raises(ConfigError, match=rf"train.generation = '{engine}' needs vLLM"):
        trl_training_args(run, str(tmp_path), max_steps=1, seed=0)


def test_other_engines_need_nothing_more(tmp_path):
    for engine in GENERATION_ENGINES:
        if engine not in VLLM_ENGINES:
            assert generation_args(engine) == GENERATION_ARGS[engine]
    run = load_config(overrides=["train.generation=static"])
    assert trl_training_args(run, str(tmp_path), max_steps=1, seed=0)["cache_implementation"] == (
        "static"
    )
    with pytest.raises(ConfigError, match="unknown engine 'sglang'"):
        generation_args("sglang")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.generation=vlm", "did you mean 'vllm'?"),
        ("train.generation=statc", "did you mean 'static'?"),
        ("train.generaton=static", "did you mean 'generation'?"),
    ],
)
def test_a_misspelt_engine_or_key_gets_a_did_you_mean(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])
