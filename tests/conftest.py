"""Offline LiteLLM for every test, and the test helpers (procs.py, fake_pods.py) importable."""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")
sys.path.insert(0, os.path.dirname(__file__))
