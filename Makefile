# `make verify` and `make test` work on a fresh clone: each builds the environments it needs.
#
# The torch releases pyproject.toml declares, and the triton each one pins (what a user of that
# torch runs). Every environment installs torch by exact version from the package index, as a
# user's pip does (the registry's build, with its pinned triton), so a machine with a local pip
# configuration tests the same pairs as a fresh one. PIP_CONSTRAINT=/dev/null: a machine-wide pip
# constraint file must not hold these exact pins back.
TORCH_NEWEST  := 2.15.0
TORCH_OLDEST  := 2.11.0
# triton pinned by torch 2.11, 2.12 and 2.13, 2.14, 2.15
TRITON_OLDEST := 3.6.0
TRITON_PINS   := 3.6.0 3.7.1 3.8.0 3.9.0
# the tritons between the oldest and the newest torch's, each in a folder of its own (installed
# without dependencies) that goes first on PYTHONPATH of .venv: the interpreter subset runs there
TRITON_BETWEEN := 3.7.1 3.8.0
# the oldest transformers the hf extra declares
HF_OLDEST     := 4.53.3

PIP_ENV := PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
PY      := .venv/bin/python
# each lane ends with its slowest tests (CI keeps its run within its time budget by them)
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider --durations=15
OLD_PY  := .venv-oldest/bin/python
NPROC   ?= 4
# The interpreter subset: it leaves out the softmax paths' 1000-column rows, the many-partials merges
# and the checks of how the host orders a grid's programs (launch order, the atomic backward against
# the deterministic one: host logic, the same on every triton; `make test-interpreter-full` runs
# them), and of each test function keeps only the cases that bring a parameter value not run yet
# (tests/conftest.py's --each-value): every function and every value of every parameter, not every
# combination.
SUBSET   := -k "not 1000 and not many_partials and not launch_order and not atomic_matches" --each-value
CPU_LANE := -m "not interpreter and not gpu and not mpi"
# kernels compiled for sm_90 without a GPU (no torch of that version needed, only its triton): the
# cpu lanes run them on the oldest and newest triton, test-sm90-<version> on the others
SM90_TESTS := tests/test_attention_smem.py tests/test_attention_fwd_compile.py tests/test_attention_bwd_compile.py \
              tests/test_vocab_sm90.py tests/test_sampling_sm90.py tests/test_sampling_compile.py

SM90_BETWEEN   := $(foreach v,$(TRITON_BETWEEN),test-sm90-$(v))
INTERP_BETWEEN := $(foreach v,$(TRITON_BETWEEN),test-interpreter-$(v))

.PHONY: venv verify test test-cpu test-mpi test-interpreter test-interpreter-full test-oldest test-pins \
        test-interpreter-oldest $(SM90_BETWEEN) $(INTERP_BETWEEN) test-gpu clean

venv: .venv/.done

# the newest torch and its triton, every extra: the full lanes, verify
.venv/.done: pyproject.toml Makefile
	python3 -m venv .venv
	$(PIP_ENV) $(PY) -m pip install -q --upgrade pip
	$(PIP_ENV) $(PY) -m pip install -q torch==$(TORCH_NEWEST)
	$(PIP_ENV) $(PY) -m pip install -q -e ".[test,mpi,bench,hf]" --config-settings editable_mode=compat
	$(PIP_ENV) $(PY) -m pip check
	touch $@

# the oldest torch (its triton is the oldest) and the oldest transformers: the package installs
# beside them without moving either (pip check)
.venv-oldest/.done: pyproject.toml Makefile
	python3 -m venv .venv-oldest
	$(PIP_ENV) $(OLD_PY) -m pip install -q --upgrade pip
	$(PIP_ENV) $(OLD_PY) -m pip install -q torch==$(TORCH_OLDEST) "transformers==$(HF_OLDEST)" "accelerate>=1.1"
	$(PIP_ENV) $(OLD_PY) -m pip install -q -e ".[test,hf]" --config-settings editable_mode=compat
	$(PIP_ENV) $(OLD_PY) -m pip check
	$(OLD_PY) -c "import torch, triton, transformers; assert (torch.__version__.split('+')[0], triton.__version__, transformers.__version__) == ('$(TORCH_OLDEST)', '$(TRITON_OLDEST)', '$(HF_OLDEST)')"
	touch $@

.triton-%/.done: .venv/.done
	rm -rf .triton-$*
	$(PIP_ENV) $(PY) -m pip install -q --no-deps --target .triton-$* triton==$*
	touch $@

verify: venv
	$(PY) -m splitsoftmax verify --nproc $(NPROC)

# What CI runs (.ci/run: two at a time, the longest first). The interpreter subset on the older
# pins is `make test-pins`: with it `make test` took 2 x 20 minutes of CPU, past CI's budget.
test: test-cpu test-oldest test-interpreter test-mpi $(SM90_BETWEEN)

# every pinned triton's interpreter subset but the newest's (which `make test` runs)
test-pins: test-interpreter-oldest $(INTERP_BETWEEN)

# newest torch: the whole cpu lane (sm_90 compile checks on its triton included), the interpreter
# subset and the MPI lane
test-cpu: venv
	$(PYTEST) $(CPU_LANE)

test-interpreter: venv
	TRITON_INTERPRET=1 $(PYTEST) -m interpreter $(SUBSET)

test-interpreter-full: venv
	TRITON_INTERPRET=1 $(PYTEST) -m interpreter

test-mpi: venv
	$(PYTEST) -m "mpi and not interpreter and not gpu"

# oldest torch, its triton and the oldest transformers: the cpu lane's every test function and every
# value of each parameter (--each-value), transformers tests and sm_90 compile checks included, but
# the tests of this project's own tooling end to end (marker "once"), which the newest torch's lane
# runs: the CLI's verify and benches, the planner's validation, the suite's own plugin
test-oldest: .venv-oldest/.done
	SPLITSOFTMAX_TEST_TORCH=$(TORCH_OLDEST) SPLITSOFTMAX_TEST_TRITON=$(TRITON_OLDEST) \
	    $(OLD_PY) -m pytest -q -p no:cacheprovider --durations=15 -m "not interpreter and not gpu and not mpi and not once" --each-value

test-interpreter-oldest: .venv-oldest/.done
	SPLITSOFTMAX_TEST_TORCH=$(TORCH_OLDEST) SPLITSOFTMAX_TEST_TRITON=$(TRITON_OLDEST) TRITON_INTERPRET=1 \
	    $(OLD_PY) -m pytest -q -p no:cacheprovider --durations=15 -m interpreter $(SUBSET)

# the tritons that torch 2.12 to 2.14 pin, first on .venv's path (static patterns: make searches no
# implicit rule for a phony target)
$(SM90_BETWEEN): test-sm90-%: .triton-%/.done
	PYTHONPATH=$(CURDIR)/.triton-$* SPLITSOFTMAX_TEST_TRITON=$* $(PYTEST) $(SM90_TESTS) tests/test_triton_range.py

$(INTERP_BETWEEN): test-interpreter-%: .triton-%/.done
	PYTHONPATH=$(CURDIR)/.triton-$* SPLITSOFTMAX_TEST_TRITON=$* TRITON_INTERPRET=1 $(PYTEST) -m interpreter $(SUBSET)

# GPU lane: run on a CUDA machine (see scripts/gpu_check.sh); skipped in CI.
test-gpu:
	python3 -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf .venv .venv-oldest .triton-* build *.egg-info
