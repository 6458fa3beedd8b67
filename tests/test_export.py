"""``offpolicy-moe export``: a trained policy leaves as a Hugging Face folder that plain transformers loads, with the
trained policy's logits and greedy generations; PR2 predictors beside it; ``trainer.export_final``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from offpolicy_moe.cli import main as cli_main
from offpolicy_moe.config.load import load_config
from offpolicy_moe.run.checkpoint import load_checkpoint
from offpolicy_moe.trainer.launch import train
from offpolicy_moe.models import load_policy
from offpolicy_moe.models.presets import tiny_qwen3_moe_config
from offpolicy_moe.sweep.plan import load_experiment, plan_runs
from offpolicy_moe.tasks import encode_prompts, make_task
from offpolicy_moe.tasks.tokenizer import build_char_tokenizer

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2", "task.eval_size=8",
        "task.reward=partial",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "trainer.eval_every=0",
        "trainer.log_every=100", "logging.progress=false", "logging.loggers=[jsonl]", "trainer.min_free_mb=1",
        "optim.lr=1e-2", "trainer.sft_warmup_steps=0", "trainer.threads=1", "trainer.keep_checkpoints=0",
        "trainer.checkpoint_every=1", "trainer.steps=2"]
PROMPTS = ["1+2=", "7+8=", "3+4+5="]
NEW_TOKENS = 4

# Runs in a fresh interpreter with no project code importable: the export must stand on its own.
PLAIN_LOADER = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(out).eval()
assert not any(m.startswith("offpolicy_moe") for m in sys.modules)
enc = tok(prompts, return_tensors="pt", padding=True)
with torch.no_grad():
    logits = model(**enc).logits
    gen = model.generate(**enc, max_new_tokens=n)
torch.save({"ids": enc["input_ids"], "logits": logits, "gen": gen}, sys.argv[4])
"""


def plain_transformers(out: Path, tmp_path: Path) -> dict:
    res_file = tmp_path / "plain.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", PLAIN_LOADER, str(out), json.dumps(PROMPTS), str(NEW_TOKENS),
                    str(res_file)], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    return torch.load(res_file, weights_only=True)


def trained_policy(run_dir: Path, step: int):
    """The trained policy as the project itself builds it, with checkpoint ``step``'s weights."""
    cfg = load_config(run_dir / "config.yaml")
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=make_task(cfg.task))
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")))
    return model.eval(), tok


def assert_same_policy(run_dir: Path, out: Path, tmp_path: Path, step: int) -> None:
    got = plain_transformers(out, tmp_path)
    model, tok = trained_policy(run_dir, step)
    ids, mask = encode_prompts(tok, PROMPTS)
    assert torch.equal(ids, got["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    valid = mask.bool()        # padded positions carry no prediction
    torch.testing.assert_close(got["logits"][valid], logits[valid], rtol=0, atol=1e-5)
    assert torch.equal(got["gen"], gen)


@pytest.fixture(scope="module")
def pr2_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("pr2") / "run"
    cfg = load_config(None, TINY + ["algo.routing.replay=pr2"])
    cfg.run_dir = str(d)
    assert train(cfg)["status"] == "completed"
    return d


def test_export_of_embedded_model_loads_with_plain_transformers_and_matches(pr2_run, tmp_path):
    out = tmp_path / "hf"
    assert cli_main(["export", str(pr2_run), str(out), "--step", "1"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "pr2_predictors.safetensors"} <= {p.name for p in out.iterdir()}
    assert_same_policy(pr2_run, out, tmp_path, step=1)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)


def test_pr2_predictors_are_written_beside_the_model_as_documented(pr2_run, tmp_path):
    out = tmp_path / "hf"
    assert cli_main(["export", str(pr2_run), str(out)]) == 0           # newest checkpoint: step 2
    want = load_checkpoint(pr2_run / "checkpoints" / "step_2").modules["predictors"]
    with safe_open(str(out / "pr2_predictors.safetensors"), "pt") as f:
        meta = f.metadata()
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert meta["format"] == "offpolicy_moe.pr2_predictors/1"
    assert (int(meta["num_layers"]), int(meta["num_experts"]), int(meta["hidden_size"])) == (1, 4, 32)


def test_export_final_writes_the_final_policy(pr2_run):
    # save_pretrained writes transformers' on-disk expert layout: compare after loading it back
    final = AutoModelForCausalLM.from_pretrained(pr2_run / "export").state_dict()
    ck = load_file(str(pr2_run / "checkpoints" / "step_2" / "model.safetensors"))
    assert final.keys() == ck.keys() and all(torch.equal(final[k], ck[k]) for k in ck)


def test_export_of_a_local_model_path_run(tmp_path):
    tok = build_char_tokenizer()
    base = tmp_path / "base"
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    conf = tiny_qwen3_moe_config(len(tok), num_layers=1, hidden_size=32, num_experts=4, top_k=2,
                                 special_ids=special)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(base)
    tok.save_pretrained(base)
    run = tmp_path / "run"
    cfg = load_config(None, TINY + [f"model.path={base}", "trainer.export_final=false"])
    cfg.run_dir = str(run)
    assert train(cfg)["status"] == "completed"
    assert not (run / "export").exists()
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out), "--step", "2"]) == 0
    assert assert_same_policy(run, out, tmp_path, step=2) is None
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)      # the TRAINED weights left, not the base


def test_export_errors_are_one_line(pr2_run, tmp_path, capsys):
    assert cli_main(["export", str(pr2_run), str(tmp_path / "a"), "--step", "9"]) == 2     # user mistakes: rc 2
    err = capsys.readouterr().err.strip()
    assert "step_9" in err and "step_2" in err and "\n" not in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert cli_main(["export", str(pr2_run), str(busy)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path), str(tmp_path / "b")]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_sweeps_do_not_export_unless_asked(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("name: e\nbase: {trainer.steps: 1}\ngrid:\n  buffer.staleness: [0]\n")
    assert [r.config.trainer.export_final for r in plan_runs(load_experiment(f), seeds=[0])] == [False]
    f.write_text("name: e\nbase: {trainer.export_final: true}\ngrid:\n  buffer.staleness: [0]\n")
    assert [r.config.trainer.export_final for r in plan_runs(load_experiment(f), seeds=[0])] == [True]
    assert load_config(None, []).trainer.export_final is True          # train and demo: on by default
