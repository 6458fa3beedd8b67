"""experiments/bench/bench_tta.py: time to accuracy from metric rows (first crossing, censoring, evaluation excluded, the
clock fallback), the default target, paired speed-ups on known inputs, arm names and their configs, the command line's
one-line errors; one end-to-end run behind ``slow``."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

import bench_tta  # noqa: E402
from tta.analysis import (ASYNC_STALENESS, LOSSES, curve, default_target, equal_steps_ceiling,  # noqa: E402
                          gain_target, parse_arms, per_seed_ratios, rotated, speedup, time_to_accuracy)

from offpolicy_moe.config.load import load_config  # noqa: E402
from offpolicy_moe.config.validate import validate  # noqa: E402

# clock (perf/elapsed_s): step 1 ends at 5 s (start-up), evaluations of 0.5 s at steps 2 and 4
ROWS = [
    {"step": 0, "eval/accuracy": 0.30, "perf/time_eval_s": 1.0},
    {"step": 1, "perf/elapsed_s": 5.0, "perf/time_step_s": 5.0},
    {"step": 2, "eval/accuracy": 0.40, "perf/elapsed_s": 6.5, "perf/time_eval_s": 0.5, "perf/time_step_s": 1.5},
    {"step": 3, "perf/elapsed_s": 7.5, "perf/time_step_s": 1.0},
    {"step": 4, "eval/accuracy": 0.60, "perf/elapsed_s": 9.0, "perf/time_eval_s": 0.5, "perf/time_step_s": 1.5},
]


def test_curve_times_from_the_end_of_step_one_with_and_without_evaluation():
    c = curve(ROWS)
    assert c.steps == [0, 2, 4] and c.accuracy == [0.30, 0.40, 0.60]
    # step 2: 6.5 - 5 - 0.5 (its own evaluation not charged); step 4: 9 - 5 - 0.5 charged 3.5, excluded 4 - 1 = 3
    assert c.time_s == [0.0, 1.0, 3.5]
    assert c.time_no_eval_s == [0.0, 1.0, 3.0]
    assert (c.end_s, c.end_no_eval_s, c.eval_s, c.first_step_s) == (4.0, 3.0, 1.0, 5.0)
    assert c.final_accuracy == 0.60 and c.clock == "perf/elapsed_s"


NO_PROCESS = {"seconds_process": None, "seconds_process_no_eval": None, "cpu_s": None}    # not watched


def test_first_crossing_and_censoring():
    c = curve(ROWS)
    assert time_to_accuracy(c, 0.35).__dict__ == {"seconds": 1.0, "seconds_no_eval": 1.0, "reached": True, "step": 2,
                                                 **NO_PROCESS}
    assert time_to_accuracy(c, 0.60).__dict__ == {"seconds": 3.5, "seconds_no_eval": 3.0, "reached": True, "step": 4,
                                                 **NO_PROCESS}
    assert time_to_accuracy(c, 0.30).step == 0 and time_to_accuracy(c, 0.30).seconds == 0.0
    # never reached: censored at the run's end (4 s with evaluation, 3 s without)
    assert time_to_accuracy(c, 0.61).__dict__ == {"seconds": 4.0, "seconds_no_eval": 3.0, "reached": False,
                                                  "step": None, **NO_PROCESS}
    # the first crossing counts even when accuracy falls again later
    dip = [dict(r) for r in ROWS]
    dip[4]["eval/accuracy"] = 0.1
    assert time_to_accuracy(curve(dip), 0.35).step == 2
    with pytest.raises(ValueError, match="target"):
        time_to_accuracy(c, math.nan)


def test_without_elapsed_the_clock_is_the_sum_of_step_times():
    rows = [{k: v for k, v in r.items() if k != "perf/elapsed_s"} for r in ROWS]
    c = curve(rows)
    assert c.clock == "cumsum perf/time_step_s"
    assert (c.time_s, c.time_no_eval_s, c.end_s) == ([0.0, 1.0, 3.5], [0.0, 1.0, 3.0], 4.0)
    with pytest.raises(ValueError, match="every step"):
        curve([r for r in rows if r["step"] != 3])
    with pytest.raises(ValueError, match="no trained step"):
        curve(ROWS[:1])


def test_default_target_is_sync_median_final_minus_003():
    assert default_target([0.7, 0.5, 0.6]) == pytest.approx(0.57)
    assert default_target([0.5, 0.6]) == pytest.approx(0.52)
    with pytest.raises(ValueError, match="sync"):
        default_target([])


def test_paired_speedup_is_the_geometric_mean_ratio_with_a_t_interval():
    ref, arm = {0: 10.0, 1: 20.0, 2: 40.0, 3: 8.0}, {0: 5.0, 1: 10.0, 2: 10.0, 4: 1.0}
    assert per_seed_ratios(ref, arm) == {0: 2.0, 1: 2.0, 2: 4.0}
    c = speedup(ref, arm)
    d = [math.log10(2), math.log10(2), math.log10(4)]
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    assert c.n == 3
    assert c.estimate == pytest.approx(16 ** (1 / 3))
    assert (c.lo, c.hi) == (pytest.approx(10 ** (m - half)), pytest.approx(10 ** (m + half)))
    # a zero time (target met before training) has no ratio: left out; nothing left -> None
    assert speedup({0: 0.0, 1: 4.0}, {0: 1.0, 1: 2.0}).n == 1
    assert speedup({0: 0.0}, {0: 1.0}) is None


def test_async_expands_to_every_staleness_and_loss():
    names = [a.name for a in parse_arms("trl,sync,async")]
    assert names[:2] == ["trl", "sync"]
    assert names[2:] == [f"async-k{k}-{loss}" for k in ASYNC_STALENESS for loss in LOSSES]
    assert [a.name for a in parse_arms("async-k2-m2po+tis, sync,async-k2-m2po_tis")] == ["async-k2-m2po_tis", "sync"]
    a = parse_arms("async-k4-m2po_tis")[0]
    assert (a.mode, a.staleness, a.loss) == ("async", 4, "m2po_tis")
    assert a.overrides() == ["preset=[m2po,tis]", "buffer.mode=async", "buffer.staleness=4", "rollout.workers=1",
                             "rollout.worker_threads=1"]
    assert parse_arms("sync")[0].overrides() == ["preset=[grpo]", "buffer.mode=fixed", "buffer.staleness=0"]


def test_the_two_best_of_the_stale_race_are_asynchronous_arms():
    """VESPO and GMPO (experiments/stale_race.yaml, docs/results.md) at every staleness, with their own presets and
    the paper defaults those presets carry; the race's other objectives are not arms."""
    names = [a.name for a in parse_arms("async")]
    for k in ASYNC_STALENESS:
        assert f"async-k{k}-vespo" in names and f"async-k{k}-gmpo" in names
    vespo, gmpo = parse_arms("async-k2-vespo,async-k4-gmpo")
    assert (vespo.mode, vespo.staleness, vespo.loss) == ("async", 2, "vespo")
    assert vespo.overrides() == ["preset=[vespo]", "buffer.mode=async", "buffer.staleness=2", "rollout.workers=1",
                                 "rollout.worker_threads=1"]
    assert gmpo.overrides()[:3] == ["preset=[gmpo]", "buffer.mode=async", "buffer.staleness=4"]
    args = Namespace(prompts=16, group=8, max_new_tokens=3, lr=3e-4, steps=500, eval_every=25, eval_size=256)
    v = load_config(None, bench_tta.job_overrides(args, 0, None) + vespo.overrides())
    g = load_config(None, bench_tta.job_overrides(args, 0, None) + gmpo.overrides())
    assert (v.algo.loss.name, v.algo.loss.agg, v.algo.loss.options["k_pos"], v.algo.loss.options["lambda_neg"]) == (
        "vespo", "token-mean", 2.0, 2.0)
    assert (g.algo.loss.name, g.buffer.staleness, g.algo.correction.mode) == ("gmpo", 4, "none")
    for other in ("sapo", "cispo", "dppo_tv"):
        with pytest.raises(ValueError, match=f"'async-k2-{other}'"):
            parse_arms(f"async-k2-{other}")


