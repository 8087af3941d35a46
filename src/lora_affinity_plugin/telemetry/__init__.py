"""What the plugin tells operators about itself: its Prometheus series (`metrics`), failures logged once per
episode (`episodes`) and memory traces for soaks (`memtrace`).

The bottom layer: imports nothing of the plugin's, so every other layer may report through it.
"""
