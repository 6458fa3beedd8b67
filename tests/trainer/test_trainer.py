"""Trainer integration tests on a tiny MoE (CPU, one thread, deterministic)."""
from __future__ import annotations

import copy
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offpolicy_moe.run.checkpoint import CheckpointError
from offpolicy_moe.run.run_dir_checks import RunDirError
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.run.metrics import DOCUMENTED_KEYS, is_documented
from offpolicy_moe.trainer.step_metrics import STEP_PARTS
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.launch import train
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.trainer.trainer import Trainer, TrainingStopped
from tests.kill import train_until_checkpoint
from tests.tiny import tiny_config



def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def strip_perf(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def final_weights(run_dir, step):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step}" / "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# staleness 0 + bypass == a plain on-policy loop written here


def plain_on_policy_loop(cfg):
    """Independent reference: sample with the current weights, GRPO clipped loss with old = behaviour log-probs."""
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.tasks import decode_completions, encode_prompts, make_task

    torch.manual_seed(cfg.seed)
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=task)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=0.0)
    G, n = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    rewards_per_step = []
    for it in range(cfg.trainer.steps):
        rows = task.sample_prompts(it, n)
        ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
        ids, am = ids.repeat_interleave(G, 0), am.repeat_interleave(G, 0)
        answers = [r["answer"] for r in rows for _ in range(G)]
        engine = copy.deepcopy(model).eval()
        torch.manual_seed(iteration_seed(cfg.seed, it))
        with torch.no_grad():
            out = engine.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_p=1.0,
                                  top_k=0, max_new_tokens=cfg.rollout.max_new_tokens, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_scores=True)
        P = ids.shape[1]
        resp = out.sequences[:, P:]
        mask = torch.zeros_like(resp, dtype=torch.float32)
        for b in range(resp.shape[0]):
            for t in range(resp.shape[1]):
                mask[b, t] = 1.0
                if resp[b, t] == tok.eos_token_id:
                    break
        scores = torch.stack(out.scores, 1).float()
        behav = torch.log_softmax(scores, -1).gather(-1, resp[..., None])[..., 0]
        rewards = torch.tensor(task.reward(decode_completions(tok, resp), answers))
        rewards_per_step.append(rewards.mean().item())
        adv = torch.zeros(len(rewards))
        for g in range(n):
            r = rewards[g * G:(g + 1) * G]
            if r.max() > r.min():
                adv[g * G:(g + 1) * G] = (r - r.mean()) / (r.std() + 1e-6)
        full_am = torch.cat([am, mask.long()], 1)
        logits = model(input_ids=out.sequences, attention_mask=full_am,
                       position_ids=(full_am.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
        ratio = torch.exp(logp - torch.where(mask.bool(), behav, torch.zeros_like(behav)))
        A = adv[:, None]
        per_tok = torch.maximum(-A * ratio, -A * ratio.clamp(0.8, 1.2))
        loss = (per_tok * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad()
    return model, rewards_per_step


def test_staleness_zero_bypass_equals_plain_on_policy_loop(make_cfg):
    cfg = make_cfg("algo.old_logp_source=engine", "rollout.dtype=float32", "buffer.staleness=0",
                   "trainer.steps=3", "algo.routing.metrics=false")
    train(cfg)
    ref_model, ref_rewards = plain_on_policy_loop(cfg)
    rows = read_metrics(cfg.run_dir)[1:]
    assert [r["reward/mean"] for r in rows] == pytest.approx(ref_rewards, abs=1e-6)
    got = final_weights(cfg.run_dir, 3)
    ref = ref_model.state_dict()
    assert got.keys() == ref.keys()
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    # Adam moves a coordinate by at most about lr a step (its update is normalised); the two loops sum the same
    # float32 terms in different orders (and the kernels' order differs between AVX2 and AVX-512 builds), so they
    # must agree to 10 bits of that movement: 5.9e-6 on an AVX2 CPU, 1.15e-5 on an AVX-512 one, bound 2.9e-5
    bound = cfg.trainer.steps * cfg.optim.lr * 2.0 ** -10
    assert worst < bound, (worst, bound)
    # and the weights really moved (the comparison is not vacuous)
    from offpolicy_moe.models import load_policy

    init = load_policy(cfg.model, seed=cfg.seed)[0].state_dict()
    assert max((got[k] - init[k]).abs().max().item() for k in init) > 1e-3


def test_exact_delay_batch_consumed_at_t_was_generated_by_version_t_minus_k(make_cfg):
    seen = []
    hooks = [FunctionCallback(on_batch=lambda tr, b: seen.append((tr.step, b.version, b.generated_at, tr.iteration)))]
    k = 2
    cfg = make_cfg(f"buffer.staleness={k}", "trainer.steps=4", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "algo.routing.metrics=false")
    train(cfg, callbacks=hooks)
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    for t, version, generated_at, iteration in seen:
        assert version == max(0, t - k)
        assert generated_at == t and iteration == t + k
    rows = read_metrics(cfg.run_dir)[1:]
    assert [r["offpolicy/staleness_steps"] for r in rows] == [0, 1, 2, 2]
    assert [r["offpolicy/batch_version"] for r in rows] == [0, 0, 0, 1]


# ---------------------------------------------------------------------------------------------------------------
# resume: in-process stop and SIGKILL of a subprocess

RESUME_OVERRIDES = ("buffer.staleness=1", "trainer.steps=5", "trainer.checkpoint_every=1", "rollout.dtype=bfloat16",
                    "algo.routing.replay=r3", "algo.correction.mode=truncate", "trainer.eval_every=2",
                    "trainer.threads=1", "trainer.keep_checkpoints=0")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref") / "run"
    cfg = tiny_config(d, *RESUME_OVERRIDES)
    summary = train(cfg)
    assert summary["status"] == "completed"
    return d


def test_resume_is_bit_identical(reference_run, tmp_path):
    cfg = tiny_config(tmp_path / "run", *RESUME_OVERRIDES)

    def stop(tr, step, m):
        if step == 2:
            raise TrainingStopped("test stop after step 2")

    summary = train(cfg, callbacks=[FunctionCallback(on_step_end=stop)])
    assert summary["status"] == "stopped" and summary["steps"] == 2
    summary = train(cfg, resume=True)
    assert summary["status"] == "completed" and summary["steps"] == 5
    ref, got = final_weights(reference_run, 5), final_weights(cfg.run_dir, 5)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert strip_perf(read_metrics(cfg.run_dir)) == strip_perf(read_metrics(reference_run))


def test_sigkill_then_resume_loses_nothing(reference_run, tmp_path):
    from offpolicy_moe.config.load import to_yaml

    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, *RESUME_OVERRIDES)
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text(to_yaml(cfg))
    proc, cmd, env = train_until_checkpoint(yaml_path, run_dir, 2, timeout=120, tail=2000)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()     # really killed before the end
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    # every generated batch consumed exactly once, in order (k=1: batch of iteration t is trained at step t+1)
    assert [r["offpolicy/generated_at"] for r in rows[1:]] == [0, 1, 2, 3, 4]
    ref, got = final_weights(reference_run, 5), final_weights(run_dir, 5)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert strip_perf(rows) == strip_perf(read_metrics(reference_run))


def test_checkpoint_of_another_model_is_refused_before_training(reference_run, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(reference_run, d)
    cfg = tiny_config(d, *RESUME_OVERRIDES, "model.num_experts=8")
    with pytest.raises(CheckpointError, match="num_experts"):
        Trainer(cfg, resume=True).run()


# ---------------------------------------------------------------------------------------------------------------
# metrics


def test_jsonl_has_documented_keys(reference_run):
    rows = read_metrics(reference_run)
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    for r in rows:
        assert isinstance(r["step"], int)
        undocumented = [k for k in r if not is_documented(k, reward_names=("partial",))]   # TINY: task.reward=partial
        assert not undocumented, undocumented
        assert all(v is None or isinstance(v, float) for k, v in r.items() if k != "step")
    core = [k for k in DOCUMENTED_KEYS if k.split("/")[0] in ("reward", "offpolicy", "perf")
            and k not in ("perf/time_eval_s", "perf/time_eval_sampled_s")] + ["actor/loss", "actor/grad_norm", "actor/clipfrac",
                                                   "actor/ppo_kl", "actor/lr", "actor/nan_skipped",
                                                   "mismatch/k3_kl", "mismatch/extreme_frac",
                                                   "mismatch/k3_kl_r3", "mismatch/k3_kl_no_r3",
                                                   "routing/decision_mismatch", "routing/token_mismatch",
                                                   "mismatch/is_mean"]
    for r in rows[1:]:
        missing = [k for k in core if k not in r]
        assert not missing, missing
        # every second of the step is in one part: the parts and the remainder make the step exactly
        parts = [r[k] for k in STEP_PARTS if k in r] + [r["perf/time_other_s"]]
        assert min(parts) >= -1e-9 and sum(parts) == pytest.approx(r["perf/time_step_s"], rel=1e-12, abs=1e-12)
        assert r["perf/time_generate_s"] + r["perf/time_old_logp_s"] <= r["perf/time_batch_s"] + 1e-9
    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5
    assert "eval/accuracy" in summary["final"] and summary["wall_time_s"] > 0
    assert (reference_run / "config.yaml").exists() and json.loads((reference_run / "env.json").read_text())["torch"]


def test_bf16_engine_mismatch_is_positive_and_r3_lowers_it(make_cfg):
    cfg = make_cfg("rollout.dtype=bfloat16", "algo.routing.replay=r3", "trainer.steps=2", "model.num_experts=8",
                   "rollout.prompts_per_step=8", "rollout.group_size=8", "model.hidden_size=64")
    train(cfg)
    rows = read_metrics(cfg.run_dir)[1:]
    no_r3 = sum(r["mismatch/k3_kl_no_r3"] for r in rows)
    r3 = sum(r["mismatch/k3_kl_r3"] for r in rows)
    flips = sum(r["routing/decision_mismatch"] for r in rows)
    assert no_r3 > 0 and r3 > 0           # bf16 numerics: never exactly equal
    assert flips > 0                       # some expert choices flip between engine and trainer
    assert r3 < no_r3                      # replaying the engine's routes removes the routing part
    # the run used the R3 log-probs
    assert all(r["mismatch/k3_kl"] == r["mismatch/k3_kl_r3"] for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# faults


@pytest.mark.parametrize("overrides,key", [
    (("algo.correction.mode=truncate", "algo.old_logp_source=engine"), "algo.old_logp_source"),
    (("trainer.updates_per_step=64",), "trainer.updates_per_step"),
    (("trainer.on_nan=ignore",), "trainer.on_nan"),
])
def test_invalid_combinations_refused_before_any_compute(make_cfg, overrides, key):
    from offpolicy_moe.config import ConfigError

    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()


def test_zero_steps_refused(make_cfg):
    with pytest.raises(ValueError, match="trainer.steps"):
        Trainer(make_cfg("trainer.steps=0"))


def test_routing_replay_on_dense_model_is_refused(make_cfg):
    cfg = make_cfg("model.preset=tiny-dense", "algo.routing.replay=r3")
    with pytest.raises(ValueError, match="(?i)moe|mixture|dense"):
        Trainer(cfg)
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["proc", "file", "full"])
def test_unusable_run_dir_fails_at_start(make_cfg, tmp_path, where, monkeypatch):
    if where == "proc":
        cfg = make_cfg(run_dir="/proc/offpolicy_moe_test/run")
    elif where == "file":
        f = tmp_path / "a_file"
        f.write_text("x")
        cfg = make_cfg(run_dir=f)
    else:
        cfg = make_cfg("trainer.min_free_mb=1e12")
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the run folder was checked")

    monkeypatch.setattr("offpolicy_moe.trainer.build.load_policy", no_model)
    with pytest.raises(RunDirError, match="run folder"):   # before any model is built
        Trainer(cfg)


def test_existing_run_needs_resume(reference_run):
    cfg = tiny_config(reference_run, *RESUME_OVERRIDES)
    with pytest.raises(RunDirError, match="--resume"):
        Trainer(cfg)


@pytest.fixture
def nan_loss():
    from offpolicy_moe.losses import get_policy_loss, register_policy_loss, unregister_policy_loss

    grpo = get_policy_loss("grpo")
    calls = {"n": 0}

    @register_policy_loss("test_nan_on_second", overwrite=True)
    def nan_on_second(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None,
                      num_seqs=None, norm_length=None):
        calls["n"] += 1
        loss, m = grpo(logp, old_logp, advantages, mask, agg=agg, weights=weights, num_tokens=num_tokens,
                       num_seqs=num_seqs, norm_length=norm_length)
        return (loss * float("nan") if calls["n"] == 2 else loss), m

    yield "test_nan_on_second"
    unregister_policy_loss("test_nan_on_second")


def test_nan_loss_is_skipped_and_counted(make_cfg, nan_loss):
    seen = {}

    def snap(tr, step, m):
        seen[step] = {k: v.detach().clone() for k, v in tr.unwrapped.state_dict().items()}

    cfg = make_cfg(f"algo.loss.name={nan_loss}", "trainer.on_nan=skip", "trainer.steps=3")
    summary = train(cfg, callbacks=[FunctionCallback(on_step_end=snap)])
    assert summary["status"] == "completed"
    rows = read_metrics(cfg.run_dir)[1:]
    assert [r["actor/nan_skipped"] for r in rows] == [0, 1, 1]
    assert [r["actor/updates"] for r in rows] == [1, 1, 2]
    assert all(torch.equal(seen[1][k], seen[2][k]) for k in seen[1])      # the NaN step changed nothing
    assert all(torch.isfinite(v).all() for v in seen[3].values())


def test_nan_loss_stops_naming_the_step(make_cfg, nan_loss):
    cfg = make_cfg(f"algo.loss.name={nan_loss}", "trainer.on_nan=stop", "trainer.steps=3")
    with pytest.raises(NonFiniteError, match="step 2"):
        train(cfg)
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert summary["status"] == "diverged" and "step 2" in summary["error"]


def test_gradient_checkpointing_with_r3_gives_the_same_training(make_cfg):
    base = ("rollout.dtype=bfloat16", "algo.routing.replay=r3", "trainer.steps=2", "algo.routing.metrics=false")
    a = make_cfg(*base)
    b = make_cfg(*base, "model.gradient_checkpointing=true")
    train(a)
    train(b)
    wa, wb = final_weights(a.run_dir, 2), final_weights(b.run_dir, 2)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6
    assert strip_perf(read_metrics(a.run_dir))[-1]["actor/grad_norm"] > 0


@pytest.mark.parametrize("loss", ["m2po", "grpo_seqmean"])
def test_gradient_accumulation_does_not_change_the_update(make_cfg, loss):
    """Global counts (and M2PO's global selection) make 1 micro-batch == 4 micro-batches of the same mini-batch."""
    opts = ["algo.loss.name=m2po", "algo.loss.options.tau=0.001"] if loss == "m2po" else \
        ["algo.loss.agg=seq-mean-token-mean"]
    base = ("buffer.staleness=2", "trainer.steps=4", "trainer.updates_per_step=2", "algo.routing.metrics=false",
            "rollout.dtype=float32", *opts)
    a = make_cfg(*base, "trainer.grad_accum=1")
    b = make_cfg(*base, "trainer.grad_accum=4")
    train(a)
    train(b)
    wa, wb = final_weights(a.run_dir, 4), final_weights(b.run_dir, 4)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    ra, rb = read_metrics(a.run_dir), read_metrics(b.run_dir)
    assert [r.get("reward/mean") for r in ra] == [r.get("reward/mean") for r in rb]
    if loss == "m2po":   # the budget really masked tokens, so the global selection was exercised
        assert max(r.get("m2po/masked_frac", 0.0) for r in ra) > 0


def test_bounded_buffer_in_the_trainer(make_cfg):
    cfg = make_cfg("buffer.mode=bounded", "buffer.staleness=1", "buffer.max_delay=3", "trainer.steps=5",
                   "algo.routing.metrics=false")
    summary = train(cfg)
    assert summary["status"] == "completed"
    rows = read_metrics(cfg.run_dir)[1:]
    assert all(r["offpolicy/staleness_steps"] <= 1 for r in rows)
    gens = [r["offpolicy/generated_at"] for r in rows]
    assert len(set(gens)) == len(gens)            # arrival order, never twice
    assert summary["iterations"] >= 5 + rows[-1]["offpolicy/dropped"]


def test_proximal_old_logp_is_recomputed_at_consumption(make_cfg):
    """Decoupled PPO: with one update per batch the PPO ratio is exactly 1 (old = current weights), even with
    staleness 2; the staleness then shows in the behaviour weights pi_prox / mu instead."""
    cfg = make_cfg("algo.old_logp_source=proximal", "buffer.staleness=2", "trainer.steps=4",
                   "rollout.dtype=float32", "algo.routing.metrics=false")
    train(cfg)
    rows = read_metrics(cfg.run_dir)[1:]
    assert all(abs(r["actor/ppo_kl"]) < 1e-6 for r in rows)
    assert max(r["mismatch/k3_kl"] for r in rows[2:]) > 1e-4       # pi_prox vs stale mu: real distance
