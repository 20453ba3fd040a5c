#!/usr/bin/env bash
# A device call brings back at most 8 files from $OUT (the device README's limits), so a call
# that runs several suites ends with this: every file under $OUT that is not a JSON result goes
# into one $OUT/rest.tar.gz (paths kept) and is removed, leaving the JSON files and the
# archive. Prints what is left and exits 1 when that is still over 8 files.
#
#   OUT=<dir> bash scripts/pack_out.sh
set -euo pipefail
out="${OUT:?set OUT to the folder the call brings back}"
cd "$out"
mapfile -t rest < <(find . -type f ! -name '*.json' ! -name rest.tar.gz | sort)
if [ "${#rest[@]}" -gt 0 ]; then
    tar -czf rest.tar.gz "${rest[@]}"
    rm -f -- "${rest[@]}"
fi
find . -type d -empty -delete
mapfile -t left < <(find . -type f | sort)
printf '%s\n' "${left[@]}"
if [ "${#left[@]}" -gt 8 ]; then
    echo "pack_out: ${#left[@]} files left under $out; a call brings back 8" >&2
    exit 1
fi
