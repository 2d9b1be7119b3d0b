#!/usr/bin/env bash
# docs/hardware.md twin: "Hardware profile and rank agreement". The block word for word in a fresh folder that sees the
# repository's examples/; then checks what it wrote.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$(mktemp -d)"
ln -s "$repo/examples" examples

dpcs hardware                         # the profile in use here, where it came from, its short hash
dpcs hardware --json > profile.json   # write it to a file; pin it with hardware_profile="profile.json"
dpcs hardware --profile h100          # a built-in one; --refresh measures this device again
DPCS_HARDWARE_PROFILE=h100 dpcs dump examples/train_gpt.py --steps 2 --layers 1 --batch 2 --compiler eager   # the plan an H100 would run

python - <<'PY'
import json, pathlib
profile = json.loads(pathlib.Path("profile.json").read_text())
profiles = [json.loads(path.read_text())["hardware_profile"] for path in pathlib.Path("dpcs_dump").glob("graph_*/summary.json")]
planned = [p for p in profiles if p]  # graphs compiled with a budget: planned, and costed with a profile
assert profile and planned and all("built-in 'h100'" in p for p in planned), planned
print(f"profile.json written; the dump's {len(planned)} plans were costed with {planned[0]}")
PY