def test_a_ray_arm_is_the_async_arm_with_its_worker_a_ray_actor():
    (ray,) = parse_arms("ray-k1-grpo")
    (local,) = parse_arms("async-k1-grpo")
    assert (ray.name, ray.mode, ray.staleness, ray.loss, ray.backend) == ("ray-k1-grpo", "async", 1, "grpo", "ray")
    assert ray.overrides() == local.overrides() + ["rollout.backend=ray"]
    assert "ray" not in " ".join(a.name for a in parse_arms("trl,sync,async"))     # only when asked for


@pytest.mark.parametrize("bad", ["foo", "async-k0-grpo", "async-k2-ppo", "async-2-grpo", "ray-k0-grpo", "rays-k1-grpo",
                                 ""])
def test_bad_arm_is_one_line_naming_it(bad):
    with pytest.raises(ValueError) as e:
        parse_arms(f"trl,{bad}" if bad else bad)
    msg = str(e.value)
    assert "\n" not in msg and (repr(bad) in msg if bad else "empty" in msg)


def test_rotation_puts_every_arm_first_once():
    arms = ["a", "b", "c"]
    orders = [rotated(arms, i) for i in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in orders) == arms


def test_every_arm_resolves_to_the_config_it_names():
    args = Namespace(prompts=16, group=8, max_new_tokens=3, lr=3e-4, steps=500, eval_every=25, eval_size=256)
    objective = {"grpo": "grpo", "m2po": "m2po", "m2po_tis": "m2po", "vespo": "vespo", "gmpo": "gmpo"}
    for arm in parse_arms("sync,async"):
        cfg = load_config(None, bench_tta.job_overrides(args, 3, None) + arm.overrides())
        assert not [w for w in validate(cfg) if "error" in str(w).lower()]
        assert (cfg.buffer.mode, cfg.buffer.staleness) == (arm.mode, arm.staleness)
        assert cfg.algo.loss.name == objective[arm.loss]
        assert cfg.algo.correction.mode == ("truncate" if arm.loss == "m2po_tis" else "none")
        assert (cfg.seed, cfg.trainer.steps, cfg.trainer.eval_every, cfg.task.eval_size) == (3, 500, 25, 256)
        assert (cfg.optim.lr, cfg.rollout.dtype, cfg.rollout.max_new_tokens) == (3e-4, "float32", 3)
        if arm.mode == "async":
            assert cfg.rollout.workers == 1


