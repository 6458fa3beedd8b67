"""The child process that runs ``math-verify`` for :class:`offpolicy_moe.tasks.math_answer.MathVerifier`.

Started as ``python -P <this file>`` (``-P``: this folder is not put on ``sys.path``), so it imports only the standard
library and ``math_verify``, never the package (no torch).  Protocol, one JSON value per line:

* the child writes ``"ready"`` once ``math_verify`` is imported;
* each request ``[gold, pred]`` (two strings) gets one reply: ``1`` (equivalent), ``0`` (not, or unparsable);
* each request ``text`` (one string) gets one reply: ``1`` when math-verify reads an expression in it, ``0`` when it
  finds none (only the raw string comes back).

A gold answer in which math-verify reads no expression is never equivalent to anything, even to the same string: an
unparsable reference is never rewarded.

The child is single-threaded, so math-verify's own ``signal.alarm`` timeouts are off (``None``): the parent enforces
the per-call deadline by killing this process, which also stops computations that never return to the interpreter
(a C-level big-integer power), where an alarm would not fire.
"""
import json
import sys
import warnings


def main() -> None:
    """Serve ``[gold, pred]`` requests from stdin until it closes."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]

    def read(text: str):
        # an extracted answer is a bare LaTeX/number string: read it between $...$ first, then as plain text
        found = parse(f"${text}$", extraction_config=config, parsing_timeout=None) if "$" not in text else []
        return found or parse(text, extraction_config=config, parsing_timeout=None)

    def expression(found: list) -> bool:
        return any(not isinstance(x, str) for x in found)

    out = sys.stdout
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if isinstance(request, str):
                ok = expression(read(request))
            else:
                gold, pred = request
                g, p = read(gold), read(pred)
                ok = expression(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - malformed input is "not equivalent", never a dead server
            ok = False
        out.write("1\n" if ok else "0\n")
        out.flush()


if __name__ == "__main__":
    main()
