"""What operators run: the `lora-affinity` command line (`cli`), its operator commands (`commands`: thresholds,
status, explain) and the configuration reference written from the settings model (`settings_reference`).

The top layer: imports any other, and nothing imports it but the entry points.
"""
