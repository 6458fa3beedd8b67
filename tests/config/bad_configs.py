"""The list of bad configurations that ``train --dry-run`` must refuse, each naming its key (issue 13 item 7).

Every entry was accepted by ``--dry-run`` before (silently, with a traceback on the real start, or only with a
warning). ``{tmp}`` is replaced by a folder prepared by :func:`make_fixture_files`.
"""
from __future__ import annotations

import json
from pathlib import Path

# (overrides, key the one-line message must name)
BAD_CONFIGS: list[tuple[tuple[str, ...], str]] = [
    # non-finite numbers: NaN passes every `<` test, inf passes every `>` test
    (("algo.kl.coef=nan",), "algo.kl.coef"),
    (("algo.kl.coef=inf",), "algo.kl.coef"),
    (("rollout.router_noise=nan",), "rollout.router_noise"),
    (("optim.grad_clip=nan",), "optim.grad_clip"),
    (("optim.lr=inf",), "optim.lr"),
    (("optim.weight_decay=nan",), "optim.weight_decay"),
    (("rollout.temperature=inf",), "rollout.temperature"),
    (("algo.correction.low=nan",), "algo.correction.low"),
    (("algo.loss.options.clip_high=inf",), "algo.loss.options"),
    (("algo.routing.pr2_lr_mult=inf",), "algo.routing.pr2_lr_mult"),
    (("trainer.min_free_mb=nan",), "trainer.min_free_mb"),
    (("trainer.sft_lr=nan",), "trainer.sft_lr"),
    # ranges no rule covered
    (("trainer.keep_checkpoints=-1",), "trainer.keep_checkpoints"),
    (("trainer.threads=-3",), "trainer.threads"),
    (("algo.loss.norm_length=0",), "algo.loss.norm_length"),
    (("algo.router_aux_loss_coef=-1",), "algo.router_aux_loss_coef"),
    (("trainer.sft_lr=0",), "trainer.sft_lr"),
    (("trainer.sft_batch_size=0",), "trainer.sft_batch_size"),
    (("trainer.eval_batch_size=0",), "trainer.eval_batch_size"),
    (("trainer.min_free_mb=-1",), "trainer.min_free_mb"),
    (("buffer.max_delay=-1", "buffer.mode=bounded"), "buffer.max_delay"),
    # refused by a real start, passed by --dry-run
    (("trainer.steps=0",), "trainer.steps"),
    (("model.hidden_size=40",), "model.hidden_size"),
    (("model.num_experts=1", "model.top_k=1"), "model.num_experts"),
    (("task.name=jsonl:{tmp}/missing.jsonl",), "task.name"),
    (("task.name=jsonl:{tmp}/malformed.jsonl",), "malformed.jsonl:2"),
    (("task.name=jsonl:{tmp}/latin1.jsonl",), "latin1.jsonl:1"),
    (("task.name=jsonl:{tmp}/empty_answer.jsonl",), "empty_answer.jsonl:1"),
    (("task.name=jsonl:{tmp}/one_prompt.jsonl",), "task.name"),
    (("task.name=jsonl:{tmp}",), "task.name"),
    (("model.path={tmp}/missing_model",), "model.path"),
    (("model.path={tmp}/not_a_model",), "model.path"),
    (("model.path={tmp}/garbage_config",), "model.path"),
    (("model.path={tmp}/no_tokenizer",), "model.path"),
    # infeasible by construction
    (("buffer.staleness=5", "trainer.steps=5"), "buffer.staleness"),
    (("buffer.mode=bounded", "buffer.max_delay=100000", "trainer.steps=5"), "buffer.max_delay"),
    (("task.min_digits=3", "task.max_digits=3", "task.num_terms=2", "task.operators=*",
      "rollout.max_new_tokens=4"), "rollout.max_new_tokens"),
]


def make_fixture_files(tmp: Path) -> None:
    """Write the task files and model folders the ``{tmp}`` entries of :data:`BAD_CONFIGS` point at."""
    (tmp / "malformed.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 1+1}\n')
    (tmp / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    (tmp / "empty_answer.jsonl").write_text('{"prompt": "1+1=", "answer": " "}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp / "one_prompt.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 3)
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "notes.txt").write_text("not a model")
    (tmp / "garbage_config").mkdir()
    (tmp / "garbage_config" / "config.json").write_text("{not json")
    (tmp / "garbage_config" / "tokenizer.json").write_text("{}")
    (tmp / "no_tokenizer").mkdir()
    (tmp / "no_tokenizer" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                                  "num_experts_per_tok": 2, "vocab_size": 32}))


def resolve(overrides: tuple[str, ...], tmp: Path) -> list[str]:
    """The overrides with ``{tmp}`` replaced."""
    return [o.replace("{tmp}", str(tmp)) for o in overrides]
