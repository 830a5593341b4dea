# The common start of a device call's script. Source it from the repository root:
#   source benchmarks/device_call.sh NAME
# Results go to $OUT/NAME (R); when the script exits they are packed into $OUT/NAME.tgz, one file to bring
# back (an EXIT trap: a script that sets its own replaces it). The call's deadline is DL seconds (default 570) from now. It sets PYTHONUNBUFFERED=1, OURO_CACHE_DIR
# (default /tmp/ourocache) and HBM (the GPU's HBM TB/s for `benchmarks/roofline.py --hbm-tb-s`: 3.35 on an
# H100, else 4.8). It writes R/host.txt (GPU name, memory, driver). Then:
#   t       prints the seconds since the start ("t=N")
#   left    the seconds until the deadline
#   cap N   N, or what is left if less: a timeout that cannot outlive the call
#   checkpoint [SHAPE]   the random-weight checkpoint of SHAPE (default ouro-1.4b), made if missing; prints its path
#   bench NAME TREE CAP ARGS...   ouro-bench (--shape ouro-1.4b --baseline none --repeats 1 ARGS) run from TREE's
#           root on TREE's code, at most CAP s: R/NAME.log and R/NAME.json; prints the result table and rc
T0=$(date +%s)
DL=${DL:-570}
export PYTHONUNBUFFERED=1 OURO_CACHE_DIR=${OURO_CACHE_DIR:-/tmp/ourocache}
R=${OUT:?OUT: the folder that comes back}/${1:?usage: source benchmarks/device_call.sh NAME}
mkdir -p "$R"
t() { echo "t=$(($(date +%s) - T0))"; }
left() { echo $((DL - ($(date +%s) - T0))); }
cap() {
  local a=$1 l
  l=$(left)
  [ "$a" -gt "$l" ] && a=$l
  echo "$a"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$R/host.txt" 2>&1 || echo "no GPU" >"$R/host.txt"
HBM=4.8
grep -q H100 "$R/host.txt" && HBM=3.35
checkpoint() {
  timeout -k 5 "$(cap 120)" python3 -c "from ouro_backend.entrypoints.bench import ensure_shape_checkpoint as e; print(e('${1:-ouro-1.4b}'))" \
    2>"$R/checkpoint.log" | tail -1
}
bench() {
  local name=$1 tree=$2 c=$3 rc
  shift 3
  local cmd="python3 -m ouro_backend.entrypoints.bench --shape ouro-1.4b --baseline none --repeats 1 $*"
  echo "+ (cd $tree && $cmd)" >"$R/$name.log"
  # `python3 -m` puts the working directory first on sys.path: run from the tree to run its code
  (cd "$tree" && PYTHONPATH=$tree timeout -k 5 "$(cap "$c")" $cmd --label "$name" --out "$R/$name.json" >>"$R/$name.log" 2>&1)
  rc=$?
  echo "$name rc=$rc"
  grep -A9 " in [0-9]* / out " "$R/$name.log" | cut -c1-250
  grep -v "^frame" "$R/$name.log" | grep -i -A6 "error" | head -20 | cut -c1-300
  return $rc
}
_device_call_pack() { (cd "$OUT" && tar czf "$(basename "$R").tgz" "$(basename "$R")" && rm -rf "$(basename "$R")"); }
trap _device_call_pack EXIT
