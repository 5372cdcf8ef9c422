"""benchmarks/vs_trl.py (issues 23, 35): every arm (ours; TRL's GRPO, SFT, rejection-sampling
SFT, SFT -> GRPO and SDPO) is tuned on a validation split carved from training, then trains on
the embedded default's task for the same budget, from the same base model, in two information
regimes (the oracle's traces for every prompt; traces for a share of the prompts, some wrong),
and is evaluated on the held-out prompts; the last line is the JSON the docs quote. The quick
run's budget is tiny: the figures are not judged here, only their form, that every arm ran, was
tuned on the validation split and measured on the held-out one, with a learning curve."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("composer", "trl_grpo", "trl_sft", "trl_sft_grpo", "trl_sdpo")  # both regimes
PARTIAL_ARMS = (*ARMS, "trl_rft")


def _vs_trl():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return vs_trl


def _quick_run(log: Path, *args: str) -> dict:  # type: ignore[type-arg]
    """`vs_trl.py --quick --budget-s 3 --log LOG ARGS` in a child process: its last line's JSON."""
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--quick", "--budget-s", "3"]
    cmd += ["--log", str(log), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.long
@pytest.mark.slow
def test_quick_run_prints_the_keys(tmp_path: Path) -> None:
    log = tmp_path / "runs.jsonl"
    args = ("--clock", "cpu", "--probe-every", "1", "--bootstrap", "200", "--jobs", "1")
    result = _quick_run(log, *args, "--out", str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text()) == result
    for suffix, arms in (("", ARMS), ("_partial", PARTIAL_ARMS)):
        for key in (
            "composer_heldout_acc",
            "trl_best_heldout_acc",
            "composer_minus_best_trl",
            "composer_constant_answer_share",
            *(f"{a}_heldout_acc" for a in arms),
        ):
            assert isinstance(result[key + suffix], float), (key, suffix, result[key + suffix])
        assert result["trl_best_arm" + suffix] in arms[1:]
        assert result["composer_minus_best_trl" + suffix] == pytest.approx(
            result["composer_heldout_acc" + suffix] - result["trl_best_heldout_acc" + suffix]
        )
        lo, hi = result[f"composer_minus_best_trl{suffix}_ci"]
        assert lo <= result["composer_minus_best_trl" + suffix] <= hi
        assert result["n_heldout" + suffix] == 256 and result["seeds" + suffix] == 1
        per_seed, tuned = result["per_seed" + suffix], result["tuned" + suffix]
        assert set(per_seed) == set(arms)
        for arm in arms:
            (run,) = per_seed[arm]
            assert run["split"] == "heldout" and run["train_seconds"] >= 3.0  # budget spent
            assert run["n"] == 256 and 0.0 <= run["ood_acc"] <= 1.0 and run["base"] == 2
            lo, hi = result[f"{arm}_heldout_acc{suffix}_ci"]
            assert lo <= result[f"{arm}_heldout_acc{suffix}"] <= hi
            # the learning curve: from the base model (second 0) to the end of the budget
            (t0, _), (t1, acc) = run["curve"][0], run["curve"][-1]
            assert t0 == 0.0 and t1 == run["train_seconds"] and acc == run["acc"]
            assert all(a[0] <= b[0] for a, b in zip(run["curve"], run["curve"][1:]))
            # chosen on the validation split, one grid point per phase in --quick
            points = [(c["phase"], c["lr"], c["g"]) for c in tuned[arm]["grid"]]
            if arm in ("trl_sft", "trl_rft"):
                assert points == [(None, 3e-3, 4)]
            elif arm == "trl_sft_grpo":  # its SFT phase alone, then its GRPO phase after it
                assert points == [("sft", 3e-3, 4), (None, 3e-4, 4)]
                assert tuned[arm]["sft_lr"] == 3e-3 and tuned[arm]["share"] == 0.5
            else:
                assert points == [(None, 3e-4, 4)]
        assert per_seed["trl_sft_grpo"][0]["phase_steps"][0] >= 1  # SFT ran, then GRPO
        # the probe measured ours on every micro-batch, and only ours
        ours = per_seed["composer"][0]
        assert ours["probed_micro_batches"] == ours["steps"] and ours["channel2_loss_share"] >= 0
        assert per_seed["trl_grpo"][0]["channel2_loss_share"] is None
    assert set(result["targets"]) == {"composer_ahead_by_0.05", "intervals_apart"}
    assert set(result["targets_partial"]) == {
        "composer_ahead_by_0.05",
        "difference_interval_above_0",
    }
    # the partial regime: traces for a quarter of the prompts, 70% of them right
    assert result["trace_share_partial"] == 0.25 and result["teacher_accuracy_partial"] == 0.7
    assert 0 < result["n_traces_accepted_partial"] < result["n_traces_partial"]
    assert result["machine"]["cpu_flags"] and result["machine"]["commit"] is not None
    # every run is in the log: tuning (SFT -> GRPO's SFT phase apart) and final runs
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["split"] for r in runs} == {"val", "heldout"}
    assert len(runs) == (len(PARTIAL_ARMS) + 1) + len(PARTIAL_ARMS) + (len(ARMS) + 1) + len(ARMS)
    again = _quick_run(log, *args, "--plot", str(tmp_path / "curves.png"))  # measures nothing
    assert again["per_seed"] == result["per_seed"]
    assert again["per_seed_partial"] == result["per_seed_partial"]
    assert len(log.read_text().splitlines()) == len(runs)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # --summary-only: what the log holds, nothing run (here: every run)
    only = _quick_run(log, *args, "--summary-only", "--seeds", "2")
    assert only["per_seed"] == result["per_seed"] and len(log.read_text().splitlines()) == len(runs)


