"""The documented keys of ``metrics.jsonl`` (stable names: tables and plots key on them).

Every record has an integer ``step`` (trained steps so far; 0 = the evaluation before RL) and float metrics from
the families below.  :data:`DOCUMENTED_KEYS` maps each key to its meaning; :data:`DOCUMENTED_PREFIXES` lists
families whose exact keys depend on the objective (e.g. ``actor/clipfrac_low`` exists only for clipped losses).
A test checks that every key a run writes is documented here.
"""
from __future__ import annotations

DOCUMENTED_KEYS: dict[str, str] = {
    # reward (computed when the batch is consumed)
    "reward/mean": "mean reward of the consumed batch",
    "reward/errors": "rows whose reward function failed and scored 0 (task.on_reward_error=zero)",
    "reward/math_timeouts": "answers the math reward gave up on after task.math_timeout_s",
    "reward/std": "std of the rewards of the consumed batch",
    "reward/frac_zero_std": "fraction of groups whose rewards are all equal (advantage 0)",
    "reward/response_len": "mean response length in tokens (EOS included)",
    "rollout/prompt_len": "the consumed batch's padded prompt width (the KV columns at its first decode forward)",
    "reward/adv_abs_mean": "mean |advantage| over sequences",
    # actor (averaged over the step's micro-batches)
    "actor/loss": "policy loss (sum of micro-batch shares, averaged over mini-batches)",
    "actor/grad_norm": "gradient norm before clipping (mean over the step's optimizer updates)",
    "actor/clipfrac": "fraction of tokens where the clipped branch is active",
    "actor/ppo_kl": "masked mean of old_logp - logp",
    "actor/ratio_mean": "masked mean of r = pi_theta / pi_old",
    "actor/lr": "learning rate of the policy parameter group",
    "actor/nan_skipped": "cumulative batches and optimizer updates skipped for a NaN/Inf (trainer.on_nan=skip), all stages",
    "actor/updates": "cumulative optimizer updates applied",
    "actor/kl_ref": "reference-KL penalty value (when algo.kl.coef > 0)",
    # train/inference mismatch between engine behav_logp and trainer old_logp
    "mismatch/k3_kl": "k3 KL between the trainer's old_logp (as used) and the engine's behav_logp",
    "mismatch/extreme_frac": "fraction of tokens with max(rho, 1/rho) > 2",
    "mismatch/k3_kl_r3": "k3 KL when the trainer replays the engine's routes (R3)",
    "mismatch/k3_kl_no_r3": "k3 KL when the trainer routes by itself (no replay)",
    "mismatch/extreme_frac_r3": "extreme-token fraction with R3 replay",
    "mismatch/extreme_frac_no_r3": "extreme-token fraction without replay",
    # routing (engine routes vs the trainer's own top-k on the same tokens; MoE models)
    "routing/decision_mismatch": "fraction of (token, layer) whose expert set differs: engine route vs the trainer's own top-k at the rollout policy, before any update",
    "routing/token_mismatch": "fraction of tokens with >= 1 differing layer (same comparison, same point)",
    # off-policyness
    "offpolicy/staleness_steps": "policy version lag (trainer version - batch version) of the consumed batch",
    "offpolicy/staleness_updates": "staleness in optimizer updates = staleness_steps x updates_per_step",
    "offpolicy/batch_version": "policy version that generated the consumed batch",
    "offpolicy/generated_at": "trainer iteration that generated the consumed batch (no batch lost or reused)",
    "offpolicy/dropped": "cumulative batches dropped by the bounded buffer",
    "offpolicy/buffer_size": "batches waiting in the buffer after the step",
    "offpolicy/staleness_max": "largest lag over the consumed batch's response tokens (<= buffer.staleness)",
    "offpolicy/versions_per_row_max": "most policy versions among one row's response tokens (2+: a row continued across a weight update)",
    # asynchronous pipeline (buffer.mode=async, docs/async.md), seconds since the previous step
    "async/trainer_wait_s": "seconds the trainer waited for the batch (old-log-prob passes excluded)",
    "async/weight_sync_s": "seconds publishing weights to the workers",
    "async/worker_wait_s": "seconds workers waited for an iteration they may start (the staleness bound)",
    "async/worker_generate_s": "seconds workers spent generating",
    "async/worker_cpu_s": "CPU seconds of the workers (weight loading and generation)",
    "async/worker_pack_s": "seconds workers spent building and packing results for the pipe",
    "async/worker_send_s": "seconds workers stood blocked writing results into a full pipe",
    "async/worker_wall_s": "the workers' wall seconds these parts cover (async: the sum of wait, sync, generate, pack "
                           "and send; stream: the clock between reports, loop bookkeeping included)",
    "async/worker_blocked_share": "async/worker_send_s over async/worker_wall_s: the share of the workers' time "
                                  "blocked on the result pipe",
    "async/worker_restarts": "cumulative rollout worker restarts",
    "async/trained_tokens": "response tokens of the consumed batch",
    # streaming rollouts (buffer.mode=stream, docs/async.md "Streaming")
    "stream/generated_len_mean": "mean response length of the rows received since the previous step",
    "stream/trained_len_mean": "mean response length of the rows the step trained",
    "stream/ks_trained_vs_generated": "Kolmogorov-Smirnov distance between the lengths of every row trained so far and every row received",
    "stream/dropped_late": "cumulative groups dropped for exceeding buffer.staleness (buffer.admission=first_finished)",
    "stream/outstanding": "groups issued and neither trained nor dropped, after the step",
    "stream/worker_tokens": "response tokens the workers finished since the previous step",
    # the update's levers
    "actor/zero_adv_share": "share of the consumed batch's rows whose advantage is exactly 0",
    "actor/rows_skipped_share": "share of rows whose update forward and backward were skipped (skip_zero_advantage)",
    # performance
    "perf/gen_tokens_per_s": "generated response tokens per second (this iteration's generation)",
    "perf/update_tokens_per_s": "tokens (prompt + response) per second through the update forward/backward",
    "perf/forward_plain": "1 when the last update forward ran the plain [B, S] rows (models/forward_plan.py)",
    "perf/forward_pack": "1 when it ran packed [prompt | r_1 | ... | r_c] rows",
    "perf/forward_cache": "1 when it ran a prompt pass whose KV cache the response pass shared",
    "perf/forward_est_speedup": "the cost model's estimate of plain cost / chosen cost for that forward",
    "perf/time_generate_s": "seconds in generation",
    "perf/time_old_logp_s": "seconds recomputing old log-probs (and mismatch/routing measurements)",
    "perf/time_update_s": "seconds in the optimizer updates",
    "perf/time_eval_s": "seconds in evaluation",
    "perf/time_eval_sampled_s": "seconds of the sampled evaluation (eval.samples > 0), a part of perf/time_eval_s",
    "perf/time_step_s": "seconds of the whole step (generation of warm-up iterations and evaluation included)",
    "perf/time_batch_s": "seconds the step waited on its batch source (generation, the old-log-prob pass and "
                         "waiting for workers, as the source splits them)",
    "perf/time_publish_s": "seconds publishing the step's weights to generation",
    "perf/time_other_s": "seconds of the step in none of batch, update, evaluation and publish (the loop's "
                         "bookkeeping)",
    "perf/elapsed_s": "wall seconds of the training loop so far (evaluation included, start-up and SFT not), over segments",
    "perf/trainer_threads": "torch threads the step's trainer ran with (trainer.follow_threads sets the next step's)",
    # non-finite values skipped, by the stage where they appeared (trainer.on_nan=skip; docs/faults.md)
    "nan/generation": "cumulative batches dropped: sampling met non-finite logits or behaviour log-probs",
    "nan/old_logp": "cumulative batches dropped: the old-log-prob pass gave NaN/Inf",
    "nan/reference": "cumulative batches dropped: the reference model's log-probs were NaN/Inf",
    "nan/metrics": "cumulative batches dropped: the mismatch/routing measurement pass gave NaN/Inf",
    "nan/loss": "cumulative optimizer updates skipped: a NaN/Inf loss (or loss input)",
    "nan/gradients": "cumulative optimizer updates skipped: a NaN/Inf gradient norm",
    "nan/optimizer": "cumulative optimizer updates undone: NaN/Inf parameters after the optimizer step",
    "nan/evaluation": "cumulative steps undone: greedy evaluation met NaN/Inf logits (or the sampled evaluation "
                      "non-finite sampling probabilities)",
    # evaluation
    "eval/accuracy": "greedy exact-match accuracy on the held-out split",
    "eval/partial": "greedy per-digit partial credit on the held-out split",
    "eval/train_accuracy": "greedy exact-match accuracy on the first training prompts (as many as the eval split)",
    "eval/train_partial": "greedy partial credit on the same training prompts",
    "eval/reward": "mean task reward (the weighted sum over the configured rewards) of the greedy held-out answers",
    "eval/unscorable_refs": "held-out problems whose reference the answer check cannot read: excluded from the "
                            "sampled metrics (eval.samples > 0)",
    "eval/no_answer": "sampled responses of the scored problems with no extractable answer (scored wrong, no vote)",
    "eval/scored_problems": "held-out problems the sampled metrics average over",
}

