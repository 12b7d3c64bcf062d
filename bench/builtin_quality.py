"""Quality and loading figures of the built-in model, as the issue's quality bar states them.

Prints:
- held-out bits per byte on every held-out window of the corpus (tools/corpus.py) of the running Python;
- word-in-corpus: for five English prompts and seeds 0, 1, 2, a 300-byte continuation at temperature 0.8 is
  generated through the Engine (what users see); the share of the generated alphabetic words (ASCII letter
  runs, compared lower-cased; a word cut off by the 300-byte limit is not counted) that occur in the training
  documents, averaged over the three seeds;
- load time of the built-in model through the loader and through Engine(EngineConfig(model="builtin")),
  and decode steps per second with 32 conversations beside 1 conversation, measured in the same run.

    .venv/bin/python bench/builtin_quality.py            # through the Engine
    .venv/bin/python bench/builtin_quality.py --dense    # own sampling loop over forward_dense (no Engine)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import corpus  # noqa: E402
from tools.train_builtin import bits_per_byte, held_out_windows  # noqa: E402

PROMPTS = (
    "This module provides functions for ",
    "Return a new list containing ",
    "The default value is ",
    "If the argument is omitted, ",
    "An exception is raised when ",
)
SEEDS = (0, 1, 2)
NEW_BYTES = 300
TEMPERATURE = 0.8


def complete_words(text: str, truncated: bool) -> list[str]:
    """Alphabetic words of a continuation; when generation stopped at the byte limit the last word may be cut."""
    words = corpus.alphabetic_words(text)
    if truncated and words and text and text[-1].isalpha():
        words = words[:-1]
    return words


def generate_engine(prompts, seeds) -> dict[tuple[int, int], tuple[list[int], bool]]:
    """(prompt index, seed) -> (output token ids, hit the byte limit) through the Engine, all at once."""
    from engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="builtin"))
    cids = {}
    for s in seeds:
        for i, p in enumerate(prompts):
            cids[(i, s)] = eng.add_conversation(prompt=p, max_new_tokens=NEW_BYTES, temperature=TEMPERATURE, seed=s)
    eng.run_until_idle()
    out = {}
    for key, cid in cids.items():
        ids = list(eng.conversation(cid).output_token_ids)
        out[key] = (ids, len(ids) >= NEW_BYTES and ids[-1] != corpus.EOS_ID)
    return out


@torch.no_grad()
def generate_dense(model, prompts, seeds) -> dict[tuple[int, int], tuple[list[int], bool]]:
    """Same figures with a plain sampling loop over forward_dense (for use without the Engine)."""
    from engine.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    out = {}
    for s in seeds:
        for i, p in enumerate(prompts):
            gen = torch.Generator().manual_seed(s)
            ids = tok.encode(p)
            new: list[int] = []
            while len(new) < NEW_BYTES:
                logits = model.forward_dense(torch.tensor([ids]))[0, -1].float()
                nxt = int(torch.multinomial(torch.softmax(logits / TEMPERATURE, -1), 1, generator=gen))
                ids.append(nxt)
                new.append(nxt)
                if nxt == corpus.EOS_ID:
                    break
            out[(i, s)] = (new, new[-1] != corpus.EOS_ID)
    return out


def word_in_corpus(outputs, vocabulary: set[str], prompts, seeds, show: bool = True) -> float:
    from engine.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    per_seed = []
    for s in seeds:
        hit = total = 0
        for i in range(len(prompts)):
            ids, truncated = outputs[(i, s)]
            text = tok.decode(ids)
            words = complete_words(text, truncated)
            hit += sum(w.lower() in vocabulary for w in words)
            total += len(words)
            if show and s == seeds[0]:
                print(f"--- seed {s}: {prompts[i]!r}\n{prompts[i]}{text}\n")
        per_seed.append(100.0 * hit / max(total, 1))
        print(f"seed {s}: {hit}/{total} generated words occur in the training corpus ({per_seed[-1]:.1f}%)")
    return sum(per_seed) / len(per_seed)


def decode_steps_per_second(num_conversations: int, steps: int = 20) -> float:
    from engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="builtin"))
    for k in range(num_conversations):
        eng.add_conversation(prompt=PROMPTS[k % len(PROMPTS)], max_new_tokens=steps + 10, temperature=0.8, seed=k)
    eng.step()  # prefill
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return steps / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", action="store_true", help="sample with forward_dense instead of the Engine")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.model.loader import load_model

    t = time.perf_counter()
    loaded = load_model("builtin", torch.float32, torch.device("cpu"), seed=0)
    load_s = time.perf_counter() - t
    model = loaded.model
    n_params = sum(p.numel() for p in model.parameters())
    size_mb = (ROOT / "resources" / "builtin" / "model.safetensors").stat().st_size / 1e6
    print(f"built-in model: {n_params} parameters, weights {size_mb:.2f} MB; corpus of {corpus.python_version()}")

    train_docs, _ = corpus.split_documents()
    vocabulary = corpus.corpus_words(train_docs)
    seq_len = loaded.config.max_position_embeddings
    windows = held_out_windows(min(seq_len, 1024))
    bpb = bits_per_byte(model, windows)
    print(f"held-out bits/byte: {bpb:.4f} ({windows.shape[0]} windows)")

    if args.dense:
        outputs = generate_dense(model, PROMPTS, SEEDS)
    else:
        outputs = generate_engine(PROMPTS, SEEDS)
    pct = word_in_corpus(outputs, vocabulary, PROMPTS, SEEDS)
    print(f"word-in-corpus (5 prompts x {NEW_BYTES} bytes, temperature {TEMPERATURE}, mean of seeds {SEEDS}): "
          f"{pct:.1f}%")

    print(f"load time, loader.load_model('builtin'): {load_s * 1000:.0f} ms")
    if not args.dense:
        from engine import Engine, EngineConfig

        t = time.perf_counter()
        Engine(EngineConfig(model="builtin"))
        print(f"load time, Engine(EngineConfig(model='builtin')): {(time.perf_counter() - t) * 1000:.0f} ms")
        one = decode_steps_per_second(1)
        many = decode_steps_per_second(32)
        print(f"decode steps/s: 1 conversation {one:.1f}, 32 conversations {many:.1f} "
              f"(32 vs 1: {many / one:.2f}x the step rate, {32 * many / one:.1f}x the tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
