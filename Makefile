# `make verify` and `make test` work on a fresh clone: each builds .venv first.
# torch 2.13.0 is installed before anything that depends on torch so pip takes the local CPU
# build instead of fetching a multi-GB CUDA one.
# The editable install is in compat mode (a path entry, not an import hook), so that a clone named
# splitsoftmax in the working directory cannot shadow the package with an empty namespace package.
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
NPROC   ?= 4
# The interpreter lane runs at both ends of the triton range pyproject.toml declares: in full on
# the venv's triton (the newest pip allows beside torch), and on the oldest, installed without its
# dependencies into a folder of its own that goes first on PYTHONPATH (.venv and its pip check
# stay as they are). On the oldest it leaves out the softmax paths' 1000-column rows and the
# many-partials merges, and of each test function only the cases that bring a parameter value
# not run yet (tests/conftest.py's --each-value): every function and every value of every
# parameter still run there, not every combination.
TRITON_OLDEST := 3.6.0
OLDEST        := .venv-triton-oldest
OLDEST_SUBSET := not 1000 and not many_partials
# kernels compiled for sm_90 without a GPU: on the oldest triton too, the one the GPU machines run
SM90_TESTS    := tests/test_attention_smem.py tests/test_attention_fwd_compile.py tests/test_attention_bwd_compile.py \
                 tests/test_vocab_sm90.py tests/test_sampling_sm90.py tests/test_sampling_compile.py

# the oldest transformers the hf extra declares: its tests run there too, in a venv of their own
HF_OLDEST := 4.53.3
HF_PY     := .venv-hf-oldest/bin/python

.PHONY: venv verify test test-cpu test-mpi test-interpreter test-interpreter-oldest test-hf-oldest test-gpu bench clean

venv: .venv/.done

.venv/.done: pyproject.toml Makefile
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,mpi,bench,hf]" --config-settings editable_mode=compat
	touch $@

.venv-hf-oldest/.done: pyproject.toml Makefile
	python3 -m venv .venv-hf-oldest
	$(HF_PY) -m pip install -q torch==2.13.0
	$(HF_PY) -m pip install -q numpy "transformers==$(HF_OLDEST)" "pytest>=7" "hypothesis>=6" "pytest-timeout>=2"
	touch $@

$(OLDEST)/.done: .venv/.done Makefile
	rm -rf $(OLDEST)
	$(PY) -m pip install -q --no-deps --target $(OLDEST) triton==$(TRITON_OLDEST)
	touch $@

verify: venv
	$(PY) -m splitsoftmax verify --nproc $(NPROC)

# (the two interpreter lanes, the longest, first: under -j2 each takes a slot and the rest fill in)
test: test-interpreter test-interpreter-oldest test-cpu test-hf-oldest test-mpi

test-cpu: venv
	$(PYTEST) -q -m "not interpreter and not gpu and not mpi" -p no:cacheprovider

test-mpi: venv
	$(PYTEST) -q -m "mpi and not interpreter and not gpu" -p no:cacheprovider

test-interpreter: venv
	TRITON_INTERPRET=1 $(PYTEST) -q -m interpreter -p no:cacheprovider

test-interpreter-oldest: venv $(OLDEST)/.done
	PYTHONPATH=$(CURDIR)/$(OLDEST) SPLITSOFTMAX_TEST_TRITON=$(TRITON_OLDEST) TRITON_INTERPRET=1 \
	    $(PYTEST) -q -m interpreter -k "$(OLDEST_SUBSET)" --each-value -p no:cacheprovider
	PYTHONPATH=$(CURDIR)/$(OLDEST) SPLITSOFTMAX_TEST_TRITON=$(TRITON_OLDEST) $(PYTEST) -q -p no:cacheprovider \
	    $(SM90_TESTS)

# the transformers tests on the oldest declared transformers (the cpu lane runs them on the newest)
test-hf-oldest: .venv-hf-oldest/.done
	$(HF_PY) -m pytest -q -m "not gpu" -p no:cacheprovider tests/test_transformers*.py

# GPU lane: run on a CUDA machine (see scripts/gpu_check.sh); skipped in CI.
test-gpu:
	python3 -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf .venv $(OLDEST) .venv-hf-oldest build *.egg-info
