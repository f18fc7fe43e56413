# Test lanes. CI (.ci/run) runs the README's command: every test, the slow ones included. -n 2: two
# pytest-xdist workers, a module at a time, the longest first (tests/conftest.py).
PYTHON ?= python

.PHONY: test test-fast test-compiles

# everything, as CI runs it
test:
	$(PYTHON) -m pytest -q -n 2 tests

# what to run first: leaves out the tests marked slow (pytest.ini: about 12 s or more each)
test-fast:
	$(PYTHON) -m pytest -q -n 2 -m "not slow" tests

# the fast lane in one process (the counts are kept per process) with the graph compiles of each test counted
# (tests/support/compile_count.py) and the 25 slowest
test-compiles:
	MINDVL_TEST_COMPILES=1 $(PYTHON) -m pytest -q -p no:cacheprovider -m "not slow" --durations=25 tests
