#!/usr/bin/env bash
# README's first command: set up, then run a 2-group fault-tolerant training with one injected failure.
# Replica group 1 is SIGKILLed at step 40; group 0 keeps training, group 1's agent restarts it, it heals
# from group 0's live weights and rejoins. The summary at the end shows the failure, the time to rejoin
# and that both groups ended bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ftlaunch --replicas 2 --chaos steps=40,group=1 \
  scripts/train_ddp.py --steps 300 --step-sleep 0.05 "$@"
