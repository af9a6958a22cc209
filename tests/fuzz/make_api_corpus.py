#!/usr/bin/env python3
"""Writes the API fuzzer's seed corpus (tests/fuzz/api_corpus/seed_*): random programs
(api_harness.hpp decodes any bytes), ten per memory kind (the first byte), some with
every operation's fault byte armed. Deterministic: the same files every run."""
import os
import random

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api_corpus")
os.makedirs(here, exist_ok=True)
rng = random.Random(20261126)
kinds = ["contig", "paged", "ring", "iswa"]
for k, kind in enumerate(kinds):
    for i in range(10):
        n = rng.randrange(40, 400)
        body = bytearray(rng.randrange(256) for _ in range(n))
        if i % 3 == 0:  # placement-heavy: most opcodes place
            for j in range(0, n, 9):
                body[j] = rng.choice([0, 1, 2, 3, 16, 17, 19])
        with open(os.path.join(here, f"seed_{kind}_{i:02d}"), "wb") as f:
            f.write(bytes([k + 4 * rng.randrange(8)]) + bytes(body))
