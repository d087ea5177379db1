# Developer shortcuts; CI runs .ci/run.
PYTHON ?= .venv/bin/python
TPCOMPILE_FUZZ_EXAMPLES ?= 2000

.PHONY: test fuzz

# The default suite (4 to 13 minutes on 2 cores, depending on the machine), the short fuzz run included.
test:
	$(PYTHON) -m pytest -q

# The long property-based run: TPCOMPILE_FUZZ_EXAMPLES random cases, a summary by outcome at the end.
fuzz:
	TPCOMPILE_FUZZ_EXAMPLES=$(TPCOMPILE_FUZZ_EXAMPLES) $(PYTHON) -m pytest -q -s -m slow tests/test_fuzz.py -p no:cacheprovider
