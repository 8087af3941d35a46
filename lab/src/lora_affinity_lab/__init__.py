"""The simulated vLLM fleet, the benchmarks and the demo of lora-affinity-plugin; a proxy never imports it."""
