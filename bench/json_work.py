"""Real Python work for `cargo xtask bench`: JSON encoding and decoding of a nested document, as
a web service does. Prints the seconds the work took (measured inside, so that a tracer's start-up
and shutdown are not counted) on one line: `seconds S`. The first argument is the number of rounds
(40 by default, about 0.4 s here; the bench's windowed runs take 300); four decoded documents are
kept, whatever the number."""
import json
import sys
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 40


def document(n):
    return {
        "items": [
            {"id": i, "name": "item-%d" % i, "tags": ["a", "b", str(i)], "price": i * 1.5}
            for i in range(n)
        ],
        "meta": {"count": n, "source": "bench"},
    }


def main():
    start = time.perf_counter()
    kept = []
    for round_no in range(ROUNDS):
        text = json.dumps(document(5000))
        back = json.loads(text)
        if round_no % 10 == 0 and len(kept) < 4:
            kept.append(back)
    print("seconds %.6f" % (time.perf_counter() - start), flush=True)


main()
