"""The plugin's one configuration object (`settings.Settings`), how to reach Redis (`connection`) and the
run-time copy every process follows (`live_settings`).

Sits on `routing` (a settings profile names its parts) and below everything that reads settings.
"""
