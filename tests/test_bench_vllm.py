"""experiments/bench/bench_vllm.py: its pure parts (grid and arms, interleaved order, prompts of a given length,
seeds, CPU-time accounting, summary, markdown table; no vLLM needed), the built-in engine's fixed-length decoding,
and (marker ``vllm``) the bench's smallest point end to end."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

import _vllm_bench as vb  # noqa: E402
import bench_vllm  # noqa: E402


# ------------------------------------------------------------------------------------------------------------ grid
def test_points_parse_group_by_hidden_and_refuse_nonsense():
    assert vb.parse_points("64:32, 512:128,64:512,64:32") == [(64, 32), (64, 512), (512, 128)]
    for bad in ("64", "64:x", "0:32", "", "64:32:1"):
        with pytest.raises(ValueError, match="--points"):
            vb.parse_points(bad)
    assert vb.product_points([64, 256], [32, 128]) == [(64, 32), (64, 128), (256, 32), (256, 128)]
    assert vb.parse_ints("32,128,32", "new-tokens") == [32, 128]
    with pytest.raises(ValueError, match="--new-tokens"):
        vb.parse_ints("32,abc", "new-tokens")


def test_choices_keep_the_canonical_order_and_refuse_unknown_names():
    assert vb.parse_choices("process,inproc", "modes", vb.MODES) == ["inproc", "process"]
    with pytest.raises(ValueError, match="--sampling: unknown"):
        vb.parse_choices("seeds,beam", "sampling", vb.SAMPLINGS)


def test_arms_of_the_grid_and_the_instances_they_share():
    arms = vb.build_arms(["hf", "vllm"], ["inproc", "process"], ["off", "on"], ["seeds", "n", "seeds-pc"])
    assert len(arms) == 2 * (1 + 2 * 3)
    assert arms[0] == vb.Arm("hf", False) and arms[0].label == "built-in"
    n_arm = vb.Arm("vllm", True, "inproc", "n")
    assert n_arm.prefix_caching and n_arm.label == "vLLM inproc n=G +cache +routes"
    assert not vb.Arm("vllm", False, "process", "seeds").prefix_caching
    # n and seeds-pc run on one prefix-caching engine; seeds on its own; routes and modes never share
    keys = {a.instance for a in arms if a.engine == "vllm"}
    assert len(keys) == 2 * 2 * 2
    assert vb.Arm("vllm", True, "inproc", "n").instance == vb.Arm("vllm", True, "inproc", "seeds-pc").instance
    assert vb.build_arms(["vllm"], ["inproc"], ["on"], ["seeds"]) == [vb.Arm("vllm", True, "inproc", "seeds")]


def test_cli_grid_quick_default_and_product():
    g = bench_vllm.grid(bench_vllm.parse_args([]))
    assert g["points"] == [(64, 32), (64, 128), (64, 512), (256, 128), (512, 128)]
    assert len(g["arms"]) == 10 and g["hidden"] == [64, 256, 512]
    q = bench_vllm.parse_args(["--quick"])
    gq = bench_vllm.grid(q)
    assert gq["points"] == [(64, 32)] and q.prompts * q.group == 16 and len(gq["arms"]) == 10
    p = bench_vllm.grid(bench_vllm.parse_args(["--hidden", "64,512", "--new-tokens", "32"]))
    assert p["points"] == [(64, 32), (512, 32)]
    with pytest.raises(ValueError, match="multiple of the head size"):
        bench_vllm.grid(bench_vllm.parse_args(["--points", "100:32"]))


def test_rounds_interleave_forward_then_reversed():
    assert [vb.round_order("ABC", r) for r in range(3)] == [list("ABC"), list("CBA"), list("ABC")]


# --------------------------------------------------------------------------------------------------- prompts, seeds
def test_few_shot_prompt_has_exactly_the_asked_length():
    shots = ["3+4=7 ", "12+1=13 "]
    text = vb.few_shot_prompt("9+9+7=", shots, 40)
    assert len(text) + 1 == 40 and text.endswith("9+9+7=")
    assert vb.few_shot_prompt("9+9+7=", shots, 0) == "9+9+7="
    assert vb.few_shot_prompt("9+9+7=", shots, 7) == "9+9+7="
    with pytest.raises(ValueError, match="shorter than the prompt"):
        vb.few_shot_prompt("9+9+7=", shots, 5)


def test_vllm_seeds_give_every_answer_its_own_seed():
    seeds = vb.vllm_seeds(1234, prompts=16, group=8)
    drawn = [s + g for s in seeds for g in range(8)]
    assert len(set(drawn)) == 128 and all(0 <= s < 2**31 for s in drawn)
    assert seeds == vb.vllm_seeds(1234, 16, 8) and seeds != vb.vllm_seeds(1235, 16, 8)


# ----------------------------------------------------------------------------------------------------------- CPU
def _times(user, system, cu=0.0, cs=0.0):
    return SimpleNamespace(user=user, system=system, children_user=cu, children_system=cs)


def test_cpu_split_counts_own_processes_and_reaped_children_once():
    before = {1: _times(1.0, 0.5), 2: _times(2.0, 0.0), 3: _times(0.5, 0.5)}
    # process 3 (a descendant of 2) ended in between and was reaped by 2: its 1.4 s moved into 2's children_*
    after = {1: _times(1.5, 0.5), 2: _times(2.5, 0.0, cu=1.2, cs=0.2)}
    own0, all0 = vb.split_cpu_seconds(before, own={1, 2, 3})
    own1, all1 = vb.split_cpu_seconds(after, own={1, 2, 3})
    assert own1 - own0 == pytest.approx(0.5 + 0.5 + (1.4 - 1.0))
    assert all1 - all0 == pytest.approx(own1 - own0)
    mine0, _ = vb.split_cpu_seconds(before, own={1})
    mine1, _ = vb.split_cpu_seconds(after, own={1})
    assert mine1 - mine0 == pytest.approx(0.5)


_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n{tail}"


def test_cpu_meter_counts_a_child_that_lived_inside_the_window_and_one_still_running():
    meter = vb.CpuMeter()
    own0, all0 = meter.read()
    subprocess.run([sys.executable, "-c", _BURN.format(s=0.3, tail="")], check=True)     # started, burned, reaped
    own1, all1 = meter.read()
    assert own1 - own0 >= 0.28 and all1 - all0 >= 0.28
    child = subprocess.Popen([sys.executable, "-c", _BURN.format(s=0.3, tail="time.sleep(30)")])

    def child_cpu() -> tuple[float, float]:
        """(the child's CPU as the arm's own process, as part of the total), this process's own CPU left out"""
        with_child, total = meter.read([child.pid])
        alone, _ = meter.read()
        return with_child - alone, total - alone
    try:
        # two clock ticks of slack, as above: the two reads of child_cpu() are apart, and this process's own CPU
        # between them is subtracted from the child's (a CI run read 0.29 once)
        deadline = time.time() + 20
        named, in_total = child_cpu()
        while time.time() < deadline and named < 0.28:
            time.sleep(0.05)
            named, in_total = child_cpu()
        assert named >= 0.28 and in_total >= 0.28        # a live child: the arm's own when named, always in the total
    finally:
        child.kill()
        child.wait()


