"""Real Python work for `cargo xtask bench`: JSON encoding and decoding of a nested document, as
a web service does. Prints the seconds the work took (measured inside, so that a tracer's start-up
and shutdown are not counted) on one line: `seconds S`. The first argument is the number of rounds
(40 by default, about 0.4 s here; the bench's windowed runs take 300); four decoded documents are
kept, whatever the number. With `--deep` (after the rounds, or alone), each document is instead
made of chains nested 40 levels deep: json's C encoder and decoder recurse once a level, so every
allocation deep in a chain has 100+ native frames below it (`cargo xtask bench --servers`)."""
import json
import sys
import time

ARGS = [arg for arg in sys.argv[1:] if arg != "--deep"]
DEEP = "--deep" in sys.argv[1:]
ROUNDS = int(ARGS[0]) if ARGS else 40
DEPTH = 40


def document(n):
    return {
        "items": [
            {"id": i, "name": "item-%d" % i, "tags": ["a", "b", str(i)], "price": i * 1.5}
            for i in range(n)
        ],
        "meta": {"count": n, "source": "bench"},
    }


def chain(i):
    """One item nested DEPTH levels: each level a small object holding the next."""
    node = {"id": i, "name": "leaf-%d" % i, "tags": ["a", "b", str(i)], "price": i * 1.5}
    for level in range(DEPTH):
        node = {"level": level, "name": "node-%d" % level, "tags": [str(i)], "child": node}
    return node


def deep_document(n):
    return {"items": [chain(i) for i in range(n)], "meta": {"count": n, "source": "bench"}}


def main():
    start = time.perf_counter()
    kept = []
    for round_no in range(ROUNDS):
        value = deep_document(120) if DEEP else document(5000)
        back = json.loads(json.dumps(value))
        if round_no % 10 == 0 and len(kept) < 4:
            kept.append(back)
    print("seconds %.6f" % (time.perf_counter() - start), flush=True)


main()
