"""The scheduling core: one decision over snapshots of pods, with no I/O, deterministic given a seeded RNG.

What the rules read about a pod (`podstate`, `rates`); the parts' interface (`decision`); the parts
(`filters`, `scorers`, `conditions`, the computations they share in `placement`); the cost and the predicted
time to first token (`cost`, `ttft`); rule sets as profiles of parts (`profiles`); the entry point, shedding
then the rule set (`scheduling.choose_pod`).

Imports `kv` (a prompt's keys) and nothing above: it never reads settings, Redis or the host.
"""
