"""One story about defaults: `config show` of the embedded default names every key it sets away
from what a TOML file that leaves the key out gets, with both values and why; the output is
still the TOML that `train` runs."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from composer_replication.config import load_config, to_dict
from composer_replication.config.reference import EMBEDDED_WHY, embedded_differences


def test_config_show_names_every_key_the_demo_sets_away_from_the_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "composer_replication", "config", "show"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    header = [line for line in out.splitlines() if line.startswith("#")]
    listed = {line.split()[1] for line in header if line.startswith("#   ")}
    differences = embedded_differences()
    assert listed == {key for key, _, _ in differences}
    for key in ("loss.rpo_alpha", "loss.beta_replay", "loss.dpo_variant"):
        assert key in listed  # what the README's figures rely on, named
    assert " ".join(line[2:] for line in header).startswith(EMBEDDED_WHY[:40])
    assert tomllib.loads(out) == to_dict(load_config())  # comments only: the same config
    rpo = next(d for d in differences if d[0] == "loss.rpo_alpha")
    assert rpo[1:] == ("1.0", "0.0")
