"""A host-tier hit on a running HiCache server (``make serve-cpu``'s README example).

``python scripts/host_tier_demo.py [--port 30000] [--words 400]`` sends a prompt,
then prompts of more tokens than the README's 1024-token device pool holds (so
the first one is evicted to the host tier), then the first prompt again, and
prints each answer's ``cached_tokens_details``; the revisit reads its prefix
from host memory.  Exits 1 when the revisit got no host-tier tokens.  Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request

WORDS = "cache prefix token rank host device page layer tree radix decode".split()


def generate(port: int, text: str) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["meta_info"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--words", type=int, default=400, help="tokens per prompt")
    parser.add_argument("--evict-tokens", type=int, default=1024, help="device pool")
    args = parser.parse_args(argv)
    rng = random.Random(0)

    def prompt():
        return " ".join(rng.choice(WORDS) for _ in range(args.words))

    first = prompt()
    others = [prompt() for _ in range(-(-args.evict_tokens // args.words))]
    for i, text in enumerate([first, *others, first + " again"]):
        meta = generate(args.port, text)
        label = "revisit" if i == len(others) + 1 else f"prompt {i}"
        details = meta.get("cached_tokens_details") or {}
        print(f"{label}: {meta['prompt_tokens']} tokens, cached {details or 0}")
    return 0 if details.get("host", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
