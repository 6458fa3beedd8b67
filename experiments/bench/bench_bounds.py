"""The machine's bounds for a run's two phases, measured on the bare model: what generation and the update could cost
with no engine, trainer or Python bookkeeping around the forward.

* **decode grid**: one decode forward (a KV cache pre-filled to ``C`` columns, one new token in each of ``R`` rows;
  the cache cut back to ``C`` after each forward), milliseconds, for every ``--rows`` x ``--columns``; and the tokens
  per second it allows (``R / t``).  Two grids: the lean forward (``rollout/decode_step.py`` on the single-query
  kernel and a pre-allocated cache: the fastest forward the project runs, the bound ``bench_tta`` charges), and
  transformers' own forward on its cache and attention;
* **bare update**: forward + backward of the model on ``B`` rows of ``T`` tokens (the sum of the tokens'
  log-probabilities as the loss), and the forward alone (the old-log-prob pass's bound), milliseconds;
* **peak**: the CPU's (or device's) FLOP rate from a measured ``N x N`` matmul in the run's dtype, and the update's
  MFU against it, counting ``6 * N_active * tokens`` FLOPs for a forward + backward (Kaplan et al., 2020,
  https://arxiv.org/abs/2001.08361; the attention's share left out: a lower bound of the work), where ``N_active``
  is what one token multiplies with: every weight but the input embedding (a lookup), each routed expert's share
  ``k / E`` (top-k of E experts).

Each cell is the median of ``--repeats`` timed calls after ``--warmup``; the load average and the CPU model are
printed with the tables.  The model is the embedded one (``--layers --hidden --experts --head-dim`` as
``model.*``), in ``--dtype``, on ``--threads`` threads.

    python experiments/bench/bench_bounds.py --rows 1 8 32 128 --columns 32 64 128 256 512 --batch 128 --tokens 48
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Callable

import torch

from _machine import cpu_model
from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.models.dtypes import resolve_dtype
from offpolicy_moe.models.layout import cache_kwarg
from offpolicy_moe.models.moe_shape import moe_shape
from offpolicy_moe.rollout.decode_attention import use_single_query_decode
from offpolicy_moe.rollout.decode_step import DecodeForward
from offpolicy_moe.rollout.kv_cache import preallocated_cache


def timed(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_ms(model: torch.nn.Module, rows: int, columns: int, repeats: int, warmup: int, *,
              lean: bool = False) -> float:
    """One bare decode forward: ``rows`` new tokens against a cache of ``columns`` positions (ms).  ``lean``: the
    fastest decode forward the project runs for this model (a copy on the single-query kernel, a pre-allocated
    cache, ``rollout/decode_step.py``'s forward where the family is mirrored); else transformers' forward on its
    own cache and attention."""
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, columns), generator=gen)
    nxt = torch.randint(4, vocab, (rows, 1), generator=gen)
    pos = torch.full((rows, 1), columns, dtype=torch.long)
    key = cache_kwarg(model)
    if lean:
        model = copy.deepcopy(model).eval()
        use_single_query_decode(model)
        cache, forward = preallocated_cache(model.config, columns + 1), DecodeForward(model)
        mask = torch.ones(rows, columns + 1, dtype=torch.long)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{key: cache})

        def call() -> None:
            forward(nxt, mask, pos, cache)
    else:
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values

        def call() -> None:
            model(input_ids=nxt, position_ids=pos, use_cache=True, **{key: cache})

    def step() -> None:
        with torch.no_grad():
            call()
        cache.crop(-1)                                  # back to ``columns`` positions

    return 1e3 * timed(step, repeats, warmup)


def update_ms(model: torch.nn.Module, batch: int, tokens: int, repeats: int, warmup: int) -> tuple[float, float]:
    """``(forward + backward, forward alone)`` of the model on ``batch`` rows of ``tokens`` tokens (ms): the loss is
    the sum of the tokens' log-probabilities, as a policy-gradient loss reads them."""
    vocab = int(model.config.vocab_size)
    ids = torch.randint(4, vocab, (batch, tokens), generator=torch.Generator().manual_seed(1))

    def logp_sum() -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).sum()

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        logp_sum().backward()

    def fwd() -> None:
        with torch.no_grad():
            logp_sum()

    return 1e3 * timed(fwd_bwd, repeats, warmup), 1e3 * timed(fwd, repeats, warmup)


def active_parameters(model: torch.nn.Module) -> int:
    """Weights one token multiplies with: all but the input embedding, routed experts' tensors at ``k / E``."""
    num_experts, top_k = moe_shape(model.config)
    share = (top_k / num_experts) if num_experts and top_k else 1.0
    embed = model.get_input_embeddings().weight
    total = 0.0
    for name, t in model.named_parameters():
        if t is embed:
            continue
        total += t.numel() * (share if ".experts." in name else 1.0)
    return int(total)


def peak_flops(n: int, dtype: torch.dtype, repeats: int, warmup: int) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs a call)."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, repeats, warmup)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--columns", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--batch", type=int, default=128, help="update rows (prompts x group)")
    p.add_argument("--tokens", type=int, default=48, help="update tokens a row (prompt + response)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--matmul", type=int, default=1024, help="N of the peak-rate matmul")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    for name in ("rows", "columns"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.batch, args.tokens, args.repeats, args.matmul) < 1 or args.tokens < 2 or args.warmup < 0:
        p.error("--batch, --repeats and --matmul must be >= 1, --tokens >= 2, --warmup >= 0")
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    model, _ = load_policy(ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_experts=args.experts,
                                       head_dim=args.head_dim), seed=0)
    model = model.to(dtype).eval()
    params = sum(t.numel() for t in model.parameters())
    active = active_parameters(model)
    print(f"{cpu_model()}; torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; model "
          f"{args.layers} layers x {args.hidden} hidden, {args.experts} experts, {params:,} parameters ({active:,} active a token); "
          f"load average {os.getloadavg()}")
    for lean, what in ((True, "the lean decode forward (the bound bench_tta uses)"),
                       (False, "transformers' own decode forward")):
        print(f"\ndecode grid, {what}: ms per bare decode forward (tokens/s it allows)\n")
        print("| rows \\ KV columns | " + " | ".join(str(c) for c in args.columns) + " |")
        print("| --- |" + " --- |" * len(args.columns))
        for r in args.rows:
            cells = [decode_ms(model, r, c, args.repeats, args.warmup, lean=lean) for c in args.columns]
            print(f"| {r} | " + " | ".join(f"{ms:.2f} ({r / ms * 1e3:,.0f})" for ms in cells) + " |")
    model.train()
    both, fwd = update_ms(model, args.batch, args.tokens, args.repeats, args.warmup)
    peak = peak_flops(args.matmul, dtype, args.repeats, args.warmup)
    work = 6 * active * args.batch * args.tokens
    print(f"\nbare update, {args.batch} x {args.tokens} tokens: forward + backward {both:.1f} ms, forward alone "
          f"{fwd:.1f} ms")
    print(f"peak: {peak / 1e9:,.1f} GFLOP/s ({args.matmul}^2 matmul, {args.dtype}); the bare update's MFU "
          f"{work / (both / 1e3) / peak:.1%} (6 x active parameters x tokens = {work / 1e9:.2f} GFLOP)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
