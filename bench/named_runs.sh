# Sourced by bench/two_gpu.sh and bench/four_gpu.sh: "SCRIPT OUTPUT_DIR [RUN ...]" runs only the named
# runs (all when none is named), each cut at its time limit while the others still run.
#
#   run NAME LIMIT_S command...    writes OUT/NAME.out (stdout and stderr) and prints its exit status
set -u
out=${1:?usage: $0 OUTPUT_DIR [RUN ...]}
shift
wanted=" $* "
mkdir -p "$out"

run() {
    local name=$1 limit=$2
    shift 2
    [[ $wanted == "  " || $wanted == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$out/$name.out" 2>&1
    echo "   exit $?"
}
