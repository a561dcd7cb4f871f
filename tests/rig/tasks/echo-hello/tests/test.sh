#!/bin/bash
# Reward 1 iff /app/answer.txt holds exactly the instruction's ANSWER word (surrounding whitespace ignored).
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