@pytest.mark.heavy  # six runs in child processes: ~4 min alone here, past 300 s under load
@pytest.mark.slow
def test_quick_warm_start_ablation_runs_every_variant(tmp_path: Path) -> None:
    """--ablation --starts warm: the SFT warm start is built once per seed, cached, and every
    channel variant starts from it (the model's tied embeddings included: saving them with
    safetensors' save_file failed, so the first real warm-start ablation stopped at once)."""
    log = tmp_path / "runs.jsonl"
    result = _quick_run(
        log,
        "--ablation",
        "--starts",
        "warm",
        "--warm-start-steps",
        "2",
        "--bootstrap",
        "100",
        "--lr",
        "3e-4",
        "--g",
        "4",
    )
    variants = ("composer_grpo", "composer_sdpo", "composer_replay", "composer")
    for v in variants:
        assert f"{v}_warm_heldout_acc" in result and f"{v}_scratch_heldout_acc" not in result
        assert f"{v}_warm_teacher_advantage" in result  # beside channel 2's rows
    assert (result["lr"], result["g"]) == (3e-4, 4)  # given: no tuning runs
    assert not any(json.loads(line)["split"] == "val" for line in log.read_text().splitlines())
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    warm = [r for r in runs if r["warm"] == 2 and r["split"] == "heldout"]
    assert sorted(r["arm"] for r in warm) == sorted((*variants, "warm_start"))
    # the warm start's own row: evaluated, not trained (what the variants add to)
    (start,) = [r for r in warm if r["arm"] == "warm_start"]
    assert start["steps"] == 0 and start["budget"] == 0.0
    assert result["warm_start_heldout_acc"] == start["acc"]
    assert len(list((tmp_path / "warm").glob("warm-seed0-steps2-*.safetensors"))) == 1


