#!/bin/bash
# A broken verifier: it writes no reward, so no rollout of this task can be scored.
exit 0
