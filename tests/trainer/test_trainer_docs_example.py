"""The copyable example in docs/trainer.md runs and every channel's metrics move."""

from __future__ import annotations

import re
from pathlib import Path

from composer_replication.trainer import TAIDCallback

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def test_docs_example_trains_all_three_channels(tmp_path, monkeypatch, capsys):
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    trainer = namespace["trainer"]
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
