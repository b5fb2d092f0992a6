"""The ``check`` fixture verifies at teardown (tests/test_checker.py runs this file)."""

import pytest
from conftest import Checker


def test_a_forgotten_done_fails_at_teardown(check: Checker) -> None:
    check.true(False, "PLANTED-FORGOTTEN")


def test_a_failed_done_is_reported_once(check: Checker) -> None:
    check.true(False, "PLANTED-ONCE")
    check.done()


def test_a_passed_done_passes_teardown(check: Checker) -> None:
    check.true(True, "fine")
    check.done()


def test_failures_after_a_done_are_still_reported(check: Checker) -> None:
    check.done()
    check.true(False, "PLANTED-LATE")


@pytest.mark.parametrize("n", [1])
def test_nothing_recorded_passes(check: Checker, n: int) -> None:
    check.equal(n, 1, "n")
