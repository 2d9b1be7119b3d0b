#!/usr/bin/env bash
# docs/tooling.md twin: "Graph dumps". The block word for word in a fresh folder that sees the repository's examples/;
# then checks a graph's folder holds its plan and timeline.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$(mktemp -d)"
ln -s "$repo/examples" examples

dpcs dump examples/train_gpt.py --steps 2 --layers 1 --batch 2 --compiler eager   # runs the script with dumping on, into ./dpcs_dump
dpcs show dpcs_dump                                                               # summary: graphs, node counts, saved bytes, predicted peak, pass times

ls dpcs_dump/graph_*/00_plan.json dpcs_dump/graph_*/*_memory_timeline.png > /dev/null
echo "dumped $(ls -d dpcs_dump/graph_* | wc -l) graph folder(s)"
