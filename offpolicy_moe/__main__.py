"""``python -m offpolicy_moe`` (also ``accelerate launch -m offpolicy_moe train ...``)."""
import sys

from offpolicy_moe.cli import main

if __name__ == "__main__":
    sys.exit(main())
