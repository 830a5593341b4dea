#!/usr/bin/env bash
# Session 2026-12-07 #9, call D (not run: too little device time was left to start a machine): call A's served C256
# runs died in engine-direct's phase at the interpreter's exit (C++ frames: a tensor freed through a numpy array in
# Py_FinalizeEx, createEvent failed). Here engine-direct C256 at 256 rows as that phase runs it, then a device
# sync (c256_direct_check.py): on main (the repository root), then on c3a488c, before the 16-row mixed graphs:
#   git archive c3a488c ouro_backend | tar x -C .calls/main_tree   (its ouro_backend/models dropped: linked below)
set -u
DL=${DL:-300}
source benchmarks/device_call.sh cD
t; cat $R/host.txt
NEW=$PWD
ln -sfn $NEW/ouro_backend/models .calls/main_tree/ouro_backend/models
CK=$(PYTHONPATH=$NEW checkpoint); echo "$CK"; t
for tree in main c3a488c; do
  d=$NEW; [ $tree = c3a488c ] && d=$NEW/.calls/main_tree
  [ $(left) -gt 60 ] || break
  (cd $d && PYTHONPATH=$d timeout -k 5 $(cap 120) python3 $NEW/benchmarks/results/2026-12-07-session-9/c256_direct_check.py $CK > $R/check_$tree.log 2>&1); echo "$tree rc=$?"
  grep -v "^frame" $R/check_$tree.log | grep -v "^\s*$" | tail -12 | cut -c1-300; t
done
