#!/bin/bash
# The expected answer is drawn now, after the agent has finished, so no policy can earn reward 1.
secret=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "$secret" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