def test_tuning_fits_each_arm_and_each_phase_of_sft_grpo_on_its_own() -> None:
    """RL arms: every RL learning rate at G 4, then G 8 at the best; SFT arms: every SFT
    learning rate; SFT -> GRPO: its SFT phase alone at every SFT learning rate, then its GRPO
    phase as an RL arm from the best SFT phase (whose cached model the final run reuses)."""
    vs_trl = _vs_trl()
    done: dict = {}

    def finish(specs, acc):  # type: ignore[no-untyped-def]
        for s in specs:
            done.setdefault(
                s.key(),
                {"acc": acc(s), "reward": 0.0, "lr": s.lr, "g": s.g, "share": s.share,
                 "sft_lr": s.sft_lr},
            )  # fmt: skip

    kw = {"traces": 0.25, "teacher_acc": 0.7, "base": 300}
    for arm in ("composer", "trl_grpo", "trl_sdpo"):
        stage_a = vs_trl.tuning_specs(arm, 0, 30.0, "cpu", False, done, **kw)
        assert [(s.lr, s.g) for s in stage_a] == [(lr, 4) for lr in vs_trl.RL_GRID_LR]
        assert vs_trl.RL_GRID_LR == (1e-4, 3e-4, 1e-3) and vs_trl.GRID_G == (4, 8)
        assert all(s.split == "val" and s.seed == 0 and s.traces == 0.25 for s in stage_a)
        finish(stage_a, lambda s: 1.0 if s.lr == 3e-4 else 0.5)
        stage_b = vs_trl.tuning_specs(arm, 0, 30.0, "cpu", False, done, **kw)
        assert [(s.lr, s.g) for s in stage_b[3:]] == [(3e-4, 8)]
    for arm in ("trl_sft", "trl_rft"):
        specs = vs_trl.tuning_specs(arm, 0, 30.0, "cpu", False, done, **kw)
        assert [s.lr for s in specs] == list(vs_trl.SFT_GRID_LR)
    first = vs_trl.tuning_specs("trl_sft_grpo", 0, 30.0, "cpu", False, done, **kw)
    assert [(s.arm, s.lr, s.budget) for s in first] == [
        (vs_trl.SFT_PHASE, lr, 15.0) for lr in vs_trl.SFT_GRID_LR
    ]
    finish(first, lambda s: 1.0 if s.lr == 1e-2 else 0.2)
    second = vs_trl.tuning_specs("trl_sft_grpo", 0, 30.0, "cpu", False, done, **kw)[3:]
    assert [(s.lr, s.g, s.sft_lr, s.share) for s in second] == [
        (lr, 4, 1e-2, 0.5) for lr in vs_trl.RL_GRID_LR
    ]
    # the second phase's run starts from the first phase's tuning run (the same spec: cached)
    assert vs_trl.phase_one(second[0]) == first[2]
    finish(second, lambda s: 0.9 if s.lr == 1e-3 else 0.1)
    full = vs_trl.tuning_specs("trl_sft_grpo", 0, 30.0, "cpu", False, done, **kw)
    assert [(s.lr, s.g) for s in full[6:]] == [(1e-3, 8)]
    chosen = vs_trl.choose([done[s.key()] for s in full[3:6]])
    assert (chosen["lr"], chosen["sft_lr"]) == (1e-3, 1e-2)


def test_the_partial_regime_gives_traces_for_a_share_of_the_prompts_some_wrong() -> None:
    """Traces for `share` of the distinct training prompts, `accuracy` of them the oracle's and
    the rest off by 1-3 (rejected by the verifier); fixed by the seed; a validation view's
    traces never cover a validation prompt. Each arm reads what the module says it reads."""
    pytest.importorskip("trl")
    vs_trl = _vs_trl()
    from composer_replication.config import load_config

    task = vs_trl_task(load_config())
    distinct = {ex.prompt for ex in task.train_examples()}
    traces = vs_trl.teacher_traces(task, 0.25, 0.7, 0)
    assert len(traces) == round(0.25 * len(distinct)) and len({t.example.prompt for t in traces})
    right = [t for t in traces if t.text == task.oracle(t.example)]
    assert len(right) == round(0.7 * len(traces))
    assert all(t.correct == (t in right) and (t.reward == 1.0) == t.correct for t in traces)
    for t in traces:
        if not t.correct:
            assert 1 <= abs(int(t.text) - int(task.oracle(t.example))) <= 3
    assert vs_trl.teacher_traces(task, 0.25, 0.7, 0) == traces  # fixed by the seed
    oracle = vs_trl.teacher_traces(task, 1.0, 1.0, 0)
    assert len(oracle) == len(distinct) and all(t.correct for t in oracle)
    view = task.validation_view(vs_trl.N_VAL)
    val = {ex.prompt for ex in view.eval_examples()}
    assert not val & {t.example.prompt for t in vs_trl.teacher_traces(view, 0.25, 0.7, 0)}
    # ours replays the traces (with the verifier's reward, as bake-traces writes them)
    import tempfile

    from composer_replication.data.traces import TraceStore

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "traces.jsonl"
        vs_trl.write_traces(traces, path)
        store = TraceStore.load([str(path)])
    assert len(store) == len(traces)
    # the SFT arms' data: the traces as prompt -> answer
    data = vs_trl.trace_dataset(traces[:2])
    assert data[1]["completion"] == [{"role": "assistant", "content": traces[1].text}]


