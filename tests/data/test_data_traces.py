"""Trace format, prompt_key and TraceStore: validation errors name file and line."""

from __future__ import annotations

import json

import pytest

from composer_replication.data import HintTemplate, TraceFormatError, TraceRecord, TraceStore
from composer_replication.data.traces import prompt_key

CHAT = [{"role": "user", "content": "What is 2+2?"}]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_key_normalises_and_distinguishes():
    k = prompt_key(CHAT)
    assert len(k) == 64 and k == prompt_key("What is 2+2?")
    assert k == prompt_key([{"role": "User ", "content": "What is 2+2?\r\n", "name": None}])
    assert k != prompt_key("What is 2+3?")
    assert k != prompt_key([{"role": "system", "content": "x"}, *CHAT])
    with pytest.raises(ValueError, match="role"):
        prompt_key([{"content": "no role"}])


def test_store_dedupes_and_picks_best_by_reward(tmp_path):
    key = prompt_key(CHAT)
    rows = [
        {"prompt_key": key, "teacher": "a", "completion": "5", "reward": 0.0},
        {"prompt_key": key, "teacher": "b", "completion": "4"},  # unscored
        {"prompt_key": key, "teacher": "c", "completion": "4", "reward": 1.0, "prompt": CHAT},
        {"prompt_key": key, "teacher": "a", "completion": "5", "reward": 0.0},  # duplicate
    ]
    store = TraceStore.load(write_jsonl(tmp_path / "t.jsonl", rows))
    assert len(store) == 3 and store.duplicates == 1
    best = store.best(key)
    assert best is not None and best.teacher == "c" and best.reward == 1.0
    assert store.best("nope") is None
    # Unscored traces are used only when nothing is scored.
    only_unscored = TraceStore([TraceRecord(key, "x", "4"), TraceRecord(key, "y", "44")])
    assert only_unscored.best(key).teacher == "x"
    # Round trip.
    store.save(tmp_path / "out.jsonl")
    again = TraceStore.load(tmp_path / "out.jsonl")
    assert sorted(r.teacher for r in again) == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"teacher": "a", "completion": "x"}, "missing required field"),
        ({"prompt_key": "k", "completion": "x"}, "teacher"),
        ({"prompt_key": "k", "teacher": "a", "completion": "  "}, "empty"),
        ({"prompt_key": "k", "teacher": "a", "completion": "x", "reward": "high"}, "reward"),
        ({"prompt_key": "k", "teacher": "a", "completion": "x", "score": 1}, "unknown field"),
        ({"prompt_key": "k", "teacher": "a", "completion": "x", "prompt": CHAT}, "does not match"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_records_report_file_and_line(tmp_path, row, message):
    good = {"prompt_key": prompt_key(CHAT), "teacher": "a", "completion": "4"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", row])
    with pytest.raises(TraceFormatError, match=message) as info:
        TraceStore.load(path)
    assert f"{path}:3:" in str(info.value)


def test_unknown_prompt_reported_with_file_and_line(tmp_path):
    known = prompt_key(CHAT)
    rows = [
        {"prompt_key": known, "teacher": "a", "completion": "4"},
        {"prompt_key": prompt_key("other"), "teacher": "a", "completion": "4"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceFormatError, match="unknown prompt_key") as info:
        TraceStore.load(path, known_prompt_keys={known})
    assert f"{path}:2:" in str(info.value)


def test_hint_template_renders_sections_and_validates():
    tmpl = HintTemplate()
    hinted = tmpl.render(
        [{"role": "system", "content": "be brief"}, *CHAT], solution="4", feedback="got 5"
    )
    assert hinted[0] == {"role": "system", "content": "be brief"}
    text = hinted[1]["content"]
    assert text.startswith("What is 2+2?\nCorrect solution:\n\n4\n\n")
    assert "The following is feedback from your unsuccessful earlier attempt:\n\ngot 5" in text
    assert text.endswith("Correctly solve the original question.\n")
    assert tmpl.render_text("Q", None, None) == "Q\n\nCorrectly solve the original question.\n"
    with pytest.raises(ValueError, match="prompt"):
        HintTemplate(reprompt="{question}")


def test_from_dicts_reports_position():
    key = prompt_key(CHAT)
    good = {"prompt_key": key, "teacher": "a", "completion": "4"}
    assert len(TraceStore.from_dicts([good, {**good, "teacher": "b"}])) == 2
    with pytest.raises(TraceFormatError, match=r"oracle:2: missing required field"):
        TraceStore.from_dicts([good, {"teacher": "a"}], source="oracle")
