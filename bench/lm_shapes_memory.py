"""The LM's memory as it meets prompts of many lengths: does each new length keep memory?

    python bench/lm_shapes_memory.py MODEL_DIR [--backend auto] [--steps 60] [--lengths 11] [--descending] \
        [--repeat 1] [--threads 2] [--prefill pieces|one-call|both]

One engine, the bench's registered voice, the LM alone: the bench's sentence (``--repeat`` times over) cut to
``--lengths`` word counts (each a prompt of another length), every length once and then all again (ascending, or
``--descending`` the first time), ``--steps`` decode steps each. After each request: prefill and median decode step,
RSS, peak RSS, what glibc's malloc holds free and the anonymous memory. A backend that keeps something per prompt
length grows on the first pass and not on the second; one that keeps only its largest call's memory grows only up to
the longest length.

``--prefill`` (the stateful OpenVINO LM only): ``pieces``, as the engine runs it (``lm.state_graph.prefill_pieces``),
``one-call``, the whole prefill in one call as before the pieces (memory per length), or ``both``: each request
twice, the two forms alternated (which goes first turning with each length and pass), and each form's prefill per
length on the second pass at the end; the number of calls each form made is printed. Nothing here is imported
by the runtime.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cosyvoice_cpu.benchmark.tasks import TEXT, graph_backends, load, timed_request
from cosyvoice_cpu.hardware.malloc import malloc_free_bytes
from cosyvoice_cpu.hardware.pages import status_mb
from cosyvoice_cpu.lm import state_graph

PIECES = state_graph.prefill_pieces
FORMS = {"pieces": PIECES, "one-call": lambda n: [(0, n, 0)]}
CALLS = dict.fromkeys(FORMS, 0)  # the calls each form gave StateCache.prefill (proof that the switch reached it)


def _switch(form: str) -> None:
    """Make StateCache.prefill (which looks the function up at every prefill) run ``form``, counting its calls."""

    def pieces(n: int) -> list[tuple[int, int, int]]:
        out = FORMS[form](n)
        CALLS[form] += len(out)
        return out

    state_graph.prefill_pieces = pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lengths", type=int, default=11)
    ap.add_argument("--descending", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="the sentence this many times over (longer prompts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", choices=[*FORMS, "both"], default="pieces")
    args = ap.parse_args()
    if args.steps < 1 or args.lengths < 1 or args.repeat < 1:
        ap.error("--steps, --lengths and --repeat must be at least 1")
    engine, voice = load(args.model_dir, args.threads, backend=args.backend)
    forms = list(FORMS) if args.prefill == "both" else [args.prefill]
    stateful = isinstance(engine.lm.session.runner, state_graph.StateGraph)
    if forms != ["pieces"] and not stateful:
        engine.close()
        ap.error("--prefill: only the stateful (OpenVINO) LM prefills in pieces; this LM runs on a bound ONNX graph")
    prompt_ids, prompt_speech, speaker = engine.lm_prompt(voice, None, False)
    words = " ".join([TEXT] * args.repeat).split()
    counts = sorted({max(1, round(len(words) * (i + 1) / args.lengths)) for i in range(args.lengths)})
    order = (counts[::-1] if args.descending else counts) + counts
    lm_on = graph_backends(engine.plan).get("lm", "?")
    print(f"--backend {args.backend}: the LM on {lm_on}; after load RSS {status_mb('VmRSS'):.0f} MB")
    print(f"{'#':>3} {'text ids':>8} {'prefill ms':>10} {'step ms':>7} {'RSS MB':>7} {'peak MB':>7} "
          f"{'malloc free MB':>14} {'anon MB':>7}" + (" form" if len(forms) > 1 else ""))  # fmt: skip
    prefills: dict[tuple[str, int], list[float]] = {}
    row = 0
    for i, n in enumerate(order):
        text_ids = engine.tokenizer.encode(" ".join(words[:n]))
        turn = (i + i // len(counts)) % len(forms)  # which form goes first turns with each length and pass
        for form in forms[turn:] + forms[:turn]:
            _switch(form)
            request = engine.lm.request(
                text_ids, prompt_ids, prompt_speech, seed=i, budget=(args.steps, args.steps), speaker=speaker
            )
            prefill, steps = timed_request(request)
            if i >= len(counts):  # the second pass: every size met before
                prefills.setdefault((form, len(text_ids)), []).append(prefill)
            step = statistics.median(steps) * 1000 if steps else float("nan")
            free = malloc_free_bytes()
            print(f"{row:3d} {len(text_ids):8d} {prefill * 1000:10.0f} {step:7.1f} {status_mb('VmRSS'):7.0f} "
                  f"{status_mb('VmHWM'):7.0f} {'-' if free is None else f'{free / 1e6:.0f}':>14} "
                  f"{status_mb('RssAnon'):7.0f}" + (f" {form}" if len(forms) > 1 else ""))  # fmt: skip
            row += 1
    state_graph.prefill_pieces = PIECES
    if stateful:
        print("prefill calls: " + ", ".join(f"{form} {CALLS[form]}" for form in forms))
    if len(forms) > 1:
        print("second pass, prefill ms by text ids: one-call / pieces")
        for ids in sorted({k[1] for k in prefills}):
            one, pieces = (statistics.median(prefills[(f, ids)]) for f in ("one-call", "pieces"))
            print(f"{ids:8d} {one * 1000:7.0f} {pieces * 1000:7.0f} {one / pieces:6.2f}")
    engine.close()


if __name__ == "__main__":
    main()