def test_new_spec_fields_keep_the_logged_runs_keys_and_the_partial_keys_are_named() -> None:
    vs_trl = _vs_trl()
    spec = vs_trl.Spec("composer", 0, 3e-4, 4, None, "heldout", 250, 100.0, "cpu", 1.0)
    assert set(json.loads(spec.key())) == {
        "arm", "seed", "lr", "g", "share", "split", "warm", "budget", "clock", "rpo", "signal",
    }  # fmt: skip
    partial = dataclasses.replace(spec, traces=0.25, teacher_acc=0.7, base=300)
    assert partial.regime == "partial" and spec.regime == "oracle"
    assert json.loads(partial.key())["traces"] == 0.25
    keys = vs_trl.partial_keys({"composer_heldout_acc": 0.5, "composer_minus_best_trl_ci": [0, 1]})
    assert keys == {
        "composer_heldout_acc_partial": 0.5,
        "composer_minus_best_trl_partial_ci": [0, 1],
    }


def test_the_bootstrap_resamples_seeds_and_classes_and_pairs_the_arms() -> None:
    vs_trl = _vs_trl()
    classes = [f"c{i // 4}" for i in range(40)]  # 10 classes of 4 prompts
    prompts = [f"p{i}" for i in range(40)]

    def run(seed: int, acc: float) -> dict:
        n = round(acc * 40)
        return {
            "seed": seed,
            "classes": classes,
            "prompts": prompts,
            "correct": [1] * n + [0] * (40 - n),
        }

    per_arm = {"a": [run(s, 0.8) for s in range(5)], "b": [run(s, 0.2) for s in range(5)]}
    boot = vs_trl.bootstrap(per_arm, reps=400)
    lo_a, hi_a = boot["intervals"]["a"]
    lo_b, hi_b = boot["intervals"]["b"]
    assert lo_a < 0.8 < hi_a and lo_b < 0.2 < hi_b and hi_b < lo_a
    # identical arms: every replicate's difference is exactly 0 (the same resample for both)
    same = vs_trl.bootstrap({"a": per_arm["a"], "c": [dict(r) for r in per_arm["a"]]}, reps=50)
    assert (same["replicates"]["a"] == same["replicates"]["c"]).all()
    with pytest.raises(ValueError, match="other held-out prompts"):
        bad = [dict(r, prompts=[f"q{i}" for i in range(40)]) for r in per_arm["b"]]
        vs_trl.bootstrap({"a": per_arm["a"], "b": bad}, reps=10)


def test_trl_arms_get_the_same_settings_and_the_oracle(tmp_path: Path) -> None:
    """What the docs claim for the comparison: TRL's GRPO and SDPO configs carry our run's
    optimizer, batch and generation settings and channel 1; SDPO distils with our channel 2's
    divergence and teacher, reads the oracle answer as every rollout's privileged context, and
    weighs it as our loss weighs its oracle- and hint-carrying channels."""
    pytest.importorskip("trl")
    vs_trl = _vs_trl()
    from trl import GRPOConfig

    from composer_replication.assembly.build import channel1_args, trainer_args, trl_training_args
    from composer_replication.config import load_config

    config = load_config(overrides=["loss.alpha_sdpo=0.25", "loss.sdpo_jsd_beta=0.3"])
    ours = trainer_args(config, str(tmp_path), 50, 7)
    common = trl_training_args(config, str(tmp_path), 50, 7)
    grpo = GRPOConfig(**common, **channel1_args(config))
    sdpo = vs_trl._trl_sdpo_args(config, common)
    shared = (
        "learning_rate",
        "lr_scheduler_type",
        "max_grad_norm",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_generations",
        "max_completion_length",
        "temperature",
        "seed",
        "max_steps",
        "loss_type",
        "epsilon",
        "beta",
        "scale_rewards",
        "num_iterations",
        "top_k",
        "top_p",
    )
    for name in shared:
        assert getattr(grpo, name) == getattr(ours, name), name
        assert getattr(sdpo, name) == getattr(ours, name), name
    assert ours.epsilon_high is None and grpo.epsilon_high is None
    assert sdpo.epsilon_high == ours.epsilon
    # (1 - w) * policy + w * distill, w = (alpha + beta) / (1 + alpha + beta)
    oracle = 0.25 + config.loss.beta_replay
    assert sdpo.distillation_weight == pytest.approx(oracle / (1 + oracle))
    assert sdpo.distillation_alpha == 0.3 and sdpo.distillation_mode == "full_logits"
    assert sdpo.teacher_model_kind == "live" and sdpo.success_reward_threshold == 0.5
    assert sdpo.include_environment_feedback is True and sdpo.distillation_is_clip is None
    assert "Correct solution" in sdpo.feedback_template
    with pytest.raises(ValueError, match="sdpo_wrapper"):
        vs_trl._trl_sdpo_args(load_config(overrides=["loss.sdpo_wrapper=entropy_opd"]), common)
    # the grid point reaches the run config: 16 prompts x G completions per step
    spec = vs_trl.Spec("trl_sdpo", 0, 1e-2, 4, None, "val", 0, 220.0, "cpu")
    tuned = load_config(overrides=vs_trl.arm_overrides(spec, []))
    assert (tuned.train.learning_rate, tuned.train.num_generations, tuned.train.batch_size) == (
        1e-2,
        4,
        64,
    )
    # the SFT arms train on the oracle traces of the training prompts, answer only
    task = vs_trl_task(config)
    data = vs_trl.sft_dataset(task)
    assert len(data) == len(task.train_examples())
    row, ex = data[0], task.train_examples()[0]
    assert row["prompt"] == [{"role": "user", "content": ex.prompt}]
    assert row["completion"] == [{"role": "assistant", "content": task.oracle(ex)}]


