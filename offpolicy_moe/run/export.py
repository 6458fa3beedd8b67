"""Export a trained policy as a standard Hugging Face checkpoint that loads with no project code
(``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``; vLLM or SGLang can serve it).  The exported model
routes with its own routers: routing replay is a training device.

PR2 predictors go beside the model in ``pr2_predictors.safetensors``: ``layers.<l>.weight`` ``[num_experts,
hidden_size]`` per MoE layer in model order, the router-logit bias of a router input ``h`` being ``h @ W_l.T`` (PR2,
arXiv:2606.00395); its metadata repeats this, and transformers ignores the file.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from offpolicy_moe.config.load import load_config
from offpolicy_moe.run.checkpoint import CheckpointError, load_checkpoint, resume_checkpoint, verify_checkpoint
from offpolicy_moe.models import load_policy, load_tokenizer, tokenizer_source
from offpolicy_moe.models.loading import hf_progress_bars
from offpolicy_moe.tasks import embedded_tokenizer, make_task

__all__ = ["export_run", "export_final", "write_hf_folder", "pick_checkpoint", "run_tokenizer", "load_run_policy",
           "PREDICTORS_FILE", "EXPORT_DIRNAME"]

PREDICTORS_FILE = "pr2_predictors.safetensors"
EXPORT_DIRNAME = "export"


def _predictor_metadata(state: dict[str, torch.Tensor]) -> dict[str, str]:
    w = state["layers.0.weight"]
    return {"format": "offpolicy_moe.pr2_predictors/1",
            "formula": "router logit bias b_l = h @ layers.<l>.weight.T (PR2, arXiv:2606.00395)",
            "num_layers": str(len(state)), "num_experts": str(w.shape[0]), "hidden_size": str(w.shape[1])}


def write_hf_folder(out_dir: str | os.PathLike, model: Any, tokenizer: Any,
                    predictors: Optional[dict[str, torch.Tensor]] = None, *, overwrite: bool = False,
                    state_dict: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write ``model`` + ``tokenizer`` (+ PR2 ``predictors``) as a Hugging Face folder, atomically (a temporary
    sibling renamed at the end); ``state_dict`` replaces the model's own weights (the full weights of a sharded
    model).  An existing non-empty ``out_dir`` is refused unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export folder {str(out)!r} is not empty; choose another or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{uuid.uuid4().hex[:8]}"
    try:
        gen = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
        with hf_progress_bars(False):
            model.save_pretrained(tmp, state_dict=state_dict)
        gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if predictors:
            state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in predictors.items()}
            save_file(state, str(tmp / PREDICTORS_FILE), metadata=_predictor_metadata(state))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_final(run_dir: str | os.PathLike, model: Any, tokenizer: Any, predictors: Any = None, *,
                 state_dict: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """``RUN_DIR/export``: the finished run's policy (``trainer.export_final``; call on the main process, with
    ``state_dict`` the full weights when the model is sharded)."""
    pred = predictors.state_dict() if predictors is not None else None
    return write_hf_folder(Path(run_dir) / EXPORT_DIRNAME, model, tokenizer, pred, overwrite=True,
                           state_dict=state_dict)


def pick_checkpoint(run_dir: Path, step: Optional[int], what: str = "export") -> Path:
    """The checkpoint folder of ``step`` in ``run_dir`` (verified), or the newest intact one; ``FileNotFoundError``
    (one line naming the folder, and ``what`` was to be done with it) when there is none."""
    root = run_dir / "checkpoints"
    if step is None:
        path = resume_checkpoint(root)
        if path is None:
            raise FileNotFoundError(f"run folder {str(run_dir)!r} has no checkpoint to {what}")
        return path
    path = root / f"step_{step}"
    if not path.is_dir():
        have = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        raise FileNotFoundError(f"run folder {str(run_dir)!r} has no checkpoint step_{step} (has: "
                              f"{', '.join(have) or 'none'})")
    verify_checkpoint(path)
    return path


def best_checkpoint_step(run_dir: Path, metric: str) -> int:
    """The step of ``run_dir``'s checkpoint whose step logged the highest ``metric`` (``metrics.jsonl``; a tie goes
    to the later step); ``FileNotFoundError`` in one line when no checkpoint's step logged it."""
    root, log = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    kept = {int(p.name.split("_", 1)[1]) for p in root.glob("step_*") if p.name.split("_", 1)[1].isdigit()} \
        if root.is_dir() else set()
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    scored = {int(r["step"]): float(r[metric]) for r in rows
              if r.get(metric) is not None and r.get("step") is not None and int(r["step"]) in kept}
    if not scored:
        raise FileNotFoundError(f"run folder {str(run_dir)!r}: no checkpoint's step logged {metric} (checkpoints: "
                                f"{', '.join(f'step_{s}' for s in sorted(kept)) or 'none'})")
    return max(scored, key=lambda s: (scored[s], s))


def run_tokenizer(cfg: Any, task: Any = None) -> Any:
    """The tokenizer a run of config ``cfg`` trained with: its folder's (``model.tokenizer_path``, else
    ``model.path``), else the built-in character tokenizer for the alphabet of the run's task (``task``, else built
    from ``cfg.task``)."""
    source = tokenizer_source(cfg.model)
    if source is not None:
        return load_tokenizer(*source)
    return embedded_tokenizer((task if task is not None else make_task(cfg.task)).alphabet)


def load_run_policy(cfg: Any, path: Path, *, tokenizer: Any = None) -> tuple[Any, Any, Optional[dict]]:
    """``(model, tokenizer, PR2 predictor state or None)`` of checkpoint folder ``path`` of a run of config ``cfg``:
    the model rebuilt from ``cfg`` with the tokenizer the run trained with (``tokenizer``, else
    :func:`run_tokenizer`), with the checkpoint's verified weights; :class:`CheckpointError` when they do not fit."""
    ck = load_checkpoint(path, require=())
    tok = tokenizer if tokenizer is not None else run_tokenizer(cfg)
    model, tok = load_policy(cfg.model, tok, seed=cfg.seed)
    try:
        model.load_state_dict(ck.model)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        cfg_file = Path(path).parent.parent / "config.yaml"
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model of {str(cfg_file)!r}: {first}") \
            from None
    return model, tok, ck.modules.get("predictors")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: Optional[int] = None,
               overwrite: bool = False) -> Path:
    """Export the policy of checkpoint ``step`` (default: the newest intact one) of ``run_dir`` to ``out_dir``: the
    model rebuilt from the run's ``config.yaml``, with the checkpoint's verified weights."""
    rd = Path(run_dir)
    cfg_file = rd / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(cfg_file)!r} not found: {str(rd)!r} is not a run folder")
    cfg = load_config(cfg_file)
    path = pick_checkpoint(rd, step)
    model, tok, predictors = load_run_policy(cfg, path)
    return write_hf_folder(out_dir, model, tok, predictors, overwrite=overwrite)
