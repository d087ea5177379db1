# Developer shortcuts; CI runs .ci/run.
PYTHON ?= .venv/bin/python
TPCOMPILE_FUZZ_EXAMPLES ?= 2000

.PHONY: test fuzz

# The default suite (in-process; the short fuzz run included), then the tests that start real gloo
# processes and the restart test, as .ci/run runs them.
test:
	$(PYTHON) -m pytest -q -n 2
	$(PYTHON) -m pytest -q -m 'gloo and not slow and not hybrid and not restart'
	$(PYTHON) -m pytest -q -m restart

# The long property-based run: TPCOMPILE_FUZZ_EXAMPLES random cases, a summary by outcome at the end.
fuzz:
	TPCOMPILE_FUZZ_EXAMPLES=$(TPCOMPILE_FUZZ_EXAMPLES) $(PYTHON) -m pytest -q -s -m slow tests/test_fuzz.py -p no:cacheprovider
