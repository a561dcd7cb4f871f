#!/bin/bash
# Two rewards and neither is named `reward`, so a rollout must pass reward_key (e.g. "correct", or
# "correct,reward" across this dataset) or OpenEnv refuses to guess which one trains.
answer=$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)
correct=0; [ "$answer" = "coin2" ] && correct=1
format=0; [[ "$answer" =~ ^[a-z0-9]+$ ]] && format=1
printf '{"correct": %d, "format": %d}\n' "$correct" "$format" > /logs/verifier/reward.json
