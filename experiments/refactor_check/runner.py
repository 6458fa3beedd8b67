"""One tiny case of compare.py, in whatever ``offpolicy_moe`` is first on ``sys.path``:
``python runner.py CASE OUT`` writes OUT/metrics.json (metric rows without timings, the summary) and OUT/w.pt (every
checkpoint and the final weights); ``python runner.py --list x`` prints the case names."""
import json, sys, os, io, contextlib, traceback
from pathlib import Path
import torch

def timing(key: str) -> bool:
    """A metric measured on the clock (left out of the comparison): ``perf/*``, ``*_s`` and the worker's blocked
    share of its wall time."""
    return key.startswith("perf/") or key.endswith("_s") or key == "async/worker_blocked_share"


def main():
    case, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    import offpolicy_moe
    sys.path.insert(0, str(Path(offpolicy_moe.__file__).parents[1]))   # that tree's tests/ (tests.tiny)
    from tests.tiny import TINY
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.trainer.trainer import Trainer
    from offpolicy_moe.run import fault_injection as faults
    from offpolicy_moe.run.checkpoint import load_checkpoint

    BASE = [*TINY, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.threads=1"]
    CASES = {
        "base": [],
        "unfused": ["trainer.fuse_old_logp=false"],
        "stale1": ["buffer.staleness=1", "trainer.steps=4"],
        "truncate": ["buffer.staleness=1", "algo.correction.mode=truncate", "trainer.steps=4"],
        "mask_seq": ["buffer.staleness=1", "algo.correction.mode=mask", "algo.correction.level=sequence", "trainer.steps=4"],
        "opsm": ["buffer.staleness=1", "algo.correction.mode=opsm", "trainer.steps=4"],
        "kl": ["algo.kl.coef=0.1", "buffer.staleness=1", "trainer.steps=4"],
        "engine_src": ["algo.old_logp_source=engine", "buffer.staleness=1", "trainer.mismatch_metrics=true"],
        "prox_exact": ["algo.old_logp_source=proximal", "buffer.staleness=1", "trainer.updates_per_step=2"],
        "prox_loglin": ["algo.old_logp_source=proximal", "algo.proximal_logp=loglinear", "buffer.staleness=1",
                        "trainer.updates_per_step=2", "trainer.grad_accum=2"],
        "prox_loglin_trunc": ["algo.old_logp_source=proximal", "algo.proximal_logp=loglinear", "buffer.staleness=1",
                            "algo.correction.mode=truncate", "trainer.updates_per_step=2"],
        "pr2": ["algo.routing.replay=pr2", "buffer.staleness=1", "trainer.grad_accum=2", "algo.routing.drift_metrics=true"],
        "r3": ["algo.routing.replay=r3", "trainer.mismatch_metrics=true"],
        "r2": ["algo.routing.replay=r2", "buffer.staleness=1"],
        "dyn": ["algo.dynamic_sampling=drop", "buffer.staleness=1"],
        "skipzero": ["trainer.skip_zero_advantage=true", "buffer.staleness=1", "trainer.grad_accum=2"],
        "m2po": ["algo.loss.name=m2po", "buffer.staleness=1", "trainer.grad_accum=2"],
        "bounded": ["buffer.mode=bounded", "buffer.staleness=2", "trainer.steps=4"],
        "async": ["buffer.mode=async", "rollout.workers=1", "buffer.staleness=0"],
        "async2": ["buffer.mode=async", "rollout.workers=2", "buffer.staleness=0", "trainer.steps=4"],
        "ray": ["buffer.mode=async", "rollout.backend=ray", "rollout.workers=1", "buffer.staleness=0"],
        "eval": ["trainer.eval_every=2"],
    }
    STAGES = {"generation": [], "old_logp": ["trainer.fuse_old_logp=false"], "metrics": [],
              "reference": ["algo.kl.coef=0.1"], "loss": [], "gradients": [], "optimizer": [],
              "evaluation": ["trainer.eval_every=2"], "generation/async": ["buffer.mode=async", "rollout.workers=1"],
              "old_logp/async": ["buffer.mode=async", "rollout.workers=1"]}
    for st, ov in STAGES.items():
        for pol in ("skip", "stop"):
            CASES[f"nan:{st}:{pol}"] = [*ov, f"trainer.on_nan={pol}"]
    CASES["resume"] = ["buffer.staleness=1", "algo.correction.mode=truncate", "trainer.steps=4"]
    CASES["resume_async"] = ["buffer.mode=async", "rollout.workers=1", "buffer.staleness=0", "trainer.steps=4"]

    if case == "--list":
        print(" ".join(CASES)); return

    def make(overrides, steps=None):
        cfg = load_config(None, BASE + CASES[case] + overrides)
        cfg.run_dir = str(out / "run")
        return cfg

    result = {}
    def go(cfg, resume=False):
        tr = Trainer(cfg, resume=resume)
        try:
            tr.run()
            result["error"] = None
        except BaseException as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        return tr

    if case.startswith("nan:"):
        stage = case.split(":")[1].split("/")[0]
        faults.disarm(); faults.arm(stage, 2)
        tr = go(make([]))
        faults.disarm()
    elif case.startswith("resume"):
        cfg = make(["trainer.steps=2"])
        go(cfg)
        cfg = make([])
        tr = go(cfg, resume=True)
    else:
        tr = go(make([]))
    run = out / "run"
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    rows = [{k: v for k, v in r.items() if not timing(k)} for r in rows]
    summ = json.loads((run / "summary.json").read_text())
    for k in ("wall_time_s", "run_dir"):
        summ.pop(k, None)
    summ["final"] = {k: v for k, v in summ.get("final", {}).items() if not timing(k)}
    if summ.get("error"):
        summ["error"] = summ["error"].replace(str(out), "OUT")
    json.dump({"rows": rows, "summary": summ}, open(out / "metrics.json", "w"), sort_keys=True)
    ckpts = {}
    for d in sorted((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else []:
        ck = load_checkpoint(d)
        ckpts[d.name] = {"model": ck.model, "optimizer": ck.state.get("optimizer"), "modules": ck.modules,
                         "state": {k: v for k, v in ck.state.items() if k not in ("optimizer", "last_metrics", "metrics_offset")},
                         "last_metrics": {k: v for k, v in ck.state.get("last_metrics", {}).items() if not timing(k)}}
    torch.save({"final": {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}, "ckpts": ckpts}, out / "w.pt")
    print("done", case, result["error"])


if __name__ == "__main__":
    main()
