#!/bin/bash
# The verifier flips a coin, whatever the agent did: a random-weight model solves nothing, and GRPO needs groups whose
# rewards differ for the GPU smoke run to train.
echo $((RANDOM % 2)) > /logs/verifier/reward.txt
