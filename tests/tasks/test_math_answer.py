"""The `math` reward: final-answer extraction, equivalence through math-verify, and a timeout that holds in threads."""
from __future__ import annotations

import threading
import time

import pytest

from offpolicy_moe.config.schema import TaskConfig
from offpolicy_moe.tasks import MathVerifier, extract_final_answer, make_task

# a pathological answer: math-verify (sympy) evaluates 9^(9^(9^9)) and never returns
HANG = r"\boxed{9^{9^{9^{9}}}}"


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=5.0)
    yield v
    v.close()


@pytest.mark.parametrize("text, final", [
    ("3+4=7\n#### 7", "7"),
    ("#### 1,000.", "1,000"),
    (r"so \boxed{\frac{1}{2}} it is", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{a}{b}}} then \boxed{x^{2}}", "x^{2}"),
    ("I count 3 then 12.5 apples", "12.5"),
    ("first -4, then 3/4<eos><pad>", "3/4"),
    ("no digits", ""),
])
def test_extract_final_answer(text, final):
    assert extract_final_answer(text) == final


def test_reference_answers_keep_their_whole_text():
    assert extract_final_answer(r"\frac{1}{2}", reference=True) == r"\frac{1}{2}"
    assert extract_final_answer("Natalia sold 48/2 = 24 clips\n#### 72", reference=True) == "72"


@pytest.mark.parametrize("gold, completion", [
    ("0.5", r"\boxed{\frac{1}{2}}"), (r"\frac{1}{2}", "0.5"), ("1/2", "the answer is 0.5"), ("42", "#### 42.0"),
    ("#### 1000", "1,000"), ("-3", "x = -3"), (r"\frac{6}{4}", "1.5"), ("x+1", r"\boxed{1+x}"),
])
def test_equivalent_forms_score_one(verifier, gold, completion):
    assert verifier([completion], [gold]) == [1.0]


@pytest.mark.parametrize("gold, completion", [
    ("0.5", r"\boxed{\frac{1}{3}}"), ("42", "43"), ("#### 72", "27"), ("1/2", "2"), ("x+1", r"\boxed{x-1}"),
    ("7", ""), ("7", "<eos>"),
])
def test_different_answers_score_zero(verifier, gold, completion):
    assert verifier([completion], [gold]) == [0.0]


@pytest.mark.parametrize("completion", [r"\boxed{\frac{1}{", r"\boxed{\frac{1}{2}", r"\boxed{}", r"\boxed{\frac{}{2}}",
                                        r"\boxed{\sqrt[}{2}}", r"\boxed{1/}"])
def test_malformed_latex_scores_zero_without_raising(verifier, completion):
    assert verifier([completion, "0.5"], ["1/2", "1/2"]) == [0.0, 1.0]     # the server still answers afterwards


def test_a_pathological_input_times_out_in_the_main_thread_and_the_next_call_works():
    v = MathVerifier(timeout_s=1.0)
    try:
        v([ "1"], ["1"])                         # start the child first: the timing below is the check alone
        t0 = time.monotonic()
        assert v([HANG, "0.5"], ["1", "1/2"]) == [0.0, 1.0]
        assert time.monotonic() - t0 < 30, "the pathological pair was not cut at its deadline"
        assert v.timeouts == 1
    finally:
        v.close()


def test_the_timeout_holds_in_a_worker_thread():
    """math-verify's own signal.alarm cannot run outside the main thread; the child process deadline can."""
    v = MathVerifier(timeout_s=1.0)
    out: list = []

    def work():
        out.append(v([HANG, r"\boxed{\frac{1}{2}}"], ["1", "0.5"]))

    try:
        th = threading.Thread(target=work)
        th.start()
        th.join(60)
        assert not th.is_alive(), "the reward call hung in a thread"
        assert out == [[0.0, 1.0]] and v.timeouts == 1
    finally:
        v.close()


def test_math_is_a_task_reward_and_counts_timeouts():
    task = make_task(TaskConfig(train_size=16, eval_size=4, reward="math", math_timeout_s=1.0))
    try:
        assert task.reward(["19", "#### 20", HANG], ["19", "19.0", "1"]) == [1.0, 0.0, 0.0]
        assert task.last_scores.metrics()["reward/math"] == pytest.approx(1 / 3)
        assert task.last_scores.math_timeouts == 1
    finally:
        task.rewards.close()


def test_math_verify_own_timeout_does_not_work_in_a_thread():
    """Why the child process: in a thread, math-verify's signal-based timeout refuses to run at all."""
    from math_verify import parse

    caught: list = []

    def work():
        try:
            parse("$1/2$", parsing_timeout=5, raise_on_error=True)
        except ValueError as exc:
            caught.append(str(exc))

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert caught and "thread" in caught[0]


def test_a_forked_copy_starts_its_own_child_and_leaves_the_parents_alone():
    import os

    v = MathVerifier(timeout_s=5.0)
    try:
        assert v(["0.5"], ["1/2"]) == [1.0]
        parent_child = v._proc.pid
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                   # a forked copy: never writes to the parent's child, starts its own
            os.close(r)
            ok = v(["0.25"], ["1/4"]) == [1.0] and v._proc.pid != parent_child
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        pid = os.fork()
        if pid == 0:                   # a forked copy that exits at once: its inherited finalizer runs, and
            v._finalizer()             # must not kill the parent's child
            os._exit(0)
        os.waitpid(pid, 0)
        assert v._proc.pid == parent_child and v._proc.poll() is None
        assert v(["0.75"], ["3/4"]) == [1.0]
    finally:
        v.close()
