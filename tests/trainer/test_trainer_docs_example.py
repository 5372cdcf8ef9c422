"""The copyable example in docs/trainer.md runs and every channel's metrics move."""

from __future__ import annotations

from pathlib import Path

from docblocks import exec_doc_block

from composer_replication.trainer import TAIDCallback

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def test_docs_example_trains_all_three_channels(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    trainer = exec_doc_block("docs/trainer.md", "reward_funcs=[exact_answer]")["trainer"]
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["sdpo/active"] == 1.0 and row["replay/active"] == 1.0
        assert row["loss/sdpo"] > 0 and row["loss/replay"] > 0
        assert 0.4 <= row["taid/t"] <= 1.0
        assert row["kl"] is not None
    # Every channel's metrics move from step to step.
    for key in ("loss/sdpo", "loss/replay", "replay/margin", "kl"):
        assert len({round(r[key], 9) for r in rows}) > 1, key
    # TAID t never decreases (linear floor + momentum), and the callback was added for us.
    ts = [r["taid/t"] for r in rows]
    assert ts == sorted(ts) and ts[-1] > ts[0]
    assert any(isinstance(c, TAIDCallback) for c in trainer.callback_handler.callbacks)
    # The EMA teacher moved with the student but lags it.
    student = dict(trainer.model.named_parameters())
    teacher = dict(trainer.ema_teacher.model.named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert not teacher[name].requires_grad
    assert 0 < float((teacher[name] - student[name].detach()).abs().max())
    assert "step 3:" in capsys.readouterr().out


def test_keyword_table_defaults_are_the_settings_defaults():
    """docs/trainer.md's keyword table states ComposerSettings' defaults (which are
    loss.ComposeConfig's for the loss keywords): no second source of a default; and it lists
    every loss setting the trainer takes (a setting added to loss/loss_settings.py gets a row)."""
    import dataclasses
    import sys

    sys.path.insert(0, str(DOC.parents[1] / "tests" / "loss"))
    from test_loss_docs import table_defaults

    from composer_replication.loss import ComposeConfig
    from composer_replication.trainer import ComposerSettings
    from composer_replication.trainer.config import LOSS_KEYS

    documented = table_defaults(DOC.read_text(), "| keyword | default |")
    settings = {f.name: f.default for f in dataclasses.fields(ComposerSettings)}
    loss = {f.name: f.default for f in dataclasses.fields(ComposeConfig)}
    assert set(documented) <= set(settings) and len(documented) >= 20
    assert set(LOSS_KEYS) <= set(documented), set(LOSS_KEYS) - set(documented)
    for name, value in documented.items():
        assert value == settings[name], name
        if name in loss:
            assert settings[name] == loss[name], name
