#!/usr/bin/env bash
# The test suite twice at the same time, side by side: what a user's busy machine (another job, a
# second checkout's tests) does to the suite. Not part of CI (it doubles the time); run it before
# a release or after changing tests that compare numbers, from the repository root, in the
# virtualenv of the README's test command:
#
#   bash tests/run_twice.sh            # extra pytest arguments are passed to both copies
#   SECOND_ENV="GENOLONG_MALLOC=system" bash tests/run_twice.sh   # copy 2 with these variables:
#                                      # a setting's effect on the suite's time, side by side
#
# Each copy has its own temporary directory and no pytest cache; the exit status is 0 only if
# both copies pass. Their output goes to run-twice-1.log and run-twice-2.log in a temporary
# directory (printed), and the closing lines of both are shown.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="$(mktemp -d -t genolong-run-twice-XXXXXX)"
start=$(date +%s)
pids=()
for i in 1 2; do
    extra=()
    if [ "$i" = 2 ] && [ -n "${SECOND_ENV:-}" ]; then read -r -a extra <<< "$SECOND_ENV"; fi
    env "${extra[@]}" python -m pytest -q -p no:cacheprovider --basetemp="$logs/tmp-$i" "$@" > "$logs/run-twice-$i.log" 2>&1 &
    pids+=($!)
done
status=0
for i in 1 2; do
    if wait "${pids[$((i - 1))]}"; then rc=0; else rc=$?; status=1; fi
    echo "copy $i: exit $rc: $(tail -n 1 "$logs/run-twice-$i.log")$([ "$i" = 2 ] && [ -n "${SECOND_ENV:-}" ] && echo " ($SECOND_ENV)")"
done
echo "both copies in $(( $(date +%s) - start )) s; logs in $logs"
exit $status
