"""Fill the tokens/s and steps/h cells of docs/capacity.md's "What fits on one card" table from gpu_shared.py's JSON.

    python bench/fill_fits_table.py bench/results/<date>-h200-shared.json [--doc docs/capacity.md] [--check]

Only the rows the run measured change: Qwen3-4B, full fine-tune in the run's --dtype, on an H200, at a row length the
run trained. A row whose vLLM utilisation differs from the run's says at which one it was measured (vLLM's share
changes its KV cache, not its speed at the run's concurrency, nor the trainer's); such a row is filled only where
its `trainer memory` verdict is PASS. The sentence above the table that
said these columns were not measured names the run instead. --check prints the new table and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Found wherever the paragraph wraps it.
NOT_YET = re.compile(r"Tokens/s\s+and\s+steps/h\s+of\s+a\s+shared\s+card:\s+not\s+measured\s+yet\.")


def cells(summary: dict, length: int) -> tuple[str, str] | None:
    row = summary.get(str(length)) or {}
    need = ("gen_tok_s_together", "steps_per_h_together", "steps_per_h_alone")
    if summary.get("gen_alone_tok_s") is None or any(row.get(k) is None for k in need):
        return None
    tok = f"{row['gen_tok_s_together']:,.0f} (alone {summary['gen_alone_tok_s']:,.0f})"
    steps = f"{row['steps_per_h_together']:,.0f} (alone {row['steps_per_h_alone']:,.0f})"
    return tok, steps


def fill(doc: str, result: dict, raw: str) -> tuple[str, int]:
    summary, args = result["summary"], result["args"]
    head, rest = doc.split("### What fits on one card", 1)
    start = rest.index("\n| model |")
    grid, tail = rest[start:].split("\n\n", 1) if "\n\n" in rest[start:] else (rest[start:], "")
    lines, changed = grid.split("\n"), 0
    for i, line in enumerate(lines):
        if not line.startswith("| Qwen3-"):
            continue
        row = [c.strip() for c in line.strip("|").split("|")]
        model, training, tokens, card = row[:4]
        name, share = card.rsplit(", ", 1)
        length = int(tokens.replace(",", ""))
        if model != "Qwen3-4B" or training != f"full, {args['dtype']}" or name != "H200":
            continue
        got = cells(summary, length)
        if got is None:
            continue
        util = args["gpu_memory_utilization"]
        note = "" if abs(float(share) - util) < 1e-9 else f", vLLM at {util:.2f}"
        if note and row[6] != "PASS":  # a tighter share than the run's may not hold what it measured
            continue
        row[8], row[9] = got[0] + note, got[1]
        lines[i] = "| " + " | ".join(row) + " |"
        changed += 1
    m = summary["micro_batches_per_step"]
    c = args["concurrency"]
    said = (f"Tokens/s and steps/h of a shared card: measured on one H200 by `bench/gpu_shared.py` ([raw]({raw})), "
            f"vLLM's generated tokens/s with {c} requests at a time ({args['prompt_tokens']} prompt + "
            f"{args['max_tokens']} generated tokens each) while the trainer steps on the same card, and optimizer "
            f"steps/h (3600 x steps/s, {m} packed row{'s' if m > 1 else ''} of that length per step, "
            f"`--micro-batches-per-step {m}`) while vLLM generates; each with its rate alone on the card beside it.")
    before = head + "### What fits on one card" + rest[:start]
    found = NOT_YET.search(before)
    if found is None:
        raise SystemExit("the sentence about the unmeasured columns is not above the table: edit it by hand")
    # The paragraph keeps the docs' 120-column wrap.
    end = found.end()
    start_par = before.rindex("\n\n", 0, end) + 2
    paragraph = (before[start_par:found.start()] + said).replace("\n", " ")
    wrapped = textwrap.fill(paragraph, 120, break_long_words=False, break_on_hyphens=False)
    before = before[:start_par] + wrapped + before[end:]
    return before + "\n".join(lines) + ("\n\n" + tail if tail else ""), changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--doc", default=str(ROOT / "docs" / "capacity.md"))
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    result = json.loads(Path(args.json).read_text())
    doc = Path(args.doc)
    # The link is read from the doc's own folder.
    raw = os.path.relpath(Path(args.json).resolve(), doc.resolve().parent)
    text, changed = fill(doc.read_text(), result, raw)
    if not changed:
        print("no row of the table was measured by this run: nothing filled", file=sys.stderr)
        return 1
    if args.check:
        section = text.split("### What fits on one card", 1)[1]
        print(section[:section.index("\nH200: ")])
    else:
        doc.write_text(text)
    print(f"filled {changed} row(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
