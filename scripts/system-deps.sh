#!/usr/bin/env bash
# System packages and services the test suite needs, installed/started only when missing:
# Redis (ledger stream tests), Chromium (dashboard test), Prometheus (scrape test).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v chromium >/dev/null || need+=(chromium)
command -v prometheus >/dev/null || need+=(prometheus)
if ((${#need[@]})); then
  echo "[system-deps] apt-get install ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  echo "[system-deps] starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
