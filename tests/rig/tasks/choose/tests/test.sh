#!/bin/bash
# One right answer among the four the rig's engine chooses from (tests/rig/engine.py, `choices`): reward 1 iff
# /app/answer.txt holds exactly it (surrounding whitespace ignored).
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "fox" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
