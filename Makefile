# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv if it is missing and install the package (which compiles cext/).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.superoffload-installed
SRC    := pyproject.toml setup.py $(wildcard cext/*.c cext/*.h cext/*.py)

.PHONY: demo test lint typecheck pytest bench install clean mutants

$(STAMP): $(SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[notebooks,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m superoffload train

lint: $(STAMP)
	$(PY) -m ruff check superoffload tests benchmarks scripts
	$(PY) scripts/check_notebooks.py

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	SUPEROFFLOAD_NOTEBOOK_CI=1 $(PY) -m pytest tests --nbval-lax notebooks tutorials

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m superoffload bench adam

# Mutation check (slow, not part of `make test`; docs/testing.md): one bug at a time in a
# temporary copy of the tree, never in this one. Needs the venv (`make install`).
mutants:
	@test -x $(PY) || { echo "make mutants: no $(VENV); run 'make install' first"; exit 2; }
	$(PY) scripts/mutants.py

clean:
	rm -rf build *.egg-info superoffload/kernels/_cpu_adam_cffi*.so superoffload/storage/_aio_cffi*.so
