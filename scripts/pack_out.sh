#!/usr/bin/env bash
# A device call brings back at most 8 files from $OUT (the device README's limits), so a call
# that runs several suites ends with this: every file under $OUT that is not a JSON result goes
# into one $OUT/rest.tar.gz (paths kept) and is removed, leaving the JSON files and the
# archive. Where the JSON files and the archive would still be over 8, the JSON files go into
# the archive too (every file, one archive), so nothing is left behind. Prints what is left.
#
#   OUT=<dir> bash scripts/pack_out.sh
set -euo pipefail
out="${OUT:?set OUT to the folder the call brings back}"
cd "$out"
mapfile -t rest < <(find . -type f ! -name '*.json' ! -name rest.tar.gz | sort)
mapfile -t results < <(find . -type f -name '*.json' | sort)
archive=0
[ "${#rest[@]}" -gt 0 ] && archive=1
if [ $((${#results[@]} + archive)) -gt 8 ]; then
    rest+=("${results[@]}")
    echo "pack_out: ${#results[@]} JSON files are too many to come back one by one;" \
        "they are in rest.tar.gz with the rest" >&2
fi
if [ "${#rest[@]}" -gt 0 ]; then
    tar -czf rest.tar.gz "${rest[@]}"
    rm -f -- "${rest[@]}"
fi
find . -type d -empty -delete
find . -type f | sort
