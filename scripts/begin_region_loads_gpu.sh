#!/usr/bin/env bash
# KVCORE_BEGIN_REGION_LOADS on against off on the GPU machine in one device call
# (scripts/region_setting_ab_gpu.sh says what runs and what it writes).
#
#   OUT=<dir> [SIZES=8192,32768] [ROUNDS=2] [TESTS=0] bash scripts/begin_region_loads_gpu.sh
SETTING=KVCORE_BEGIN_REGION_LOADS exec bash "$(dirname "$0")/region_setting_ab_gpu.sh"
