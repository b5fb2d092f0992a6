# dtorch_mpi: `make test` and `make demo` set everything up from scratch (idempotent).
#
# System MPI (an HPC module) instead of the pip `mpich` wheel:
#   make test MPI_WHEEL= MPIEXEC=mpiexec PIP_NO_BINARY=mpi4py
# (mpi4py is then built from source against the `mpicc` on PATH.)

PYTHON   ?= python3
VENV     ?= .venv
MPI_WHEEL ?= mpich
MPIEXEC  ?= $(VENV)/bin/mpiexec
SIZES    ?= 1,2,3,4
PATHS    ?= auto,variable,padded
PIP      := $(VENV)/bin/pip
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed

.PHONY: test demo install lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(MPI_WHEEL) "mpi4py>=4" numpy h5py pytest pytest-mpi pytest-timeout hypothesis ruff mypy
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	MPIEXEC="$(MPIEXEC)" $(PY) scripts/run_tests.py --sizes $(SIZES) --paths $(PATHS)

demo: $(STAMP)
	$(MPIEXEC) -n 4 $(PY) examples/quickstart.py

lint: $(STAMP)
	$(VENV)/bin/ruff check dtorch_mpi tests scripts examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(MPIEXEC) -n 2 $(PY) scripts/bench_redistribute.py
	$(MPIEXEC) -n 4 $(PY) scripts/bench_redistribute.py
	$(PY) scripts/bench_random.py

clean:
	rm -rf $(VENV) .mpi-logs build *.egg-info