# spins (says so on stdout first) until the file argv[1] exists, then idles
_SPIN = ("import os, sys, time\n"
         "print('spinning', flush=True)\n"
         "while not os.path.exists(sys.argv[1]):\n    pass\n"
         "time.sleep(60)\n")


def _await_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The next line ``proc`` prints (the assertion names it when none comes in ``timeout`` seconds)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the child printed nothing in {timeout:.0f} s"
    return proc.stdout.readline()


def test_settle_waits_out_a_spinning_child_and_counts_its_cpu(tmp_path):
    """A child spins, then idles: ``settle`` waits through the windows it spins in (two at least: one that sees the
    spin, one that sees the quiet) and counts its CPU; a second call on the idle child returns after one window.
    The child spins until the first window has seen it burn 0.1 CPU s (the test's ``sleep``, which ``settle``
    calls between its readings, waits for that): how fast the machine is changes nothing."""
    meter = vb.CpuMeter()
    assert vb.settle(meter, []) == (0.0, 0.0)
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", _SPIN, str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert _await_line(child) == "spinning\n"
        windows: list[float] = []

        def sleep(s):                                    # settle's window, after its first reading
            if not stop.exists():                        # the first: the child burns 0.1 s more, then idles
                cpu = psutil.Process(child.pid).cpu_times
                c0, deadline = sum(cpu()[:2]), time.monotonic() + 60
                while sum(cpu()[:2]) - c0 < 0.1:
                    assert time.monotonic() < deadline, "the child burned no CPU in 60 s"
                    time.sleep(0.01)
                stop.touch()
            windows.append(s)
            time.sleep(s)

        waited, burned = vb.settle(meter, [child.pid], window=0.1, limit=600.0, sleep=sleep)
        assert len(windows) >= 2 and 0.2 <= waited < 600.0 and burned > 0.05
        windows.clear()
        waited, burned = vb.settle(meter, [child.pid], window=0.1, sleep=sleep)   # now idle: one window
        assert windows == [0.1] and burned < 0.02
    finally:
        child.kill()
        child.wait()