@pytest.mark.parametrize("argv, word", [
    (["--arms", "trl,bogus"], "'bogus'"),
    (["--arms", "trl,async"], "--target or --target-gain is required"),
    (["--arms", "sync", "--headline", "sync", "--target", "0.5", "--target-gain", "0.05"], "give one"),
    (["--arms", "sync", "--headline", "sync", "--target-gain", "0"], "--target-gain must be in (0, 1)"),
    (["--arms", "sync", "--headline", "sync", "--target-gain", "nan"], "--target-gain must be in (0, 1)"),
    (["--arms", "sync", "--headline", "sync", "--warm-seed", "-2"], "--warm-seed must be >= 0"),
    (["--steps", "30", "--eval-every", "25"], "multiple of --eval-every"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--set", "nokey"], "KEY=VALUE"),
    (["--arms", "trl,sync"], "--headline ARM is required"),
    (["--arms", "trl,sync", "--headline", "trl"], "must be one of our arms"),
    (["--arms", "trl,sync", "--headline", "async-k1-grpo"], "must be one of our arms"),
    (["--arms", "sync", "--headline", "sync", "--first-seed", "-1"], "--first-seed must be >= 0"),
    (["--arms", "sync", "--headline", "sync", "--threads", "0"], "--threads must be >= 1"),
])
def test_command_line_errors_name_the_problem(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        bench_tta.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert word in err


def test_quick_defaults_and_explicit_values_win():
    a = bench_tta.parse_args(["--quick", "--headline", "sync"])
    assert ([x.name for x in a.arm_list], a.seeds, a.steps) == (["trl", "sync", "async-k2-m2po_tis"], 2, 200)
    b = bench_tta.parse_args(["--quick", "--seeds", "3", "--headline", "sync"])
    assert b.seeds == 3 and b.out.name == "quick"
    c = bench_tta.parse_args(["--headline", "async-k1-grpo"])
    assert (len(c.arm_list), c.seeds, c.steps, c.out.name) == (17, 5, 500, "full")     # trl, sync, 3 k x 5 losses
    assert (c.first_seed, c.threads, c.metric, c.max_new_tokens) == (0, 1, "eval/accuracy", 3)


def test_trl_runs_without_gradient_checkpointing_unless_asked():
    """TRL at its best for a model this size: its 1.16 default recomputes the forward in the backward."""
    assert bench_tta.parse_args(["--arms", "trl,sync", "--headline", "sync"]).trl_gradient_checkpointing == 0
    assert bench_tta.parse_args(["--arms", "trl,sync", "--headline", "sync",
                                 "--trl-gradient-checkpointing", "1"]).trl_gradient_checkpointing == 1


def test_the_long_job_is_the_chain_task_scored_on_the_final_answer():
    a = bench_tta.parse_args(["--job", "long", "--arms", "trl,sync,async-k1-grpo", "--headline", "async-k1-grpo"])
    assert (a.metric, a.out.name, a.max_new_tokens) == ("eval/reward", "long", bench_tta.JOBS["long"]["max_new_tokens"])
    cfg = load_config(None, bench_tta.job_overrides(a, 7, None))
    assert cfg.task.name == "chain" and not [w for w in validate(cfg) if "error" in str(w).lower()]
    from offpolicy_moe.tasks import make_task
    task = make_task(cfg.task)
    assert task.max_answer_chars + 1 <= cfg.rollout.max_new_tokens       # every reference fits, with its eos
    assert min(len(x) for x in task.train_answers) + 1 >= 32                # generation-heavy: >= 32 tokens


def test_the_longtail_job_fits_its_longest_reference_and_writes_its_own_folder():
    a = bench_tta.parse_args(["--job", "longtail", "--arms", "sync", "--headline", "sync"])
    assert (a.metric, a.out.name, a.steps % a.eval_every) == ("eval/reward", "longtail", 0)
    cfg = load_config(None, bench_tta.job_overrides(a, 7, None))
    assert cfg.task.name == "longtail" and not [w for w in validate(cfg) if "error" in str(w).lower()]
    from offpolicy_moe.tasks import make_task
    task = make_task(cfg.task)
    assert task.max_answer_chars + 1 == cfg.rollout.max_new_tokens       # the longest reference fits, with its eos
    assert bench_tta.parse_args(["--job", "long", "--arms", "sync", "--headline", "sync"]).out.name == "long"


def test_threads_go_to_trl_and_sync_and_one_each_to_an_async_arm():
    a = bench_tta.parse_args(["--arms", "trl,sync,async-k1-grpo,fixed-k1-grpo", "--headline", "sync",
                              "--threads", "2"])
    assert [bench_tta.arm_threads(a, x) for x in a.arm_list] == [2, 2, 1, 2]
    cfg = load_config(None, bench_tta.job_overrides(a, 0, None, 2))
    assert cfg.trainer.threads == 2


def test_fixed_and_unclipped_arms_isolate_staleness_and_clipping():
    fixed, unclipped = parse_arms("fixed-k1-grpo,async-k1-unclipped")
    assert fixed.overrides() == ["preset=[grpo]", "buffer.mode=fixed", "buffer.staleness=1"]
    assert "rollout.workers=1" in unclipped.overrides()
    args = Namespace(prompts=16, group=8, max_new_tokens=3, lr=3e-4, steps=500, eval_every=25, eval_size=256)
    cfg = load_config(None, bench_tta.job_overrides(args, 3, None) + unclipped.overrides())
    assert cfg.algo.loss.name == "unclipped" and cfg.buffer.mode == "async"
    assert "unclipped" not in LOSSES                                         # never part of `async`


def _watched(rows, seen, cpu, wall, cpu_end):
    """A Curve with the process clock of rows stamped at ``seen`` (step -> seconds since launch)."""
    from tta.analysis import Curve
    from tta.clock import eval_seconds, process_curve

    c = curve(rows)
    return Curve(**{**c.__dict__, **process_curve(c.steps, eval_seconds(rows), seen, cpu, wall, cpu_end)})


def test_the_clock_from_process_start_charges_start_up_and_earlier_evaluations():
    # ROWS: step-0 eval 1 s (before the loop), evals of 0.5 s at steps 2 and 4; rows seen 12 s, 20 s, 22 s after launch
    c = _watched(ROWS, {0: 12.0, 1: 19.0, 2: 20.0, 3: 21.0, 4: 22.0}, {0: 10.0, 2: 18.0, 4: 21.0}, 25.0, 24.0)
    assert c.time_process_s == [11.0, 19.5, 21.5]          # stamp minus its own evaluation
    assert c.time_process_no_eval_s == [11.0, 18.5, 20.0]  # stamp minus every evaluation up to it
    assert c.time_s == [0.0, 1.0, 3.5]                      # the loop clock ignores the 19 s before it
    t = time_to_accuracy(c, 0.5)
    assert (t.step, t.seconds_process, t.seconds_process_no_eval, t.cpu_s, t.seconds) == (4, 21.5, 20.0, 21.0, 3.5)
    never = time_to_accuracy(c, 0.9)
    assert not never.reached and (never.seconds_process, never.cpu_s) == (25.0, 24.0)
    # an undercounted total (the worker not reaped) is raised to the last live reading
    low = _watched(ROWS, {0: 12.0, 1: 19.0, 2: 20.0, 3: 21.0, 4: 22.0}, {0: 10.0, 2: 18.0, 4: 21.0}, 25.0, 5.0)
    assert time_to_accuracy(low, 0.9).cpu_s == 21.0
    with pytest.raises(ValueError, match="no stamp"):
        _watched(ROWS, {0: 1.0}, {}, 5.0, 5.0)


# writes rows to argv[1], each one only once the watcher has read the row before (inotify IN_ACCESS on the file: a
# read that returned data, and the file holds nothing else): after row 0, it burns CPU and sleeps; after the eval
# row, it sleeps before it exits
_ROWS_CHILD = """\
import ctypes, json, os, select, sys, time
path = sys.argv[1]
f = open(path, "w")
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
if fd < 0 or libc.inotify_add_watch(fd, path.encode(), 0x1) < 0:     # IN_ACCESS
    sys.exit(f"inotify: errno {ctypes.get_errno()}")

def row(r):
    f.write(json.dumps(r) + "\\n")
    f.flush()
    if not select.select([fd], [], [], 60)[0]:
        sys.exit(f"the watcher did not read the row of step {r['step']} in 60 s")
    while True:                      # the events of that read
        try:
            os.read(fd, 4096)
        except BlockingIOError:
            break

row({"step": 0})
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
time.sleep(1.0)
row({"step": 1, "eval/accuracy": 0.5})
time.sleep(0.5)
"""


def test_watch_stamps_rows_as_they_appear_and_counts_cpu(tmp_path):
    """A child that writes a row, burns CPU, sleeps, then writes an eval row: the stamps are ordered and apart by at
    least the sleep, and the CPU seconds at the eval row include the burn.  The child goes on from a row only once
    the watcher has read it (:data:`_ROWS_CHILD`), so that the watcher's lateness on a loaded machine cannot bring
    the two stamps together, nor read the eval row after the child is gone."""
    from tta.clock import watch

    metrics = tmp_path / "metrics.jsonl"
    w = watch([sys.executable, "-c", _ROWS_CHILD, str(metrics)], metrics, env={}, log=tmp_path / "log")
    assert w.returncode == 0, (tmp_path / "log").read_text()[-2000:]
    assert set(w.seen_s) == {0, 1}
    assert w.seen_s[1] - w.seen_s[0] >= 1.0 and w.wall_s >= w.seen_s[1]
    assert w.cpu_s[1] >= 0.25 and w.cpu_total_s >= w.cpu_s[1] - 0.05


# spawns a grandchild that outlives it (argv[2]: where the grandchild writes its pid; it lingers 0.5 s after its
# parent is gone), then writes two rows, each only once the watcher has read the one before (as _ROWS_CHILD)
_LINGER_CHILD = _ROWS_CHILD.split("row({\"step\": 0})")[0] + """\
import subprocess
subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                  "parent = os.getppid()\\nwhile os.getppid() == parent: time.sleep(0.01)\\ntime.sleep(0.5)",
                  sys.argv[2]])
row({"step": 0})
row({"step": 1, "eval/accuracy": 0.5})
"""


def test_watch_returns_once_the_descendants_are_gone(tmp_path):
    """A command whose grandchild outlives it (as the asynchronous arms' fork server and worker do): the watcher
    returns only once the grandchild has exited, and says how long it waited beyond the command (not in its wall
    time), so that the next run never starts beside it."""
    from tta.clock import _running, watch

    metrics, pid_file = tmp_path / "metrics.jsonl", tmp_path / "grandchild.pid"
    w = watch([sys.executable, "-c", _LINGER_CHILD, str(metrics), str(pid_file)], metrics, env={},
              log=tmp_path / "log")
    assert w.returncode == 0, (tmp_path / "log").read_text()[-2000:]
    assert set(w.seen_s) == {0, 1}
    grandchild = int(pid_file.read_text())
    assert not _running(grandchild)
    assert w.settle_s > 0.0 and w.wall_s >= w.seen_s[1]


def _process_record(factors: dict[str, list[float]], startup: dict[str, float]) -> dict:
    """A runs.json record whose runs are ROWS scaled by ``factors`` (loop clock) and launched ``startup`` seconds
    before the loop (process clock: stamp = startup + loop time + step-0 evaluation)."""
    from tta.clock import eval_seconds, process_curve

    runs = []
    for arm, fs in factors.items():
        for seed, f in enumerate(fs):
            rows = [{k: (v * f if k in ("perf/elapsed_s", "perf/time_eval_s", "perf/time_step_s") else v)
                     for k, v in r.items()} for r in ROWS]
            c = curve(rows)
            seen = {r["step"]: startup[arm] + r.get("perf/elapsed_s", 0.0) for r in rows}
            cpu = {s: 2 * t for s, t in seen.items()}
            pc = process_curve(c.steps, eval_seconds(rows), seen, cpu, seen[4] + 1, 2 * seen[4])
            runs.append({"arm": arm, "seed": seed, "curve": {**c.__dict__, **pc}, "startup_s": startup[arm],
                         "s_per_step": 0.1, "load_after": [1.0, 1.0, 1.0], "threads": 1})
    return {"date": "d", "command": "c", "arms": list(factors), "wall_s": 1.0, "load_start": [1, 1, 1],
            "load_end": [1, 1, 1], "warm_start_s": {"0": 1.0}, "runs": runs}


def test_the_headline_is_the_pre_registered_arm_on_the_process_clock_not_the_best():
    """async-k2 is faster in the loop and from process start, but the pre-registered arm is async-k1: the last line
    reports async-k1 (a best-of-N pick would name async-k2); start-up counts: a 2x faster loop with 10 s more
    start-up is slower from process start."""
    rec = _process_record({"trl": [2.0, 2.0], "sync": [1.0, 1.0], "async-k1-grpo": [0.5, 0.5],
                           "async-k2-m2po": [0.25, 0.25]},
                          {"trl": 5.0, "sync": 5.0, "async-k1-grpo": 15.0, "async-k2-m2po": 5.0})
    s = bench_tta.summarise(rec["runs"], parse_arms(",".join(rec["arms"])), 0.5)
    a = s["async-k1-grpo"]
    assert a["vs_sync_loop"]["estimate"] == pytest.approx(2.0)
    # process clock at step 4: startup + (stamp = elapsed 9 f) - eval 0.5 f
    assert a["median_tta_process_s"] == pytest.approx(15 + 8.5 * 0.5)
    assert a["vs_sync_process"]["estimate"] == pytest.approx((5 + 8.5) / (15 + 8.5 * 0.5))
    assert a["vs_sync_process"]["estimate"] < 1 < a["vs_sync_loop"]["estimate"]
    assert a["vs_sync_cpu"]["estimate"] == pytest.approx((5 + 9) / (15 + 4.5))
    line = bench_tta.headline_line(s, "async-k1-grpo")
    assert line == (f"time to accuracy (from process start): async-k1-grpo "
                    f"{a['vs_trl_process']['estimate']:.2f}x TRL, {a['vs_sync_process']['estimate']:.2f}x ours sync")
    assert "async-k2" not in line
    assert bench_tta.headline_line(s, "sync").endswith("x TRL, 1.00x ours sync")
    table = bench_tta.table(s, 0.5, "perf/elapsed_s", "async-k1-grpo")
    assert "| **async-k1-grpo** (pre-registered) |" in table and "| async-k2-m2po |" in table


def test_target_sensitivity_reports_the_headline_at_minus_and_plus_005():
    rec = _process_record({"trl": [2.0, 2.0], "sync": [1.0, 1.0], "async-k1-grpo": [0.5, 0.5]},
                          {"trl": 5.0, "sync": 5.0, "async-k1-grpo": 5.0})
    text = bench_tta.sensitivity(rec["runs"], parse_arms("trl,sync,async-k1-grpo"), 0.45, "async-k1-grpo")
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.400", "| 0.450", "| 0.500"]
    # 0.40 is first met at step 2, 0.45 and 0.50 at step 4: the ratios differ by target
    assert all("2/2" in r for r in rows)
    assert rows[0].split(" | ")[4] != rows[1].split(" | ")[4] == rows[2].split(" | ")[4]


def test_seeds_start_at_first_seed_and_arms_rotate(monkeypatch, tmp_path):
    calls, grids, partial = [], [], []
    monkeypatch.setattr(bench_tta, "warm_start", lambda args, seed, work: (f"w{seed}", 1.0))
    monkeypatch.setattr(bench_tta, "save_partial", lambda *a: partial.append(a[-1]))
    monkeypatch.setattr(bench_tta, "measure_grids", lambda args, arms: grids.append(calls[:]) or {"grids": {"1": 0}})

    def fake_run(args, arm, seed, warm, work):
        calls.append((seed, arm.name, warm))
        return {"arm": arm.name, "seed": seed, "curve": {"final_accuracy": 0.5, "end_s": 1.0, "eval_s": 0.0},
                "process_wall_s": 1.0, "load_after": [1.0, 1.0, 1.0]}

    monkeypatch.setattr(bench_tta, "run_arm", fake_run)
    args = bench_tta.parse_args(["--arms", "sync,async-k1-grpo", "--headline", "async-k1-grpo", "--seeds", "2",
                                 "--first-seed", "5", "--out", str(tmp_path)])
    rec = bench_tta.collect(args)
    assert calls == [(5, "sync", "w5"), (5, "async-k1-grpo", "w5"), (6, "async-k1-grpo", "w6"), (6, "sync", "w6")]
    assert rec["headline"] == "async-k1-grpo" and set(rec["warm_start_s"]) == {5, 6}
    # the decode grid: measured once, before the first run, kept in the record and in every partial one
    assert grids == [[]] and rec["decode_grids"] == {"grids": {"1": 0}} and partial == [{"grids": {"1": 0}}] * 4


def test_a_shared_warm_start_is_made_once_and_every_seed_starts_from_it(monkeypatch, tmp_path):
    made = []
    monkeypatch.setattr(bench_tta, "warm_start", lambda args, seed, work: made.append(seed) or (f"w{seed}", 1.0))
    monkeypatch.setattr(bench_tta, "save_partial", lambda *a: None)
    monkeypatch.setattr(bench_tta, "measure_grids", lambda args, arms: {})
    calls = []

    def fake_run(args, arm, seed, warm, work):
        calls.append((seed, warm))
        return {"arm": arm.name, "seed": seed, "curve": {"final_accuracy": 0.5, "end_s": 1.0, "eval_s": 0.0},
                "process_wall_s": 1.0, "load_after": [1.0, 1.0, 1.0]}

    monkeypatch.setattr(bench_tta, "run_arm", fake_run)
    args = bench_tta.parse_args(["--arms", "sync", "--headline", "sync", "--seeds", "3", "--first-seed", "5",
                                 "--warm-seed", "5", "--out", str(tmp_path)])
    rec = bench_tta.collect(args)
    assert made == [5]                                  # one SFT, made once for every seed
    assert calls == [(5, "w5"), (6, "w5"), (7, "w5")] and rec["warm_seed"] == 5 and set(rec["warm_start_s"]) == {5}


def test_the_warm_start_cache_keys_a_probe_s_model_and_task_overrides(monkeypatch, tmp_path):
    """A probe's task.* overrides go into the warm start's SFT command and its cache key, so a warm start of another
    task law is never mistaken for the job's; the job's own task settings are in the key too, so a warm start made
    before the job's teacher changed (longtail's estimates) is not served for the new one."""
    cmds = []

    def fake_call(cmd, what):
        cmds.append(cmd)
        if cmd[3] == "export":
            (Path(cmd[5]) / "config.json").parent.mkdir(parents=True, exist_ok=True)
            (Path(cmd[5]) / "config.json").write_text("{}")
        return 1.0

    monkeypatch.setattr(bench_tta, "_call", fake_call)
    base = dict(job="longtail", prompts=16, group=8, eval_size=256, warm_cache=str(tmp_path / "cache"), lr=3e-5,
                steps=120, eval_every=15, sft_steps=400, max_new_tokens=225)
    plain, _ = bench_tta.cached_warm_start(Namespace(**base), 0, tmp_path / "a")
    other, _ = bench_tta.cached_warm_start(Namespace(**base, model=["model.hidden_size=128"],
                                                     task_set=["task.length_tail=1"]), 0, tmp_path / "b")
    assert Path(plain).parent.name == "longtail-seed0-sft400-eval256-estimate_share=0.5"
    assert Path(other).parent.name == "longtail-seed0-sft400-eval256-estimate_share=0.5-hidden_size=128-length_tail=1"
    sft = [c for c in cmds if c[3] == "train"]
    assert "task.length_tail=1" not in sft[0] and "task.length_tail=1" in sft[1] and "model.hidden_size=128" in sft[1]
    assert all("task.estimate_share=0.5" in c for c in sft)
    again, _ = bench_tta.cached_warm_start(Namespace(**base, model=["model.hidden_size=128"],
                                                     task_set=["task.length_tail=1"]), 0, tmp_path / "c")
    assert again == other and len(cmds) == 4          # the second call is served from the cache


def test_gain_target_is_the_median_start_plus_the_gain_and_refuses_bad_input():
    assert gain_target([0.5, 0.5, 0.4], 0.06) == pytest.approx(0.56)
    with pytest.raises(ValueError, match="step-0 evaluation"):
        gain_target([], 0.05)
    for bad in (0.0, -0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="--target-gain must be"):
            gain_target([0.5], bad)


def test_the_gain_target_rule_is_kept_with_the_record_and_met_by_no_run_at_step_0(tmp_path):
    """--target-gain 0.15 over ROWS (step 0 at 0.30): target 0.45, first met at step 4 by every run, none at step 0;
    the record keeps the rule, so --reanalyse applies it again; --target given at re-analysis wins."""
    rec = _process_record({"trl": [2.0, 2.0], "sync": [1.0, 1.0], "async-k1-grpo": [0.5, 0.5]},
                          {"trl": 5.0, "sync": 5.0, "async-k1-grpo": 5.0})
    rec["target_gain"] = 0.15
    assert bench_tta.target_of(rec, None, None) == (pytest.approx(0.45), "median step-0 accuracy 0.300 + 0.15 "
                                                                         "(--target-gain)")
    assert bench_tta.target_of(rec, 0.5, None) == (0.5, "--target")
    bench_tta.report(rec, None, tmp_path, headline="async-k1-grpo")
    out = json.loads((tmp_path / "runs.json").read_text())
    text = (tmp_path / "table.md").read_text()
    assert out["target"] == pytest.approx(0.45) and "warning" not in text
    assert "equal-steps ceiling (async-k1-grpo" in text and "| sync | 5.0 / 5.0 |" in text
    assert all(r["tta"]["step"] == 4 for r in out["runs"])
    no_step0 = dict(rec, runs=[dict(r, curve=dict(r["curve"], steps=r["curve"]["steps"][1:],
                                                    accuracy=r["curve"]["accuracy"][1:])) for r in rec["runs"]])
    with pytest.raises(ValueError, match="step-0 evaluation"):
        bench_tta.target_of(no_step0, None, None)


@pytest.mark.slow
def test_end_to_end_two_arms_one_seed(tmp_path):
    """TRL and ours sync from the same warm start: identical step-0 accuracy (same weights, tokenizer, evaluation),
    runs.json / table.md / tta.png written, every run censored at an unreachable target, the last line."""
    out = tmp_path / "tta"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench" / "bench_tta.py"), "--arms", "trl,sync",
                        "--headline", "sync", "--seeds", "1", "--steps", "4", "--eval-every", "2", "--eval-size", "32", "--sft-steps", "5",
                        "--target", "1.01", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("time to accuracy (from process start): sync ")
    data = json.loads((out / "runs.json").read_text())
    runs = {x["arm"]: x for x in data["runs"]}
    assert set(runs) == {"trl", "sync"}
    assert runs["trl"]["curve"]["steps"] == runs["sync"]["curve"]["steps"] == [0, 2, 4]
    assert runs["trl"]["curve"]["accuracy"][0] == runs["sync"]["curve"]["accuracy"][0]
    assert runs["trl"]["fairness"]["first_step_prompts_match_ours"] is True
    assert runs["trl"]["fairness"]["prompt_ids_match_ours"] is True
    assert all(not x["tta"]["reached"] for x in data["runs"])
    assert data["summary"]["sync"]["reached"] == 0 and data["summary"]["sync"]["vs_trl"]["n"] == 1
    assert (out / "tta.png").stat().st_size > 0 and "| **sync** (pre-registered) | 1 | 0/1 |" in (out / "table.md").read_text()
    for arm in ("trl", "sync"):                      # the clock from process start: after the loop's, in order
        c = runs[arm]["curve"]
        assert len(c["time_process_s"]) == 3 and c["time_process_s"] == sorted(c["time_process_s"])
        assert c["time_process_s"][-1] > c["time_s"][-1] and c["end_process_s"] == runs[arm]["process_wall_s"]
        assert c["cpu_s"][-1] > 0


def _record(times: dict[str, list[float]]) -> dict:
    """A runs.json record: per arm, one run per seed whose clock is ROWS' scaled by the given factor."""
    runs = []
    for arm, factors in times.items():
        for seed, f in enumerate(factors):
            rows = [{k: (v * f if k in ("perf/elapsed_s", "perf/time_eval_s", "perf/time_step_s") else v)
                     for k, v in r.items()} for r in ROWS]
            runs.append({"arm": arm, "seed": seed, "curve": curve(rows).__dict__, "startup_s": 1.0,
                         "s_per_step": 0.1})
    return {"date": "d", "command": "c", "arms": list(times), "wall_s": 1.0, "load_start": [1, 1, 1],
            "load_end": [1, 1, 1], "warm_start_s": {"0": 1.0}, "runs": runs}


def test_reanalyse_summarises_a_record_again(tmp_path, capsys):
    src = tmp_path / "runs.json"
    src.write_text(json.dumps(_record({"trl": [4.0, 4.0], "sync": [2.0, 2.0], "async-k2-m2po_tis": [1.0, 1.0]})))
    bench_tta.main(["--reanalyse", str(src), "--target", "0.5", "--out", str(tmp_path / "o"), "--headline",
                    "async-k2-m2po_tis"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # no process clock in this record: the headline's process ratios are n/a; the loop ratios are kept
    assert last == "time to accuracy (from process start): async-k2-m2po_tis n/a TRL, n/a ours sync"
    out = json.loads((tmp_path / "o" / "runs.json").read_text())
    s = out["summary"]["async-k2-m2po_tis"]
    assert out["target"] == 0.5 and s["reached"] == 2 and s["median_tta_s"] == 3.5 and s["median_tta_no_eval_s"] == 3.0
    assert s["vs_trl"]["estimate"] == pytest.approx(4.0) and s["vs_sync_loop_per_seed"] == {"0": 2.0, "1": 2.0}
    assert (tmp_path / "o" / "tta.png").is_file()
    assert s["median_tta_process_s"] is None                          # a record from before the process clock
    with pytest.raises(SystemExit):
        bench_tta.parse_args(["--reanalyse", str(tmp_path / "missing.json")])


def test_trl_prompt_tokens_equal_ours_without_a_bos_in_the_text():
    """TRL tokenizes text prompts with ``processing_class(text=...)``, whose post-processor adds bos: the trl arm
    passes the bare task text (a bos in the text, as bench_vs_trl.py writes it, gives two)."""
    from offpolicy_moe.tasks.tokenizer import build_char_tokenizer
    from tta.prompts import prompt_ids_match

    tok = build_char_tokenizer()
    assert prompt_ids_match(tok, ["1+2+3=", "9+9+9=", "0+0+0="])
    doubled = tok(text=[tok.bos_token + "1+2+3="])["input_ids"][0]
    assert doubled[:2] == [tok.bos_token_id, tok.bos_token_id]
    assert not prompt_ids_match(tok, [])


@pytest.mark.parametrize("arms, says", [("foo", "unknown arm 'foo'"), ("trl", "no arm of ours")])
def test_the_phase_breakdown_refuses_bad_arms_in_one_line(arms, says):
    r = subprocess.run([sys.executable, str(BENCH / "bench_tta_phases.py"), "--arms", arms], capture_output=True,
                       text=True, cwd=BENCH)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_the_phase_breakdown_gives_seconds_per_step_and_the_generation_share():
    def run(arm, gen_key, gen, upd):
        return {"arm": arm, "s_per_step": 1.0,
                "curve": {"phases": {gen_key: gen * 9, "perf/time_update_s": upd * 9}}}

    runs = [run("sync", "perf/time_generate_s", 0.7, 0.3), run("async-k1-grpo", "async/worker_generate_s", 0.6, 0.4)]
    text = bench_tta.phase_table(runs, parse_arms("trl,sync,async-k1-grpo"), 10)
    sync = next(line for line in text.splitlines() if line.startswith("| sync |"))
    asy = next(line for line in text.splitlines() if line.startswith("| async-k1-grpo |"))
    assert sync.split(" | ")[1] == "0.7000" and sync.endswith("| 1.0000 | 70% |")
    assert asy.split(" | ")[1] == "—" and asy.split(" | ")[5] == "0.6000" and asy.endswith("| 60% |")
    assert "| trl |" not in text                                     # no run of that arm


def test_a_target_met_before_training_gives_no_ratio_on_any_clock():
    """Met at step 0 (accuracy 0.30 >= 0.3): the loop TTA is 0 and the process TTA is the start-up; neither is a
    time to accuracy, so no ratio (a start-up ratio would pass for one)."""
    rec = _process_record({"trl": [2.0, 2.0], "sync": [1.0, 1.0], "async-k1-grpo": [0.5, 0.5]},
                          {"trl": 5.0, "sync": 9.0, "async-k1-grpo": 3.0})
    s = bench_tta.summarise(rec["runs"], parse_arms("trl,sync,async-k1-grpo"), 0.3)
    a = s["async-k1-grpo"]
    assert a["met_at_start"] == 2 and a["vs_sync_process"] is None and a["vs_trl_cpu"] is None
    assert bench_tta.headline_line(s, "async-k1-grpo").endswith("async-k1-grpo n/a TRL, n/a ours sync")


def test_the_equal_steps_ceiling_charges_start_up_and_tends_to_the_step_cost_ratio():
    """Reference: start-up 10 s, loop 99 s over 100 steps (1 s a step); arm: start-up 20 s, 0.5 s a step. At 100
    steps (10 + 100) / (20 + 50) = 1.571..; the limit 2.0; medians over runs; errors name what is missing."""
    c = equal_steps_ceiling("sync", "a", {"sync": [10.0, 12.0, 8.0], "a": [20.0]}, {"sync": [99.0], "a": [49.5, 49.5]},
                            100)
    assert (c.startup_reference_s, c.startup_arm_s) == (10.0, 20.0)
    assert c.at_steps == pytest.approx(110 / 70) and c.limit == pytest.approx(2.0)
    assert c.at_steps < c.limit
    with pytest.raises(ValueError, match="runs of arm 'a'"):
        equal_steps_ceiling("sync", "a", {"sync": [1.0]}, {"sync": [1.0]}, 100)
    with pytest.raises(ValueError, match=">= 2 steps"):
        equal_steps_ceiling("sync", "a", {"sync": [1.0], "a": [1.0]}, {"sync": [1.0], "a": [1.0]}, 1)


def test_the_split_is_the_system_share_times_the_objective_share():
    """stream-k1 vs sync splits into stream / fixed-k1 (the system) and fixed-k1 / sync (the objective), paired by
    seed on the process clock; their product is the headline's ratio over sync."""
    rec = _process_record({"sync": [1.0, 1.0], "fixed-k1-grpo": [0.8, 0.8], "stream-k1-grpo": [0.4, 0.4]},
                          {"sync": 5.0, "fixed-k1-grpo": 5.0, "stream-k1-grpo": 5.0})
    arms = parse_arms(",".join(rec["arms"]))
    text = bench_tta.split_table(rec["runs"], arms, 0.5, "stream-k1-grpo")
    proc = lambda f: 5 + 8.5 * f        # noqa: E731  (the process clock at the crossing, as above)
    system, objective = proc(0.8) / proc(0.4), proc(1.0) / proc(0.8)
    assert f"| stream-k1-grpo / fixed-k1-grpo | the system's share" in text and f"{system:.2f}x" in text
    assert f"| fixed-k1-grpo / sync | the objective's share" in text and f"{objective:.2f}x" in text
    assert f"{system * objective:.2f}x" in text
    assert bench_tta.split_table(rec["runs"], arms, 0.5, "sync") == ""          # no split for a one-process arm
    assert bench_tta.split_table(rec["runs"], parse_arms("sync,stream-k1-grpo"), 0.5, "stream-k1-grpo") == ""


def test_stream_arms_run_the_streaming_source_with_one_thread_each():
    arm = parse_arms("stream")[0]
    assert arm.name == "stream-k1-grpo" and arm.mode == "stream"
    assert {"buffer.mode=stream", "buffer.staleness=1", "rollout.workers=1"} <= set(arm.overrides())
    assert parse_arms("stream-k2-m2po")[0].staleness == 2
    assert bench_tta.arm_threads(Namespace(threads=2), arm) == 1


def test_flow_counts_generated_tokens_per_generating_second_idle_share_and_lags():
    """Steps 2..N: a one-process loop's tokens come from its mean response length x rows, a worker's from its own
    count; idle = 1 - (old-logp pass + update) / step; lag shares over every step."""
    from tta.analysis import flow

    one_process = [
        {"step": 1, "perf/time_step_s": 9.0, "perf/time_generate_s": 9.0, "perf/time_old_logp_s": 0.0,
         "perf/time_update_s": 0.0, "reward/response_len": 99.0, "offpolicy/lag_tokens_0": 10.0},
        {"step": 2, "perf/time_step_s": 2.0, "perf/time_generate_s": 1.0, "perf/time_old_logp_s": 0.25,
         "perf/time_update_s": 0.5, "reward/response_len": 10.0, "offpolicy/lag_tokens_0": 30.0},
        {"step": 2, "eval/accuracy": 0.5},
    ]
    f = flow(one_process, rows_per_step=4)
    assert f.gen_tokens_per_s == pytest.approx(40.0)           # 10 tokens x 4 rows in 1 s; step 1 left out
    assert f.idle_share == pytest.approx(0.625)            # 1 - (0.25 + 0.5) / 2
    assert f.lag_share == {0: 1.0}
    worker = [
        {"step": 2, "perf/time_step_s": 1.0, "async/worker_generate_s": 0.5, "async/trained_tokens": 70.0,
         "stream/worker_tokens": 80.0, "perf/time_old_logp_s": 0.2, "perf/time_update_s": 0.6,
         "reward/response_len": 1.0, "offpolicy/lag_tokens_0": 1.0, "offpolicy/lag_tokens_1": 3.0},
        {"step": 3, "perf/time_step_s": 1.0, "async/worker_generate_s": 0.5, "async/trained_tokens": 50.0,
         "stream/worker_tokens": 40.0, "perf/time_old_logp_s": 0.2, "perf/time_update_s": 0.6,
         "reward/response_len": 1.0, "offpolicy/lag_tokens_0": 0.0, "offpolicy/lag_tokens_1": 4.0},
    ]
    f = flow(worker, rows_per_step=4)
    assert f.gen_tokens_per_s == pytest.approx(120.0)          # the worker's own count, not the trained tokens
    assert f.idle_share == pytest.approx(0.2)
    assert f.lag_share == {0: pytest.approx(0.125), 1: pytest.approx(0.875)}
    assert flow([{"step": 2, "eval/accuracy": 0.1}], 4) == type(f)(None, None, {})     # TRL: nothing logged


def test_the_flow_table_gives_each_arm_its_medians():
    arms = parse_arms("sync,stream-k1-grpo")
    runs = [{"arm": "sync", "flow": {"gen_tokens_per_s": 100.0, "idle_share": 0.5, "lag_share": {"0": 1.0}}},
            {"arm": "sync", "flow": {"gen_tokens_per_s": 300.0, "idle_share": 0.7, "lag_share": {"0": 1.0}}},
            {"arm": "stream-k1-grpo", "flow": {"gen_tokens_per_s": None, "idle_share": 0.25,
                                               "lag_share": {"0": 0.25, "1": 0.75}}}]
    text = bench_tta.flow_table(runs, arms)
    assert "| sync | 200 | 60% | 0: 100% |" in text
    assert "| stream-k1-grpo | — | 25% | 0: 25%, 1: 75% |" in text
    assert bench_tta.flow_table([{"arm": "sync"}], arms) == ""


def test_records_name_no_path_of_the_machine(tmp_path):
    """A recorded command keeps no absolute path: the interpreter reads ``python``, the repository's files are
    relative to its root and the scratch folders (the run's and --warm-cache) read ``<tmp>``."""
    work, cache = tmp_path / "bench_tta_x", tmp_path / "cache"
    cmd = [sys.executable, str(bench_tta.HERE / "bench_tta.py"), "--trl-child", str(work / "trl-0"),
           f"model.path={cache}/longtail-seed0/warm", "--out", "experiments/results/x", "seed=3"]
    assert bench_tta.portable(cmd, [work, cache]) == [
        "python", "experiments/bench/bench_tta.py", "--trl-child", "<tmp>/trl-0", "model.path=<tmp>/longtail-seed0/warm",
        "--out", "experiments/results/x", "seed=3"]
    assert bench_tta.portable(["--warm-cache", str(cache)], [cache, None]) == ["--warm-cache", "<tmp>"]
    # the record's args: the argv list too (it once kept --warm-cache's folder as it was)
    assert bench_tta.recorded_arg(["--warm-cache", str(cache), "--steps", "5"], str(cache)) == [
        "--warm-cache", "<tmp>", "--steps", "5"]
    assert bench_tta.recorded_arg(str(cache / "w"), str(cache)) == "<tmp>/w"
    assert bench_tta.recorded_arg(5, str(cache)) == 5 and bench_tta.recorded_arg([1, 2], str(cache)) == [1, 2]
