"""The same training job run synchronously and asynchronously (``buffer.mode=async``, docs/async.md): trained
tokens per second and their ratio, median over interleaved pairs, and where the time goes.

* sync:  ``buffer.mode=fixed`` at the same staleness ``k`` — generate, old-log-prob pass and update one after the
  other in one process (``trainer.threads = --sync-threads``, default 1);
* async: ``buffer.mode=async`` with ``--workers`` rollout worker processes (``rollout.worker_threads=1``) beside a
  trainer with ``trainer.threads = --async-trainer-threads``.

Trained tokens/s = response tokens of the steps after the first ``--skip`` (process start-up, the first weights)
and before the last (which also evaluates and checkpoints) divided by the wall time from the end of step ``--skip``
to the end of the step before the last.  The pairs run alternately
sync/async and async/sync so that a change of machine load hits both.  The async breakdown: trainer waiting for
data, workers waiting for weights (an order they may start), weight publishing, worker generation; the sync one:
generate / old-log-prob / update time.  ``uptime`` load averages are recorded before and after.

On a shared machine the wall-clock ratio is capped by the CPU share the job gets: the script first measures that
cap (``parallel_ceiling``: two busy processes against one), and prints the CPU-time ratio (sync CPU seconds per
token over the busier async process's) beside the wall ratio: the wall ratio on a machine with a free core per
process.

    python experiments/bench/bench_async.py --pairs 3 --steps 12 --staleness 1

``--backend ray``: the pairs are the local asynchronous pipeline against the same job with its workers as Ray
actors (``rollout.backend=ray``, a Ray cluster on this machine unless ``RAY_ADDRESS`` names one), interleaved
local/ray and ray/local: the Ray backend's overhead.  ``--publish-cost``: the cost of one published version against
model size on the Ray backend: ``ray.put`` of the weights by the trainer, and an actor's pull of them from the object
store plus the copy into its engine (median over ``--repeats``), for the ``--hidden`` x ``--layers`` sizes given.

    python experiments/bench/bench_async.py --backend ray --pairs 3 --steps 12 --staleness 1
    python experiments/bench/bench_async.py --publish-cost --sizes 64x2 256x4 512x8 1024x8
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from offpolicy_moe.config.load import load_config
from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.ray_actor import RolloutActor, WeightRegistry, encode_weights
from offpolicy_moe.rollout.messages import Order, WorkerSpec
from offpolicy_moe.tasks import make_task
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer


def _config(args, mode: str, run_dir: str, backend: str = "local"):
    threads = args.sync_threads if mode == "fixed" else args.async_trainer_threads
    return load_config(None, [f"rollout.backend={backend}",
        f"run_dir={run_dir}", f"buffer.mode={mode}", f"buffer.staleness={args.staleness}",
        f"trainer.steps={args.steps}", "trainer.sft_warmup_steps=0", "trainer.eval_every=0",
        "trainer.checkpoint_every=0", "logging.progress=false", "logging.loggers=[jsonl]",
        f"trainer.threads={threads}", f"rollout.workers={args.workers}", "rollout.worker_threads=1",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}", "algo.correction.mode=truncate",
        f"rollout.update_in_flight={str(args.update_in_flight).lower()}", *args.set])


def _busy(n: int, go=None, out=None) -> float:
    """Seconds a pure-python loop of ``n`` additions takes (started when all parties reach the barrier ``go``;
    reported on ``out``)."""
    if go is not None:
        go.wait()
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    took = time.perf_counter() - t0
    if out is not None:
        out.put(took)
    return took


def parallel_ceiling(n: int = 5_000_000) -> float:
    """How much two processes get done together relative to one alone on this machine right now: the same
    pure-python loop once alone, then in two processes at once; ``2 * t_alone / t_pair`` (about 2 on an idle
    2-core machine, about 1 when the job's CPU share is capped, e.g. a machine shared through CPU cgroups).  The
    best wall-clock ratio the async pipeline (two busy processes) can reach is about this."""
    ctx = mp.get_context("spawn")
    alone = _busy(n)
    go, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_busy, args=(n, go, out)) for _ in range(2)]
    for q in procs:
        q.start()
    go.wait(timeout=600)            # both children imported and ready: they start together
    pair = max(out.get(timeout=600) for _ in procs)
    for q in procs:
        q.join()
    return 2 * alone / pair


def cpu_ratio(sync: dict, asyn: dict) -> float:
    """Sync CPU seconds per trained token over the busier async process's (trainer or worker; a single worker
    assumed) CPU seconds per token: what the wall-clock ratio becomes when each process has a core of its own."""
    busiest = max(asyn["trainer_cpu_s"], asyn["worker_cpu_s"])
    return (sync["trainer_cpu_s"] / sync["tokens"]) / (busiest / asyn["tokens"])


def run_once(args, mode: str, backend: str = "local") -> dict:
    """One run; trained tokens/s over the steps after ``--skip`` and the time breakdown."""
    ends, cpu, tokens, metrics = [], [], [], []

    def on_batch(trainer, batch):
        tokens.append(batch.num_tokens())

    def on_step_end(trainer, step, m):
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
        metrics.append(dict(m))

    with tempfile.TemporaryDirectory(prefix=f"bench_async_{mode}_") as d:
        summary = Trainer(_config(args, mode, d, backend), callbacks=[FunctionCallback(on_batch=on_batch, on_step_end=on_step_end)]).run()
    if summary["status"] != "completed":
        raise RuntimeError(f"{mode} run ended {summary['status']}: {summary.get('error')}")
    s = args.skip          # steps s+1 .. N-1: the last step also evaluates and checkpoints, left out
    wall = ends[-2] - ends[s - 1]
    window = metrics[s:-1]

    def total(key: str) -> float:
        return sum(m.get(key, 0.0) for m in window)

    out = {"tokens_per_s": sum(tokens[s:-1]) / wall, "wall_s": wall, "steps_timed": len(window),
           "tokens": sum(tokens[s:-1]), "trainer_cpu_s": cpu[-2] - cpu[s - 1]}
    if mode == "async":
        out.update({k: total(f"async/{k}") for k in ("trainer_wait_s", "worker_wait_s", "weight_sync_s",
                                                     "worker_generate_s", "worker_cpu_s")})
        out["update_s"] = total("perf/time_update_s")
        out["old_logp_s"] = total("perf/time_old_logp_s")
        out["staleness_mean"] = statistics.fmean(m["offpolicy/staleness_steps"] for m in window)
        out["staleness_max"] = max(m["offpolicy/staleness_max"] for m in window)
        out["dropped"] = window[-1]["offpolicy/dropped"]
    else:
        out.update({"generate_s": total("perf/time_generate_s"), "old_logp_s": total("perf/time_old_logp_s"),
                    "update_s": total("perf/time_update_s")})
    return out


def ray_pairs(args) -> None:
    """``--backend ray``: interleaved pairs of the local asynchronous pipeline and the Ray backend on the same job;
    the median ratio of their trained tokens/s (1 = no overhead)."""
    load_before = os.getloadavg()
    pairs = []
    for i in range(args.pairs):
        order = ("local", "ray") if i % 2 == 0 else ("ray", "local")
        res = {b: run_once(args, "async", b) for b in order}
        ratio = res["ray"]["tokens_per_s"] / res["local"]["tokens_per_s"]
        pairs.append({"local": res["local"], "ray": res["ray"], "ratio": ratio})
        print(f"pair {i} ({'/'.join(order)}): local {res['local']['tokens_per_s']:.0f} tok/s, ray "
              f"{res['ray']['tokens_per_s']:.0f} tok/s, ray/local {ratio:.3f}  (load {os.getloadavg()[0]:.1f})",
              flush=True)
    load_after = os.getloadavg()
    ratios = [q["ratio"] for q in pairs]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_before": load_before, "load_after": load_after, "args": vars(args),
              "median_ratio": statistics.median(ratios), "pairs": pairs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"median ray/local trained-tokens/s ratio: {statistics.median(ratios):.3f} over {len(pairs)} pairs "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; k={args.staleness}, {args.workers} worker(s), load "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f})")
    for b in ("local", "ray"):
        m = statistics.median
        print(f"  {b:5s}: median over pairs of wall_s {m(q[b]['wall_s'] for q in pairs):.2f}, trainer_wait_s "
              f"{m(q[b]['trainer_wait_s'] for q in pairs):.2f}, weight_sync_s {m(q[b]['weight_sync_s'] for q in pairs):.3f}, "
              f"worker_generate_s {m(q[b]['worker_generate_s'] for q in pairs):.2f}")
    print(f"written {args.out}")


def publish_cost(args) -> None:
    """``--publish-cost``: per model size, the trainer's ``ray.put`` of one version and one actor's pull and engine
    copy of it (the object-store path of rollout.backend=ray), median over ``--repeats``."""
    import ray      # the optional extra, imported only by this mode

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, logging_level="ERROR",
             configure_logging=False)
    rows = []
    for size in args.sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        a = argparse.Namespace(**{**vars(args), "hidden": hidden, "layers": layers, "prompts": 1, "group": 1,
                                  "max_new_tokens": 1})
        cfg = _config(a, "async", tempfile.mkdtemp(prefix="bench_publish_"), "ray")
        model, _ = load_policy(cfg.model, seed=cfg.seed, task=make_task(cfg.task))
        state = {k: v.detach() for k, v in model.state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        registry = ray.remote(WeightRegistry).options(num_cpus=0).remote()
        spec = WorkerSpec(cfg=cfg, index=0, rank=0, world=1, parent_pid=os.getpid())
        actor = ray.remote(RolloutActor).options(num_cpus=1).remote(spec, registry)
        ray.get(actor.ready.remote())
        put_s, pull_s = [], []
        for v in range(1, args.repeats + 1):
            for t in state.values():
                t.add_(0.0)
            t0 = time.perf_counter()
            ref = ray.put(encode_weights(state))
            ray.get(registry.set.remote(v, [ref]))
            put_s.append(time.perf_counter() - t0)
            _, _, _, timings = ray.get(actor.generate.remote(Order(iteration=0, seed=0, min_version=0), v, [ref]))
            pull_s.append(timings["sync_s"])
        ray.kill(actor)
        ray.kill(registry)
        row = {"hidden": hidden, "layers": layers, "mbytes": nbytes / 2**20, "put_s": statistics.median(put_s),
               "pull_and_copy_s": statistics.median(pull_s)}
        rows.append(row)
        print(f"{hidden}x{layers}: {row['mbytes']:.1f} MiB, put {row['put_s'] * 1e3:.1f} ms, actor pull+copy "
              f"{row['pull_and_copy_s'] * 1e3:.1f} ms", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(), "rows": rows,
              "args": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"written {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="interleaved sync/async pairs")
    p.add_argument("--steps", type=int, default=12, help="trained steps per run")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--staleness", type=int, default=1, help="buffer.staleness k (both modes)")
    p.add_argument("--workers", type=int, default=1, help="rollout.workers of the async runs")
    p.add_argument("--sync-threads", type=int, default=1,
                   help="trainer.threads of the sync runs (1: the same threads per process as async; on the tiny "
                        "model two intra-op threads slow the sync loop down on a shared machine)")
    p.add_argument("--async-trainer-threads", type=int, default=1, help="trainer.threads of the async runs")
    p.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    p.add_argument("--group", type=int, default=8, help="rollout.group_size")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64, help="model.hidden_size")
    p.add_argument("--layers", type=int, default=2, help="model.num_layers")
    p.add_argument("--update-in-flight", action="store_true", help="rollout.update_in_flight=true (async)")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for both modes")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: sync against the local async pipeline (default); ray: the local async pipeline "
                        "against rollout.backend=ray")
    p.add_argument("--publish-cost", action="store_true", help="measure one published version's cost per model size")
    p.add_argument("--sizes", nargs="*", default=["64x2", "256x4", "512x8"], help="--publish-cost: HIDDENxLAYERS")
    p.add_argument("--repeats", type=int, default=5, help="--publish-cost: versions published per size")
    p.add_argument("--out", default=None, help="JSON report (default: experiments/results/speed/bench_async"
                                               "[_ray|_publish].json)")
    args = p.parse_args()
    if args.out is None:
        tail = "_publish" if args.publish_cost else "_ray" if args.backend == "ray" else ""
        args.out = f"experiments/results/speed/bench_async{tail}.json"
    if args.publish_cost:
        publish_cost(args)
        return
    if args.skip < 1 or args.steps <= args.skip + 2:
        p.error("need --skip >= 1 and --steps > --skip + 2")
    if args.backend == "ray":
        ray_pairs(args)
        return

    load_before = os.getloadavg()
    ceiling = [parallel_ceiling()]
    print(f"parallel ceiling of this machine now (two busy processes vs one): {ceiling[0]:.2f}", flush=True)
    pairs = []
    for i in range(args.pairs):
        order = ("fixed", "async") if i % 2 == 0 else ("async", "fixed")
        res = {mode: run_once(args, mode) for mode in order}
        ratio = res["async"]["tokens_per_s"] / res["fixed"]["tokens_per_s"]
        pairs.append({"sync": res["fixed"], "async": res["async"], "ratio": ratio,
                      "cpu_ratio": cpu_ratio(res["fixed"], res["async"])})
        print(f"pair {i}: sync {res['fixed']['tokens_per_s']:.0f} tok/s, async {res['async']['tokens_per_s']:.0f} "
              f"tok/s, ratio {ratio:.2f}, CPU-time ratio {pairs[-1]['cpu_ratio']:.2f}  "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    load_after = os.getloadavg()
    ceiling.append(parallel_ceiling())
    ratio = statistics.median(q["ratio"] for q in pairs)
    cratio = statistics.median(q["cpu_ratio"] for q in pairs)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_before": load_before, "load_after": load_after, "args": vars(args),
              "parallel_ceiling": ceiling, "median_ratio": ratio, "median_cpu_ratio": cratio, "pairs": pairs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    a = pairs[[q["ratio"] for q in pairs].index(sorted(q["ratio"] for q in pairs)[len(pairs) // 2])]
    print(f"median async/sync trained-tokens/s ratio: {ratio:.2f} over {len(pairs)} pairs "
          f"(k={args.staleness}, {args.workers} worker(s), load {load_before[0]:.1f} -> {load_after[0]:.1f})")
    print(f"parallel ceiling before/after: {ceiling[0]:.2f}/{ceiling[1]:.2f} (the most two processes can gain here); "
          f"wall ratio / mean ceiling: {ratio / statistics.fmean(ceiling):.2f}")
    print(f"median CPU-time ratio (sync CPU per token / the busier async process's CPU per token; the wall ratio "
          f"on a machine with a free core per process): {cratio:.2f}")
    print("median pair, where the time went (s over the timed steps):")
    print("  sync : " + ", ".join(f"{k} {a['sync'][k]:.2f}" for k in ("wall_s", "generate_s", "old_logp_s",
                                                                         "update_s")))
    print("  async: " + ", ".join(f"{k} {a['async'][k]:.2f}" for k in ("wall_s", "trainer_wait_s", "old_logp_s",
                                                                          "update_s",
                                                                          "worker_generate_s", "worker_wait_s",
                                                                          "weight_sync_s")))
    print(f"  async lag over tokens: mean {a['async']['staleness_mean']:.2f}, max {a['async']['staleness_max']:.0f}; "
          f"dropped {a['async']['dropped']:.0f}; written {args.out}")


if __name__ == "__main__":
    main()