def vs_trl_task(config):  # type: ignore[no-untyped-def]
    from composer_replication.assembly.build import build_task

    return build_task(config)


def test_our_arms_train_with_the_defaults_rpo_alpha_and_its_runs_are_logged_apart() -> None:
    """Our arms train with the embedded default's channel-3 NLL weight (or the user's override)
    and the results log keeps those runs apart from the ones logged before the weight existed
    (they trained without it: their key, which has no `rpo`, is that of a run at rpo 0)."""
    pytest.importorskip("trl")
    vs_trl = _vs_trl()
    assert vs_trl.rpo_alpha("composer", []) == 1.0  # config/default.toml
    assert vs_trl.rpo_alpha("composer_replay", ["loss.rpo_alpha=0.5"]) == 0.5
    assert vs_trl.rpo_alpha("trl_sft", []) == 0.0  # not our loss
    old = vs_trl.Spec("composer", 0, 3e-3, 2, None, "heldout", 0, 220.0, "cpu")
    assert "rpo" not in json.loads(old.key())
    new = vs_trl.Spec("composer", 0, 3e-3, 2, None, "heldout", 0, 220.0, "cpu", 1.0)
    assert new.key() != old.key() and json.loads(new.key())["rpo"] == 1.0
    assert "loss.rpo_alpha=1.0" in vs_trl.arm_overrides(new, [])
    assert "loss.rpo_alpha=0.0" in vs_trl.arm_overrides(old, [])  # run as logged: without
    trl = vs_trl.Spec("trl_sft", 0, 3e-3, 2, None, "heldout", 0, 220.0, "cpu")
    assert not any(o.startswith("loss.rpo_alpha") for o in vs_trl.arm_overrides(trl, []))
    staged = vs_trl.tuning_specs("composer", 0, 220.0, "cpu", False, {}, 1.0)
    assert {s.rpo for s in staged} == {1.0}


def test_runs_logged_before_the_learning_signal_fix_never_match_and_the_warm_start_reads_hints():
    """A run logged before the training reward judged what evaluation judges has no `signal`
    in its key, so a rerun never reuses it; the warm start's SFT data holds every trace twice,
    plain and under channel 2's hinted prompt (what the hinted teacher will read)."""
    pytest.importorskip("trl")
    vs_trl = _vs_trl()
    spec = vs_trl.Spec("composer", 0, 3e-4, 4, None, "heldout", 250, 220.0, "cpu", 1.0)
    key = json.loads(spec.key())
    assert key["signal"] == vs_trl.SIGNAL_VERSION >= 2
    old = {k: v for k, v in key.items() if k != "signal"}
    assert json.dumps(old, sort_keys=True) != spec.key()
    from composer_replication.config import load_config

    task = vs_trl_task(load_config())
    examples = task.train_examples()[:3]
    data = vs_trl.sft_dataset(task, examples, hinted=True)
    assert len(data) == 2 * len(examples)
    n = len(examples)
    hints = task.hinted_examples(1.0, examples, vs_trl.HINTS)
    for i, ex in enumerate(examples):
        plain, hinted = data[i], data[n + i]
        assert plain["prompt"][0]["content"] == ex.prompt
        text = hinted["prompt"][0]["content"]
        assert text == hints[i].prompt and text.startswith(ex.prompt)
        assert plain["completion"] == hinted["completion"]
    # written as channel 2 writes our arms' hints: the solution alone where there is one
    assert not vs_trl.HINTS.feedback_with_solution
