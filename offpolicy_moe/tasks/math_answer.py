"""The ``math`` reward: final-answer extraction and equivalence checked by Hugging Face's ``math-verify``.

Extraction (:func:`extract_final_answer`), first rule that applies:

* GSM8K: the text after the last ``####`` (its first line);
* LaTeX: the content of the last ``\\boxed{...}`` (braces balanced);
* otherwise, for a completion, the last number in the text (``-3``, ``1,000``, ``0.5``, ``3/4``); for a reference
  answer, the whole stripped text (so ``\\frac{1}{2}`` stays whole).

Equivalence: ``math_verify.parse`` both sides and ``math_verify.verify(gold, pred)`` (symbolic and numeric comparison:
``0.5 = 1/2 = \\frac{1}{2}``); r = 1 when equivalent, else 0 (unparsable or empty: 0).  This is the rule-based
verifiable reward of RLVR (DeepSeekMath/GRPO, arXiv:2402.03300; Tülu 3, arXiv:2411.15124).

Timeout.  math-verify's own timeout is ``signal.alarm``: it only works in the main thread of the main interpreter
(elsewhere ``parse`` raises ``ValueError``, which math-verify turns into "not equivalent", silently), counts whole
seconds, and cannot interrupt work that never returns to the interpreter.  :class:`MathVerifier` therefore runs
math-verify in a child process (:mod:`offpolicy_moe.tasks.math_server`) and waits at most ``timeout_s`` per pair with
``select``; a pair past its deadline scores 0, is counted in ``timeouts``, and the child is killed (SIGKILL) and
restarted on the next call.  Safe from any thread (one lock per verifier) and any process (a forked copy starts its
own child).
"""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence

from .rewards import clean_completion

SERVER = Path(__file__).with_name("math_server.py")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?")
_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_CACHE_SIZE = 65536


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces ('' when never closed);
    None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else ""      # an unclosed \boxed{ holds no answer


def extract_final_answer(text: str, *, reference: bool = False) -> str:
    """The final answer of ``text`` by the rules of the module docstring ('' when there is none).

    ``reference=True`` reads a reference answer: without ``####`` or ``\\boxed``, the whole text is the answer.
    """
    text = clean_completion(text)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip().rstrip(".") if tail else ""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if reference:
        return text
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else ""


class MathVerifier:
    """math-verify equivalence in a killable child process, ``timeout_s`` seconds at most per pair.

    ``equivalent(gold, pred)`` is True/False, or None when the pair timed out (then ``timeouts`` grows by one).
    Results are cached by ``(gold, pred)``.  ``start_timeout_s`` bounds the child's start (importing sympy).
    """

    def __init__(self, timeout_s: float = 5.0, *, start_timeout_s: float = 120.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"math timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.timeouts = 0
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._pid = -1                      # the process that started _proc (a forked copy must not use it)
        self._buf = b""
        self._cache: dict[tuple[str, str], bool] = {}
        self._finalizer = weakref.finalize(self, MathVerifier._kill, None)

    # ---------------------------------------------------------------- child process
    @staticmethod
    def _kill(proc: Optional[subprocess.Popen], owner: int = -1) -> None:
        """Kill ``proc`` if this process started it (a forked copy, whose finalizers run at its exit, must not)."""
        if proc is not None and owner == os.getpid() and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _start(self) -> subprocess.Popen:
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-P", str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, bufsize=0)
        self._proc, self._pid, self._buf = proc, os.getpid(), b""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, MathVerifier._kill, proc, self._pid)
        if self._readline(self.start_timeout_s) != '"ready"':
            self._stop()
            err.seek(0)
            tail = err.read().decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the math-verify process ({SERVER.name}) did not start: {tail[0]}")
        err.close()
        return proc

    def _stop(self) -> None:
        MathVerifier._kill(self._proc, self._pid)
        self._proc, self._buf = None, b""

    def close(self) -> None:
        """Stop the child process (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def _readline(self, timeout_s: float) -> Optional[str]:
        """One line from the child within ``timeout_s`` seconds; None on timeout or when the child died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8").strip()

    # ---------------------------------------------------------------- the check
    def equivalent(self, gold: str, pred: str) -> Optional[bool]:
        """Whether ``pred`` and ``gold`` are the same mathematical answer (None: timed out, scored as wrong); a gold
        answer in which math-verify reads no expression is equivalent to nothing."""
        if not gold or not pred:
            return False
        if _PLAIN_NUMBER.fullmatch(gold) and _PLAIN_NUMBER.fullmatch(pred):
            return Fraction(gold) == Fraction(pred)      # two decimals: exact arithmetic decides, no child needed
        return self._ask((gold, pred), [gold, pred])

    def parses(self, text: str) -> Optional[bool]:
        """Whether math-verify reads an expression in ``text`` (a reference it does not read cannot be scored);
        None: timed out."""
        if not text:
            return False
        if _PLAIN_NUMBER.fullmatch(text):
            return True
        return self._ask(("parse", text), text)

    def _ask(self, key: tuple, request: Any) -> Optional[bool]:
        """The child's reply to ``request`` (cached under ``key``); None when it timed out (the child is stopped)."""
        if key in self._cache:
            return self._cache[key]
        with self._lock:
            if self._proc is None or self._pid != os.getpid() or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode("utf-8"))
                reply = self._readline(self.timeout_s)
            except BrokenPipeError:
                reply = None
            if reply is None:
                self.timeouts += 1
                self._stop()
                return None
        ok = reply == "1"
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = ok
        return ok

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """The ``math`` reward of each completion against its reference answer (module docstring)."""
        if len(completions) != len(answers):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
        return [1.0 if self.equivalent(extract_final_answer(a, reference=True), extract_final_answer(c)) else 0.0
                for c, a in zip(completions, answers)]