def test_timed_returns_wall_and_cpu():
    meter = vb.CpuMeter()
    clock = iter([10.0, 12.5]).__next__
    out, wall, own, total = vb.timed(lambda: sum(range(200_000)), meter, clock)
    assert out == sum(range(200_000)) and wall == 2.5 and 0 <= own <= total + 1e-6


# ------------------------------------------------------------------------------------------------- summary, table
def _result():
    def arm(label_arm, tps, cpu_s, **extra):
        rounds = [{"tokens": 1000, "wall_s": 1000 / t, "cpu_s": c, "cpu_s_all": c + 0.1} for t, c in zip(tps, cpu_s)]
        if label_arm.engine == "vllm":
            for x, spin in zip(rounds, [0.8, 0.85, 0.9]):
                x["spin_cpu_s"] = spin
        return {"arm": label_arm.to_json(), **vb.summarize(rounds), "rounds": rounds, **extra}
    hf = vb.Arm("hf", True)
    v = vb.Arm("vllm", True, "inproc", "n")
    return {"machine": {"cpu_model": "AMD EPYC", "cpus": 2, "avx512f": False, "amx": False, "torch": "2.13",
                        "vllm": "0.27.1", "transformers": "5.24"},
            "args": {"prompts": 8, "group": 8, "rounds": 3, "threads": 1},
            "instances": [{"hidden": 64, "mode": "inproc", "prefix_caching": True, "routes": True, "start_s": 1.5,
                           "worker": {"threads": 1, "affinity": [0, 1]}}],
            "points": [{"hidden": 64, "new_tokens": 32, "prompt_tokens": 136, "load": [0.5, 0.7, 0.6],
                        "arms": [arm(hf, [2000, 1000, 3000], [0.5, 1.0, 0.4]),
                                 arm(v, [500, 600, 700], [2.0, 2.0, 3.0], route_coverage=0.425,
                                     cached_prompt_fraction=None)]}]}


def test_summary_is_the_median_of_rounds():
    s = _result()["points"][0]["arms"][0]
    assert s["tokens_per_s"] == 2000 and s["tokens_per_s_rounds"] == [2000, 1000, 3000]
    assert s["cpu_s_per_1k"] == pytest.approx(0.5) and s["cpu_s_per_1k_all"] == pytest.approx(0.6)
    assert s["spin_cpu_s"] is None and _result()["points"][0]["arms"][1]["spin_cpu_s"] == 0.85


def test_markdown_table_rows_ratio_and_machine_line():
    md = vb.markdown_table(_result())
    lines = md.splitlines()
    assert lines[0].startswith("| hidden | prompt | new tokens | arm | tokens/s (median)")
    row = next(ln for ln in lines if "vLLM inproc n=G +cache +routes" in ln)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["64", "136", "32", "vLLM inproc n=G +cache +routes", "600"]
    assert cells[5] == "500 / 600 / 700" and cells[6] == "2.000" and cells[7] == "0.85" and cells[8] == "0.30×"
    assert cells[9] == "—" and cells[10] == "0.425" and cells[11] == "0.50–0.70"
    hf_cells = [c.strip() for c in next(ln for ln in lines if "| built-in +routes |" in ln).strip("|").split("|")]
    assert hf_cells[7] == "—" and hf_cells[8] == "—"
    assert "AMD EPYC" in md and "avx512f False" in md and "vLLM 0.27.1" in md
    assert "| 64 | vLLM inproc, prefix cache, routes | 1.5 | 1 | [0, 1] |" in md        # start-ups
    res = {**_result(), "sync": [{"hidden": 64, "params": 225216, "engine": "vllm", "sync_s": 0.15, "start_s": 20.0,
                                  "load": [0.4, 0.6]}]}
    assert "| 64 | 225,216 | vllm | 0.1500 | 20.0 | 0.40–0.60 |" in vb.markdown_table(res)


