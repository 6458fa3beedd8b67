# Sourced by the GPU scripts: what a lent machine (no network) lacks, installed from .whl/ (omegaconf, antlr4,
# datasets, ...) into /tmp/site, and a no-deps install of this project into /tmp/site_om, both put on PYTHONPATH.
if ! python3 -c "import omegaconf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site .whl/* \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
# offpolicy_moe.algorithms is the top-level algorithms/ (pyproject's package-dir), which PYTHONPATH=$PWD cannot import
# (every train run failed on 2026-11-27 with ModuleNotFoundError): install a copy of the project without deps, put it
# first, and keep the working directory off sys.path (PYTHONSAFEPATH) so `python -m` does not shadow it with the tree.
if ! python3 -c "import offpolicy_moe.algorithms" 2>/dev/null; then
  src=$(mktemp -d); cp -r pyproject.toml README.md offpolicy_moe algorithms "$src"/ \
    && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site_om "$src" \
    && export PYTHONPATH="/tmp/site_om:${PYTHONPATH:-}" PYTHONSAFEPATH=1
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
