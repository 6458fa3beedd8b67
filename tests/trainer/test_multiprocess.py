"""Multi-process equivalence: one optimizer update on a FIXED batch gives the same parameters (to 1e-6) with one
process on the whole batch and with two gloo processes on halves of it.

The batch is generated once here (R3: the engine's recorded routes travel with it), saved with
``RolloutBatch.state_dict``; each worker process (this file run as a script, rank/world from the environment as
torchrun would set them) loads the groups ``g`` with ``g % 2 == rank`` — whole groups, as ``Trainer.generate``
divides prompts — and runs the trainer's own update (:meth:`Trainer.update`) for every algorithm.  Global token
counts (all-reduced), the global M2PO selection (all-gathered) and DDP's gradient average must together make the
two-process update equal the one-process one.  PR2: the predictors' gradients are all-reduced, so both processes
end with identical predictors.

Also here (they guard the speed work that came with the multi-process one): the fused on-policy old-log-prob path
equals the recompute pass, the ``accelerate launch --cpu`` relaunch detection, and the engine's own sampling loop
against ``model.generate``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from offpolicy_moe.trainer.launch import cpu_launch_processes
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import rollout_engine, run_fused_or_not, tiny_config, tiny_policy

REPO = Path(__file__).resolve().parents[2]

# GRPO+TIS, GSPO and M2PO (global selection), all with R3 replay; PR2 for the predictor consistency check.
ALGOS = {
    "grpo_tis": ["preset=[grpo,tis,r3]"],
    "gspo": ["preset=[gspo,r3]"],
    "m2po": ["preset=[m2po,r3]", "algo.loss.options.tau=0.0005"],   # small tau: the selection really masks tokens
    # no replay: the update forward runs each group's prompt once (trainer.share_prompt) under DDP
    "grpo_shared_prompt": ["preset=[grpo]"],
}
PR2 = ["preset=[grpo,pr2]", "algo.routing.pr2_feature_sample_rate=1.0"]
COMMON = ["trainer.sft_warmup_steps=0", "trainer.threads=1", "optim.lr=1e-3", "rollout.prompts_per_step=4",
          "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.dtype=bfloat16", "algo.routing.metrics=false",
          "trainer.mismatch_metrics=false"]


def _cfg(run_dir, algo_overrides):
    return tiny_config(run_dir, *COMMON, *algo_overrides)


def _updated_params(run_dir, overrides, batch, init_state):
    """Parameters (and PR2 predictor parameters) after one ``Trainer.update`` on ``batch`` from ``init_state``."""

    tr = Trainer(_cfg(run_dir, overrides))
    tr.unwrapped.load_state_dict(init_state)
    if tr.predictors is not None:
        tr.step = batch.version + 1    # a stale batch: PR2 trains its predictors from the first mini-batch on
    metrics = tr.update(batch)
    assert metrics["actor/updates"] == 1.0, metrics
    out = {f"model.{k}": v.detach().clone() for k, v in tr.unwrapped.named_parameters()}
    if tr.predictors is not None:
        out.update({f"pr2.{k}": v.detach().clone() for k, v in tr.predictors.named_parameters()})
    return out, metrics


def _half(batch, rank, world):
    groups = batch.group_ids
    rows = torch.nonzero(groups % world == rank).flatten()
    return batch.index_select(rows)


def worker(batch_path: str, out_path: str) -> None:
    """Run in each of the two processes (RANK / WORLD_SIZE / MASTER_* set by the test)."""
    from offpolicy_moe.rollout.batch import RolloutBatch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    saved = torch.load(batch_path, weights_only=False)
    results = {}
    for name, overrides in list(ALGOS.items()) + [("pr2", PR2)]:
        key = "pr2_batch" if name == "pr2" else "batch"
        batch = _half(RolloutBatch.from_state_dict(saved[key]), rank, world)
        run_dir = Path(out_path).parent / f"rank{rank}_{name}"
        results[name], m = _updated_params(run_dir, overrides, batch, saved["init"])
        if name == "m2po":
            results["m2po_masked"] = m.get("m2po/masked_frac")
    torch.save(results, out_path)


def _fixed_batches(tmp_path):
    """One R3 batch (engine routes recorded, old_logp recomputed with replay) and one PR2 batch."""

    tr = Trainer(_cfg(tmp_path / "gen", ALGOS["grpo_tis"]))
    init = {k: v.detach().clone() for k, v in tr.unwrapped.state_dict().items()}
    batch = tr.source.generate(0)
    batch = tr.stage.prepare(batch, current=tr.step).batch
    assert batch.routes is not None and batch.old_logp is not None
    # rewards that vary within groups (an untrained model earns none): every other sequence "answers" its own text
    batch.answers = [c if i % 2 == 0 else a for i, (a, c) in enumerate(zip(batch.answers, batch.completions))]
    # make the batch look stale (old weights != current): ratios off 1, so clipping and the M2PO mask act
    noise = torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logp = (batch.old_logp + 0.1 * noise) * batch.response_mask
    tr2 = Trainer(_cfg(tmp_path / "gen_pr2", PR2))
    tr2.unwrapped.load_state_dict(init)
    tr2.publish(0)
    pr2_batch = tr2.source.generate(0)
    pr2_batch = tr2.stage.prepare(pr2_batch, current=tr2.step).batch
    pr2_batch.answers = [c if i % 2 == 0 else a for i, (a, c) in enumerate(zip(pr2_batch.answers,
                                                                                pr2_batch.completions))]
    assert pr2_batch.pr2_features is not None and pr2_batch.pr2_features.num_tokens > 0
    return batch, pr2_batch, init


def test_two_processes_match_one_process(tmp_path, free_port):
    torch.set_num_threads(1)
    batch, pr2_batch, init = _fixed_batches(tmp_path)
    # the halves hold whole groups and different sequences
    h0, h1 = _half(batch, 0, 2), _half(batch, 1, 2)
    assert h0.size + h1.size == batch.size and h0.size > 0 and h1.size > 0
    batch_path = tmp_path / "batch.pt"
    torch.save({"batch": batch.state_dict(), "pr2_batch": pr2_batch.state_dict(), "init": init}, batch_path)

    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("ACCELERATE_USE_CPU", None)
    procs = []
    for rank in range(2):
        out = tmp_path / f"out{rank}.pt"
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.trainer.test_multiprocess", str(batch_path), str(out)],
                                       cwd=REPO, env=e,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))

    # meanwhile: the one-process reference on the whole batch
    ref = {}
    for name, overrides in ALGOS.items():
        ref[name], _ = _updated_params(tmp_path / f"single_{name}", overrides, batch, init)
    ref["pr2"], _ = _updated_params(tmp_path / "single_pr2", PR2, pr2_batch, init)

    outs = []
    for p, out in procs:
        log, _ = p.communicate(timeout=180)
        assert p.returncode == 0, log[-4000:]
        outs.append(torch.load(out, weights_only=False))

    assert outs[0]["m2po_masked"] is not None and outs[0]["m2po_masked"] > 0, "M2PO selection masked nothing"
    for name in ALGOS:
        moved = max((ref[name][k] - init[k.removeprefix("model.")]).abs().max().item() for k in ref[name])
        assert moved > 1e-5, f"{name}: the update did not move the parameters"
        for rank in range(2):
            got = outs[rank][name]
            assert got.keys() == ref[name].keys()
            for k in ref[name]:
                torch.testing.assert_close(got[k], ref[name][k], rtol=0, atol=1e-6,
                                           msg=lambda s, k=k, r=rank: f"{name} rank {r} {k}: {s}")
    # PR2: policy parameters equal one process; predictors identical on both processes and moved
    for k in ref["pr2"]:
        torch.testing.assert_close(outs[0]["pr2"][k], outs[1]["pr2"][k], rtol=0, atol=0)
        if k.startswith("model."):
            torch.testing.assert_close(outs[0]["pr2"][k], ref["pr2"][k], rtol=0, atol=1e-6)
    pred_keys = [k for k in ref["pr2"] if k.startswith("pr2.")]
    assert pred_keys and any(outs[0]["pr2"][k].abs().max() > 0 for k in pred_keys)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------------------------------------------------------
# the single-process fast path: on-policy, one update → old_logp from the update forward (no recompute pass)

def test_fused_old_logp_equals_recompute_pass(tmp_path):
    torch.set_num_threads(1)
    for name, extra in (("none_routing_metrics", ["algo.routing.metrics=true", "trainer.mismatch_metrics=true"]),
                        ("none_no_counterfactual", ["algo.routing.metrics=true", "trainer.mismatch_metrics=false"]),
                        ("r3", ["preset=[grpo,r3]", "algo.routing.metrics=false"])):
        # share_prompt off: the reference's recompute pass records routes (a plain forward) while its update would
        # share prompts; the two paths agree only to float rounding (tests/trainer/test_shared_prompt.py)
        common = ["buffer.staleness=0", "trainer.updates_per_step=1", "trainer.sft_warmup_steps=0",
                  "rollout.dtype=bfloat16", "trainer.steps=2", "trainer.share_prompt=false", *extra]
        fused_rows, fused_w = run_fused_or_not(tiny_config(tmp_path / f"{name}_fused", *common), True)
        ref_rows, ref_w = run_fused_or_not(tiny_config(tmp_path / f"{name}_ref", *common), False)
        assert [r.keys() for r in fused_rows] == [r.keys() for r in ref_rows]
        assert fused_rows == ref_rows, name
        if name.startswith("none"):
            assert "routing/decision_mismatch" in fused_rows[-1] and "mismatch/k3_kl_no_r3" in fused_rows[-1]
            assert ("mismatch/k3_kl_r3" in fused_rows[-1]) == (name == "none_routing_metrics")
        else:
            assert "mismatch/k3_kl_r3" in fused_rows[-1]
        for k in ref_w:
            assert torch.equal(fused_w[k], ref_w[k]), (name, k)


# ---------------------------------------------------------------------------------------------------------------
# accelerate launch --cpu without mpirun starts one process: detected and re-run as N torchrun processes

def test_cpu_launch_detection(tmp_path):

    launched = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    argv = ["python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "--cpu", "-m", "offpolicy_moe",
            "train", "x.yaml"]
    assert cpu_launch_processes(launched, argv) == 2
    assert cpu_launch_processes(launched, [*argv[:3], "--num_processes=3", *argv[5:]]) == 3
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 4\nuse_cpu: true\n")
    assert cpu_launch_processes(launched, ["accelerate", "launch", "--config_file", str(cfg), "-m", "x"]) == 4
    # the training command's own flags are not the launcher's
    assert cpu_launch_processes(launched, ["accelerate", "launch", "--cpu", "train.py", "--num_processes", "5"]) == 0
    # a real multi-process launch (torchrun / mpirun) or a single process: nothing to do
    assert cpu_launch_processes(dict(launched, RANK="0", WORLD_SIZE="2"), argv) == 0
    assert cpu_launch_processes(dict(launched, PMI_SIZE="2"), argv) == 0
    assert cpu_launch_processes({k: v for k, v in launched.items() if k != "MASTER_ADDR"}, argv) == 0
    assert cpu_launch_processes(dict(launched, ACCELERATE_USE_CPU="False"), argv) == 0
    assert cpu_launch_processes(launched, [*argv[:3], "--num_processes", "1", *argv[5:]]) == 0
    assert cpu_launch_processes(launched, ["python", "-m", "offpolicy_moe", "train"]) == 0


# ---------------------------------------------------------------------------------------------------------------
# the engine's own sampling loop draws what model.generate draws

def test_native_sampler_matches_generate():
    from offpolicy_moe.config.schema import TaskConfig
    from offpolicy_moe.rollout.engine import HFRolloutEngine
    from offpolicy_moe.tasks import make_task

    torch.set_num_threads(1)
    task = make_task(TaskConfig())
    model, tok = tiny_policy(num_layers=1, seed=3, task=task)
    rows = task.sample_prompts(0, 6)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    for dtype, temp, top_p, record, bs in (("float32", 1.0, 1.0, True, 64), ("float32", 0.7, 0.9, False, 64),
                                           ("bfloat16", 1.3, 0.8, False, 10), ("float32", 1.0, 1.0, False, 7)):
        out = {}
        for sampler in ("hf", "native"):
            # transformers' SDPA kernel in the decode steps too (the single-query path: test_decode_attention.py)
            eng = rollout_engine(model, tok, dtype=dtype, max_new_tokens=5, temperature=temp, top_p=top_p,
                                  record_routes=record, sampler=sampler, batch_size=bs, decode_attention="sdpa")
            out[sampler] = eng.generate(prompts, answers, group_size=4, seed=11)
        a, b = out["hf"], out["native"]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
        assert torch.equal(a.response_mask, b.response_mask) and a.completions == b.completions
        # the native loop prefills one row per group (its cache and recorded routes repeated): float rounding only
        torch.testing.assert_close(a.behav_logp, b.behav_logp, rtol=0, atol=1e-5)
        if record:    # the same expert choices (no near-tie flips at this seed), the samples of a prompt agree
            assert torch.equal(a.routes.ids, b.routes.ids)
            P = b.prompt_len
            prompt_routes = b.routes.ids[:, :P].view(6, 4, P, *b.routes.ids.shape[2:])
            assert torch.equal(prompt_routes, prompt_routes[:, :1].expand_as(prompt_routes))
        assert torch.isfinite(b.behav_logp).all() and (b.behav_logp <= 0).all()