def test_table_flag_prints_a_saved_result(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    bench_vllm.main(["--table", str(path)])
    assert "vLLM inproc n=G +cache +routes" in capsys.readouterr().out


def test_cpu_flags_from_lscpu_and_cpuinfo_text():
    info = vb.cpu_model_and_flags("Architecture: x86_64\nModel name:   Intel Xeon 8480\n",
                                  "processor: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n")
    assert info == {"cpu_model": "Intel Xeon 8480", "avx2": True, "avx512f": True, "amx": True,
                    "amx_flags": ["amx_bf16", "amx_tile"]}
    assert vb.cpu_model_and_flags("Model name: AMD EPYC\n", "flags : fpu avx2\n")["avx512f"] is False


# ------------------------------------------------------------------------------------------ built-in engine, fixed N
def test_built_in_engine_decodes_exactly_n_tokens_with_the_eos_free_tokenizer():
    import torch

    from offpolicy_moe.config import load_config
    from offpolicy_moe.models.loading import build_model
    from offpolicy_moe.rollout.engine import make_engine
    from offpolicy_moe.tasks import build_char_tokenizer, encode_prompts

    tok = build_char_tokenizer()
    free = bench_vllm.no_eos_tokenizer(tok)
    assert free.eos_token_id == -1 and tok.eos_token_id == 2 and len(free) == len(tok)
    assert torch.equal(encode_prompts(free, ["3+4=", "12+1="])[0], encode_prompts(tok, ["3+4=", "12+1="])[0])
    cfg = load_config(overrides=["model.head_dim=32", "rollout.max_new_tokens=24", "rollout.dtype=float32"])
    model = build_model(cfg.model, tok, seed=0)
    for record in (False, True):
        eng = make_engine(model, free, cfg.rollout, record_routes=record, seed=0)
        batch = eng.generate(["3+4="] * 4, ["7"] * 4, group_size=8, seed=3)
        assert int(batch.response_mask.sum()) == 32 * 24
        assert int((batch.input_ids[:, batch.prompt_len:] == tok.eos_token_id).sum()) > 0    # EOS drawn, decoded on
    plain = make_engine(model, tok, cfg.rollout, seed=0).generate(["3+4="] * 4, ["7"] * 4, group_size=8, seed=3)
    assert int(plain.response_mask.sum()) < 32 * 24                                          # the real EOS stops


# --------------------------------------------------------------------------------------------------- end to end
@pytest.mark.vllm
def test_quick_run_end_to_end(tmp_path):
    """Every arm (built-in, vLLM in-process and in its own process, seeds and n=G, routes off and on) at the
    smallest point, through the command line."""
    if os.environ.get("OFFPOLICY_MOE_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm")
    out = tmp_path / "q.json"
    r = subprocess.run([sys.executable, str(BENCH / "bench_vllm.py"), "--quick", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (pt,) = res["points"]
    assert (pt["hidden"], pt["new_tokens"]) == (64, 32) and len(pt["arms"]) == 10
    assert all(pt["vllm_same_tokens"])                       # n=G draws what G seeded requests draw
    for a in pt["arms"]:
        assert a["tokens_per_s"] > 0 and a["cpu_s_per_1k"] > 0 and len(a["rounds"]) == 2
        assert all(x["tokens"] == 16 * 32 for x in a["rounds"])
        if a["arm"]["engine"] == "vllm" and a["arm"]["routes"]:
            full = a["arm"]["sampling"] == "seeds"
            assert (a["route_coverage"] == pytest.approx(1.0)) == full    # cached blocks are never routed
    assert {i["mode"] for i in res["instances"]} == {"inproc", "process"}
    assert out.with_suffix(".md").read_text().count("| 64 | 136 | 32 |") == 10