#: families whose keys vary with the objective or mechanism (documented in the losses/routing modules)
DOCUMENTED_PREFIXES: tuple[str, ...] = (
    "rollout/response_len_q",  # q000 ... q100: lower percentiles (every 10) of the consumed rows' response lengths
    "actor/",      # objective-specific: clipfrac_low/high, dual_clipfrac, ratio_max, seq_ratio_*, ...
    "mismatch/",   # correction-specific: is_mean, is_max, is_min, ess, clipped_frac, masked_frac, ...
    "gspo/",       # seq_clipfrac, seq_ratio_mean (sequence-level GSPO statistics)
    "m2po/",       # m2_before, m2_after, masked_frac, trust_region_frac, log_ratio_bound
    "pr2/",        # pred_kl, base_kl, skill_ratio, zero_dev_layer/_token(_r3), bias_route_change, ...
    "routing/",    # engine route vs the trainer's own top-k at the rollout policy (old-log-prob pass)
    "drift/",      # engine route vs the current router's own top-k at off-policy mini-steps (drift_metrics)
    "dynamic_sampling/",   # dropped_groups, kept_share (algo.dynamic_sampling=drop)
    "dppo/", "sapo/", "gmpo/", "vespo/",
    "offpolicy/lag_tokens_",    # offpolicy/lag_tokens_<j>: response tokens of the consumed batch with lag j
    "eval/avg@",     # eval/avg@<n>: mean correctness of the n samples per held-out problem (eval.samples = n)
    "eval/pass@",    # eval/pass@<k>, k = 1, 2, 4, ..., n: the unbiased pass@k of Chen et al. (2021)
    "eval/maj@",     # eval/maj@<k>: the majority vote of k of the n samples is right
    "eval/reward/",  # one per configured reward: eval/reward/<name>, the mean of that reward before its weight   # the 2026 objectives' own statistics (docs/losses.md)
)


def is_documented(key: str, reward_names: tuple[str, ...] = ()) -> bool:
    """True iff ``key`` is ``step``, a documented key, in a documented family, or ``reward/<name>`` /
    ``eval/reward/<name>`` for one of the run's configured ``reward_names`` (``task.rewards``, docs/tasks.md)."""
    if key == "step" or key in DOCUMENTED_KEYS or key.startswith(DOCUMENTED_PREFIXES):
        return True
    return any(key in (f"reward/{name}", f"eval/reward/{name}") for name in reward_names)
