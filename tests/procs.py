"""Test helpers: the package's own process helpers, plus debug logging from the plugin."""

from lora_affinity_plugin.processes import (  # noqa: F401
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    proxy_config,
    redis_server,
    wait_port,
    write_config,
)
