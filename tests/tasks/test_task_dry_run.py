"""`train --dry-run` refuses the task options of docs/tasks.md with one line each, and accepts good ones."""
from __future__ import annotations

import json

import pytest

from offpolicy_moe.cli import main




@pytest.mark.parametrize("override, line", [
    ("task.rewards=[{fn: 'no_such_pkg.rewards:score'}]",
     "task.rewards[0].fn='no_such_pkg.rewards:score': cannot import module 'no_such_pkg.rewards'"),
    ("task.rewards=[{fn: exact}, {fn: 'tests.tasks.reward_fixtures:nothing_here'}]",
     "task.rewards[1].fn='tests.tasks.reward_fixtures:nothing_here': 'tests.tasks.reward_fixtures' has no attribute"),
    ("task.rewards=[{fn: 'missing/reward.py:score'}]", "task.rewards[0].fn='missing/reward.py:score': file"),
    ("task.rewards=[{fn: exact, weight: .nan}]", "task.rewards[0].weight: expected a finite number"),
    ("task.name='dataset:'", "task.name: unknown task 'dataset:'"),
    ("task.chat_template=always", "task.chat_template"),
    ("task.on_reward_error=ignore", "task.on_reward_error"),
])
def test_refused_with_one_line_naming_it(tmp_path, capsys, override, line):
    rc = main(["train", "--dry-run", "--run-dir", str(tmp_path / "run"), override])
    err = capsys.readouterr().err
    assert rc == 2, err
    hits = [ln for ln in err.splitlines() if line in ln]
    assert len(hits) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_good_dataset_with_rewards_passes(tmp_path, capsys):
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) + "\n"
                            for i in range(8)))
    reward = tmp_path / "bonus.py"
    reward.write_text("def short(completions, answers, **kw):\n    return [1.0] * len(completions)\n")
    rc = main(["train", "--dry-run", "--run-dir", str(tmp_path / "run"), f"task.name=dataset:{data}",
               "task.prompt_column=question", "task.answer_format=gsm8k", "task.eval_size=2",
               f"task.rewards=[{{fn: math}}, {{fn: '{reward}:short', weight: 0.1}}]"])
    assert rc == 0, capsys.readouterr().err
