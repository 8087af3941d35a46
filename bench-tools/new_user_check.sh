#!/bin/bash
# A new user following the README on a fresh machine, timed: install next to LiteLLM's proxy (pip), then Redis, two
# simulated replicas (lab/), the scraper and the proxy from the README's config; one request, and the plugin's series.
#   bash bench-tools/new_user_check.sh        (needs redis-server; works in /tmp/nu)
repo=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
rm -rf /tmp/nu && mkdir -p /tmp/nu && cd /tmp/nu
git clone -q "$repo" repo
python3 -m venv venv
venv/bin/pip install -q 'litellm[proxy]' 2>&1 | tail -1 || true
venv/bin/pip install -q ./repo ./repo/lab 2>&1 | tail -1 || true
t_install=$(( $(date +%s) - start ))
(redis-server --port 16399 --save "" --appendonly no >/dev/null 2>&1 &)
(venv/bin/lora-affinity sim --replicas 2 --base-port 18801 > sim.log 2>&1 &)
sleep 3
cat > config.yaml <<'YAML'
model_list:
  - model_name: "*"
    litellm_params: {model: "hosted_vllm/*", api_base: "http://127.0.0.1:18801/v1", api_key: "none"}
  - model_name: "*"
    litellm_params: {model: "hosted_vllm/*", api_base: "http://127.0.0.1:18802/v1", api_key: "none"}
litellm_settings:
  callbacks: ["prometheus", "lora_affinity_plugin.strategy.proxy_plugin"]
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
lora_affinity:
  redis_url: redis://127.0.0.1:16399/0
  scrape_interval_ms: 200
YAML
(venv/bin/lora-affinity scrape --config config.yaml > scrape.log 2>&1 &)
export LITELLM_MASTER_KEY=sk-newuser LITELLM_LOCAL_MODEL_COST_MAP=True
(venv/bin/litellm --config config.yaml --port 14000 > proxy.log 2>&1 &)
for i in $(seq 1 120); do curl -s -o /dev/null localhost:14000/health/liveliness && break; sleep 1; done
sleep 2
code=$(curl -s -o out.json -w "%{http_code}" -H "Authorization: Bearer $LITELLM_MASTER_KEY" -H "Content-Type: application/json" localhost:14000/v1/completions -d '{"model": "sql-lora", "prompt": "hello", "max_tokens": 5}')
series=$(curl -s -H "Authorization: Bearer $LITELLM_MASTER_KEY" localhost:14000/metrics/ | grep -c "^lora_affinity_" || true)
decided=$(curl -s -H "Authorization: Bearer $LITELLM_MASTER_KEY" localhost:14000/metrics/ | grep "^lora_affinity_decisions_total{" | awk "{s+=\$2} END {print s+0}")
total=$(( $(date +%s) - start ))
echo "install ${t_install}s; total ${total}s; request HTTP $code; decided by the plugin: $decided; lora_affinity series lines $series"
pkill -f "port 14000" ; pkill -f "lora-affinity scrape --config config.yaml"; pkill -f "base-port 18801"; redis-cli -p 16399 shutdown nosave >/dev/null 2>&1 || true
