"""The names users write stay put while the package's folders move: the config's callback line, the command
line's module paths and the public API a custom rule imports."""

import subprocess
import sys

import lora_affinity_plugin
from lora_affinity_plugin.routing import decision


def test_the_public_api_is_exported_by_the_package_itself():
    assert lora_affinity_plugin.Filter is decision.Filter and lora_affinity_plugin.Scorer is decision.Scorer
    missing = [name for name in lora_affinity_plugin.__all__ if not hasattr(lora_affinity_plugin, name)]
    assert not missing, missing
    from lora_affinity_plugin.strategy import proxy_plugin  # the line users have in config.yaml

    assert proxy_plugin.__class__.__name__ == "ProxyPlugin"


def test_the_package_and_the_scraper_run_as_modules():
    version = subprocess.run([sys.executable, "-m", "lora_affinity_plugin", "--version"], capture_output=True,
                             text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("lora-affinity "), version.stderr[-2000:]
    scraper = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.scraper", "--help"], capture_output=True,
                             text=True, timeout=60)
    assert scraper.returncode == 0 and "--config" in scraper.stdout, scraper.stderr[-2000:]
