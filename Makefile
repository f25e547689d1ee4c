# ferrum: the two commands a new user needs are `make demo` and `make test`.
PY := .venv/bin/python
JOBS ?= 2

.PHONY: setup setup-test demo test test-cpp test-python test-python-avx2 test-fuzz test-wheel test-asan bench wheel clean

setup:            ## system packages, venv, dependencies, build, default model
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

demo: setup       ## chat with SmolLM2-135M-Instruct
	.venv/bin/ferrum chat "What is the capital of France? Answer in one sentence." --max-tokens 64 --seed 0

test: setup-test test-cpp test-fuzz test-python test-python-avx2 test-wheel   ## the whole suite (what CI runs)

# C++ unit tests (GoogleTest) in their own build tree.
test-cpp:
	cmake -S . -B build/cpp-tests -DFERRUM_TESTS=ON -DFERRUM_PYTHON=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build build/cpp-tests -j $(JOBS)
	ctest --test-dir build/cpp-tests --output-on-failure -j $(JOBS)

test-python:
	$(PY) -m pytest tests -q

# The whole suite again on the AVX2 kernels, as a CPU without AVX-512 runs it (docs/install.md).
test-python-avx2:
	FERRUM_CPU_ISA=avx2 $(PY) -m pytest tests -q

# The file readers and tokenizer metadata fuzzed for a bounded time (docs/fuzzing.md; a long run:
# scripts/fuzz.sh 3600).
test-fuzz:
	bash scripts/fuzz.sh 10

# The portable wheel (docs/install.md), built into dist/ and checked as a user gets it.
wheel: setup-test
	bash scripts/build_wheel.sh

test-wheel: wheel
	bash scripts/check_wheel.sh

# AddressSanitizer + UBSan: a Sanitize build of the extension, then the suite under it.
test-asan: setup-test
	bash scripts/test_asan.sh

bench: setup-test ## ferrum vs llama.cpp side by side (see docs/performance.md)
	$(PY) bench/compare_llamacpp.py

clean:
	rm -rf build dist
